"""Figures across runs: means and 95% confidence intervals over seeds, knees, saturation.

* A policy's **knee** in a scenario is the lowest swept load at which it misses the SLO
  for too many requests: fewer than 90% of requests good (TTFT and ITL within the SLO)
  or TTFT p90 above the SLO's TTFT.
* A scenario's **saturation** load is the knee of ``least-loaded`` (round-robin's if
  least-loaded did not run): where the cluster runs out of capacity for a router that
  balances load and ignores the cache. Claims about "70-90% of saturation" use the
  swept loads in that window of it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from bench.sim.plan import Cell
from bench.sim.results import RunResult

Results = Mapping[Cell, RunResult]

#: Two-sided 95% Student t quantiles by degrees of freedom.
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}

METRICS: dict[str, Callable[[RunResult], float]] = {
    "hit_ratio": lambda r: r.hit_ratio,
    "ttft_p50_s": lambda r: r.ttft(50),
    "ttft_p90_s": lambda r: r.ttft(90),
    "ttft_p99_s": lambda r: r.ttft(99),
    "itl_p50_s": lambda r: r.itl(50),
    "itl_p90_s": lambda r: r.itl(90),
    "e2e_p50_s": lambda r: r.e2e(50),
    "e2e_p90_s": lambda r: r.e2e(90),
    "throughput_tok_s": lambda r: r.throughput,
    "goodput_req_s": lambda r: r.goodput,
    "good_fraction": lambda r: r.good_fraction,
    "routed_hit_ratio": lambda r: r.routed_hit_ratio,
    "prefill_tokens": lambda r: r.prefill_tokens,
    "capacity_bound_tokens": lambda r: r.capacity_bound_tokens,
    "imbalance": lambda r: r.imbalance,
    "preemptions": lambda r: r.preemptions,
    "evicted_blocks": lambda r: r.evicted_blocks,
    "ttft_floor_p90_s": lambda r: r.ttft_floor(90),
}
HIGHER_IS_BETTER = {
    "hit_ratio", "routed_hit_ratio", "throughput_tok_s", "goodput_req_s", "good_fraction",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Estimate:
    mean: float
    half_width: float  # of the 95% CI; 0 with one seed
    n: int

    def text(self, fmt: str = ".3f") -> str:
        if self.n < 2:
            return format(self.mean, fmt)
        return f"{self.mean:{fmt}}±{self.half_width:{fmt.lstrip('+')}}"


def estimate(values: list[float]) -> Estimate:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return Estimate(math.nan, 0.0, 0)
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Estimate(mean, 0.0, len(values))
    t = _T95.get(len(values) - 1, 1.96)
    return Estimate(mean, t * statistics.stdev(values) / math.sqrt(len(values)), len(values))


def _runs(
    results: Results, study: str, scenario: str, policy: str, load: float, **kw: object
) -> list[tuple[Cell, RunResult]]:
    """The runs (one per seed) of one (study, scenario, policy, load) point."""
    return [
        (c, r)
        for c, r in results.items()
        if c.study == study
        and c.scenario == scenario
        and c.policy == policy
        and c.load == load
        and all(getattr(c, k) == v for k, v in kw.items())
    ]


def point(
    results: Results, study: str, scenario: str, policy: str, load: float, metric: str, **kw: object
) -> Estimate:
    """A metric over the seeds of one (study, scenario, policy, load) point."""
    get = METRICS[metric]
    return estimate([get(r) for _, r in _runs(results, study, scenario, policy, load, **kw)])


def paired(
    results: Results, scenario: str, policy: str, other: str, load: float, metric: str
) -> Estimate:
    """``policy``'s sweep ``metric`` relative to ``other``'s (``policy / other - 1``), seed
    by seed, at one load. Runs of one seed share the arrivals, so the seed-to-seed spread
    both share cancels: the interval is that of the difference, usually much narrower
    than the two policies' own intervals side by side."""
    get = METRICS[metric]
    mine, theirs = (
        {c.seed: get(r) for c, r in _runs(results, "sweep", scenario, p, load)}
        for p in (policy, other)
    )
    return estimate(
        [mine[s] / theirs[s] - 1 for s in sorted(mine.keys() & theirs.keys()) if theirs[s]]
    )


def axes(results: Results, study: str, scenario: str) -> tuple[list[str], list[float]]:
    """Policies (in run order) and loads (sorted) of one scenario's study."""
    policies: list[str] = []
    loads: set[float] = set()
    for c in results:
        if c.study == study and c.scenario == scenario:
            if c.policy not in policies:
                policies.append(c.policy)
            loads.add(c.load)
    return policies, sorted(loads)


def knee(results: Results, scenario: str, policy: str, slo_ttft_s: float) -> float | None:
    """The lowest swept load where ``policy`` misses the SLO (None: never in the sweep)."""
    _, loads = axes(results, "sweep", scenario)
    for load in loads:
        good = point(results, "sweep", scenario, policy, load, "good_fraction")
        ttft = point(results, "sweep", scenario, policy, load, "ttft_p90_s")
        if good.n and (good.mean < 0.9 or ttft.mean > slo_ttft_s):
            return load
    return None


def saturation(results: Results, scenario: str, slo_ttft_s: float) -> tuple[float | None, str]:
    policies, _ = axes(results, "sweep", scenario)
    for reference in ("least-loaded", "round-robin"):
        if reference in policies:
            return knee(results, scenario, reference, slo_ttft_s), reference
    return None, "none"

"""What one run measured, and the figures the report is made of.

Definitions (the report's column headers refer to these):

* **hit ratio** - reused prompt tokens / prompt tokens, over completed requests (reused
  = tokens of the cached prefix found at the request's first admission); the *routed*
  hit ratio leaves out requests that reached a pod around the router;
* **prefill tokens** - prompt tokens computed at first admission (prompt - reused);
  tokens recomputed after a preemption are counted apart (``recomputed_tokens``);
* **TTFT** - arrival at the gateway to the end of the step that sampled the first
  token; **ITL** - a request's mean time between later tokens; **e2e** - arrival to
  the last token; p50/p90/p99 over completed requests;
* **throughput** - output tokens per second of virtual time (first arrival to last
  completion); **goodput** - requests per second that completed within the SLO (TTFT
  and ITL both at most the SLO's), and ``good`` the fraction of all requests that did
  (rejected ones count as not good);
* **bounds** (:mod:`bench.sim.bounds`, on the run's own arrivals) - the ideal prefill
  and the capacity bound on prefill (no policy computes fewer prefill tokens), and the
  TTFT floor (no policy answers a request sooner; its percentiles bound TTFT's);
* **imbalance** - requests routed to the busiest pod / the mean per pod (1.0 = even);
* **util** - the fraction of the run the pods were running a step (mean over pods).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.sim.pod import Job


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(math.ceil(q / 100 * len(ordered)), 1)
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class Slo:
    """The service level a request must meet to count in goodput."""

    ttft_s: float = 2.0
    itl_s: float = 0.1

    def met(self, job: Job) -> bool:
        return job.ttft_s <= self.ttft_s and job.itl_s <= self.itl_s


@dataclass(slots=True)
class GroupStats:
    """Per reusable context (a document, a system-prompt group): what it cost."""

    requests: int = 0
    computed_tokens: int = 0
    fresh_tokens: int = 0
    pods: set[int] = field(default_factory=set)


@dataclass(slots=True)
class RunResult:
    scenario: str
    workload: str
    policy: str
    slo: Slo = field(default_factory=Slo)
    replicas: int = 1
    load: float = 1.0
    faults: str = "no faults"
    requests: int = 0  # completed
    rejected: int = 0
    retried: int = 0  # requests routed again after their pod restarted
    direct: int = 0  # requests that reached a pod around the router
    good: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    direct_prompt_tokens: int = 0  # of prompt_tokens, in requests that bypassed the router
    direct_reused_tokens: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    output_tokens: int = 0
    ideal_prefill_tokens: int = 0
    no_cache_prefill_tokens: int = 0
    capacity_bound_tokens: int = 0  # bench.sim.bounds: no policy computes less here
    ttft_floors: list[float] = field(default_factory=list)  # per request: none is faster
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (arrival, rid)
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    routed_per_pod: list[int] = field(default_factory=list)
    evicted_blocks: int = 0
    duplicate_stores: int = 0
    ghost_blocks: int = 0
    preemptions: int = 0
    steps: int = 0
    batched_tokens: int = 0
    batches: int = 0
    events: int = 0
    restarts: int = 0
    resets: int = 0
    resets_refused: int = 0
    virtual_s: float = 0.0
    busy_s: float = 0.0  # summed over pods
    pods: int = 0
    wall_s: float = 0.0
    spills: int | None = None
    index: dict[str, Any] | None = None  # runs through kvindex: syncs, agreement check
    groups: dict[str, GroupStats] = field(default_factory=dict)

    def record(self, job: Job, block_size: int) -> None:
        """A completed request."""
        request = job.keyed.request
        self.requests += 1
        self.prompt_tokens += len(request.prompt)
        self.reused_tokens += job.hit_blocks * block_size
        if job.direct:
            self.direct_prompt_tokens += len(request.prompt)
            self.direct_reused_tokens += job.hit_blocks * block_size
        self.prefill_tokens += job.computed_tokens
        self.recomputed_tokens += job.recomputed_tokens
        self.output_tokens += len(request.output)
        self.arrivals.append((job.arrival_s, request.rid))
        self.ttfts.append(job.ttft_s)
        self.itls.append(job.itl_s)
        self.e2es.append(job.finish_s - job.arrival_s)
        self.good += self.slo.met(job)
        group = self.groups.get(request.group)
        if group is None:
            group = self.groups[request.group] = GroupStats()
        group.requests += 1
        group.computed_tokens += job.computed_tokens
        group.fresh_tokens += request.fresh_tokens
        group.pods.add(job.pod)

    @property
    def hit_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def routed_hit_ratio(self) -> float:
        """The hit ratio of the requests the router placed (direct traffic left out)."""
        prompt = self.prompt_tokens - self.direct_prompt_tokens
        return (self.reused_tokens - self.direct_reused_tokens) / prompt if prompt else 0.0

    @property
    def imbalance(self) -> float:
        routed = self.routed_per_pod
        mean = sum(routed) / len(routed) if routed else 0.0
        return max(routed) / mean if mean else 0.0

    @property
    def throughput(self) -> float:
        """Output tokens per second of virtual time."""
        return self.output_tokens / self.virtual_s if self.virtual_s else 0.0

    @property
    def goodput(self) -> float:
        """Requests per second completed within the SLO."""
        return self.good / self.virtual_s if self.virtual_s else 0.0

    @property
    def good_fraction(self) -> float:
        total = self.requests + self.rejected
        return self.good / total if total else 0.0

    @property
    def utilization(self) -> float:
        span = self.virtual_s * self.pods
        return self.busy_s / span if span else 0.0

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts, q)

    def ttft_floor(self, q: float) -> float:
        return percentile(self.ttft_floors, q)

    def itl(self, q: float) -> float:
        return percentile(self.itls, q)

    def e2e(self, q: float) -> float:
        return percentile(self.e2es, q)

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures (no per-request data)."""
        out: dict[str, Any] = {
            "scenario": self.scenario,
            "workload": self.workload,
            "policy": self.policy,
            "replicas": self.replicas,
            "load": self.load,
            "faults": self.faults,
            "requests": self.requests,
            "rejected": self.rejected,
            "retried": self.retried,
            "direct": self.direct,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "hit_ratio": round(self.hit_ratio, 4),
            "routed_hit_ratio": round(self.routed_hit_ratio, 4),
            "prefill_tokens": self.prefill_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "ideal_prefill_tokens": self.ideal_prefill_tokens,
            "capacity_bound_prefill_tokens": self.capacity_bound_tokens,
            "no_cache_prefill_tokens": self.no_cache_prefill_tokens,
            "output_tokens": self.output_tokens,
        }
        for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
            out[f"ttft_{name}_s"] = _r(self.ttft(q))
            out[f"itl_{name}_s"] = _r(self.itl(q))
            out[f"e2e_{name}_s"] = _r(self.e2e(q))
            out[f"ttft_floor_{name}_s"] = _r(self.ttft_floor(q))
        out.update(
            {
                "throughput_tok_s": round(self.throughput, 1),
                "goodput_req_s": round(self.goodput, 4),
                "good_fraction": round(self.good_fraction, 4),
                "slo": {"ttft_s": self.slo.ttft_s, "itl_s": self.slo.itl_s},
                "imbalance": round(self.imbalance, 3),
                "routed_per_pod": self.routed_per_pod,
                "evicted_blocks": self.evicted_blocks,
                "duplicate_stores": self.duplicate_stores,
                "ghost_blocks": self.ghost_blocks,
                "preemptions": self.preemptions,
                "steps": self.steps,
                "batched_tokens": self.batched_tokens,
                "batches": self.batches,
                "events": self.events,
                "restarts": self.restarts,
                "resets": self.resets,
                "resets_refused": self.resets_refused,
                "virtual_s": round(self.virtual_s, 2),
                "utilization": round(self.utilization, 4),
                "wall_s": round(self.wall_s, 2),
            }
        )
        if self.spills is not None:
            out["spills"] = self.spills
        if self.index is not None:
            out["index"] = self.index
        if 1 < len(self.groups) <= 1000:
            pods = [len(g.pods) for g in self.groups.values()]
            out["groups"] = {
                "count": len(self.groups),
                "mean_pods_per_group": round(sum(pods) / len(pods), 3),
            }
        return out


def _r(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)

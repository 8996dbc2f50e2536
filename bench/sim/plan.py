"""Which runs a comparison makes: the standard table, the load sweep, the gateway
replica study and the fault study, each a list of :class:`Cell`.

* **standard** - every standard scenario at its own load, one gateway replica: the
  cache-hit and prefill picture per workload (and the document-QA claim);
* **sweep** - the load-study scenarios at each load factor, ``replicas`` gateway
  replicas: TTFT and goodput against offered load, the knees, claims 1-2;
* **replicas** - one load-study scenario at one load with 1, 2 and 4 replicas;
* **faults** - the same with pod restarts, prefix-cache resets and direct traffic
  (claim 3).

Every study runs every seed (``seeds``): the report gives means with 95% confidence
intervals, and the claims are judged on the means.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.sim.faults import FaultSpec


@dataclass(frozen=True, slots=True)
class Cell:
    """One run: the results are keyed by it."""

    study: str
    scenario: str
    policy: str
    load: float = 1.0
    replicas: int = 1
    faults: FaultSpec = field(default_factory=FaultSpec)
    seed: int = 0

    def label(self) -> str:
        return (
            f"{self.study} {self.scenario} x{self.load:g} r{self.replicas} "
            f"{self.faults.label()} s{self.seed} / {self.policy}"
        )


@dataclass(frozen=True, slots=True)
class PlanSpec:
    standard: list[str]  # scenario names
    sweep: list[str]
    policies: list[str]
    loads: list[float]
    seeds: int = 1
    sweep_replicas: int = 2
    replica_counts: list[int] = field(default_factory=lambda: [1, 2, 4])
    study_scenario: str = "chat-load"
    study_load: float = 1.0
    study_policies: list[str] = field(default_factory=list)
    faults: list[FaultSpec] = field(default_factory=list)


def cells(spec: PlanSpec) -> list[Cell]:
    seeds = range(spec.seeds)
    out = [
        Cell("standard", s, p, seed=n) for s in spec.standard for n in seeds for p in spec.policies
    ]
    for scenario in spec.sweep:
        for load in spec.loads:
            for seed in seeds:
                out.extend(
                    Cell("sweep", scenario, p, load, spec.sweep_replicas, seed=seed)
                    for p in spec.policies
                )
    study = spec.study_policies or spec.policies
    scenario, load = spec.study_scenario, spec.study_load
    if scenario and spec.replica_counts:
        for replicas in spec.replica_counts:
            for seed in seeds:
                out.extend(Cell("replicas", scenario, p, load, replicas, seed=seed) for p in study)
    if scenario and spec.faults:
        for faults in [FaultSpec(), *spec.faults]:
            for seed in seeds:
                out.extend(Cell("faults", scenario, p, load, 2, faults, seed) for p in study)
    return out

"""A catalog of long shared prefixes (documents, system prompts) asked about by
independent requests, with Zipf popularity and bursty arrivals.

Document QA over a library larger than a pod's cache is the canonical case: each
request is one document plus a short question, the popular documents come back
often and the tail rarely, and requests arrive in bursts (``burst`` at a time, a
mean ``burst_gap_s`` apart) at a mean ``rate`` per second. Requests carry no session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from bench.sim.workloads import (
    SimRequest,
    Workload,
    WorkloadSpec,
    _Source,
    bursty_starts,
    zipf_weights,
)


@dataclass(slots=True)
class CatalogSpec(WorkloadSpec):
    kind: ClassVar[str] = "catalog"
    help: ClassVar[str] = "a catalog of long prefixes, Zipf popularity, bursty open-loop arrivals"
    items: int = 24
    item_tokens: int = 3000
    zipf: float = 0.6
    question_tokens: int = 80
    output_tokens: int = 100
    requests: int = 1200
    rate: float = 4.0
    burst: int = 1
    burst_gap_s: float = 0.05

    def build(self, seed: int, name: str | None = None) -> Workload:
        src = _Source(seed)
        items = [src.tokens(self.item_tokens) for _ in range(self.items)]
        weights = zipf_weights(self.items, self.zipf)
        starts = bursty_starts(src, self.requests, self.rate, self.burst, self.burst_gap_s)
        reqs = []
        for rid, start in enumerate(starts):
            item = src.rng.choices(range(self.items), weights)[0]
            question = src.tokens(src.around(self.question_tokens))
            reqs.append(
                SimRequest(
                    rid=rid,
                    session=rid,
                    group=f"doc{item}",
                    prompt=items[item] + question,
                    output=src.tokens(src.around(self.output_tokens)),
                    fresh_tokens=len(question),
                    start_s=start,
                )
            )
        return Workload(name or self.kind, self.kind, self.params(), reqs, self.requests)

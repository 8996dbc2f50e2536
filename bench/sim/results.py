"""What one run measured, and the figures the report is made of.

Definitions (the report's column headers refer to these):

* **hit ratio** - reused prompt tokens / prompt tokens, over admitted requests (reused =
  tokens in the cached prefix blocks vLLM did not recompute);
* **prefill tokens** - prompt tokens computed (prompt tokens - reused);
* **TTFT** - modelled time to first token (queueing + prefill, see ``costs``), p50/p90/
  p99 over admitted requests;
* **imbalance** - requests routed to the busiest pod / the mean per pod (1.0 = even);
* **rejected** - requests a pod refused (queue full, or larger than its whole pool).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(math.ceil(q / 100 * len(ordered)), 1)
    return ordered[rank - 1]


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
    requests: int = 0
    admitted: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefill_tokens: int = 0
    ideal_prefill_tokens: int = 0
    no_cache_prefill_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    routed_per_pod: list[int] = field(default_factory=list)
    evicted_blocks: int = 0
    duplicate_stores: int = 0
    ghost_blocks: int = 0
    batches: int = 0
    events: int = 0
    virtual_s: float = 0.0
    prefill_busy_s: float = 0.0  # summed over pods
    pods: int = 0
    wall_s: float = 0.0
    spills: int | None = None
    index: dict[str, Any] | None = None  # precise only: sync counts, agreement check
    groups: dict[str, GroupStats] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        routed = self.routed_per_pod
        mean = sum(routed) / len(routed) if routed else 0.0
        return max(routed) / mean if mean else 0.0

    @property
    def achieved_rate(self) -> float:
        """Requests per second of virtual time, first arrival to last completion."""
        return self.requests / self.virtual_s if self.virtual_s else 0.0

    @property
    def prefill_utilization(self) -> float:
        """Fraction of the run the pods' prefill queues were busy (mean over pods)."""
        span = self.virtual_s * self.pods
        return self.prefill_busy_s / span if span else 0.0

    def ttft(self, q: float) -> float:
        return percentile(self.ttfts, q)

    def summary(self) -> dict[str, Any]:
        """JSON-ready figures (no per-request data)."""
        out: dict[str, Any] = {
            "scenario": self.scenario,
            "workload": self.workload,
            "policy": self.policy,
            "requests": self.requests,
            "admitted": self.admitted,
            "rejected": self.rejected,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "hit_ratio": round(self.hit_ratio, 4),
            "prefill_tokens": self.prefill_tokens,
            "ideal_prefill_tokens": self.ideal_prefill_tokens,
            "no_cache_prefill_tokens": self.no_cache_prefill_tokens,
            "ttft_p50_s": round(self.ttft(50), 4),
            "ttft_p90_s": round(self.ttft(90), 4),
            "ttft_p99_s": round(self.ttft(99), 4),
            "ttft_mean_s": round(sum(self.ttfts) / len(self.ttfts), 4) if self.ttfts else None,
            "imbalance": round(self.imbalance, 3),
            "routed_per_pod": self.routed_per_pod,
            "evicted_blocks": self.evicted_blocks,
            "duplicate_stores": self.duplicate_stores,
            "ghost_blocks": self.ghost_blocks,
            "batches": self.batches,
            "events": self.events,
            "virtual_s": round(self.virtual_s, 2),
            "achieved_rate": round(self.achieved_rate, 3),
            "prefill_utilization": round(self.prefill_utilization, 4),
            "wall_s": round(self.wall_s, 2),
        }
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

"""Faults injected during a run, spread evenly over the workload's arrivals.

* ``restarts`` - a pod's engine restarts (round the pods in turn): its KV cache is
  lost, its event seq starts again at 0, batches not yet delivered are lost, and the
  requests it held are retried by their gateway (routed again, keeping their arrival
  time, so the restart shows in their TTFT);
* ``resets`` - ``reset_prefix_cache`` on a pod: vLLM drops every hash and publishes
  ``AllBlocksCleared``, but refuses while blocks are in use (counted as refused);
* ``direct`` - this fraction of requests reaches a pod chosen at random around the
  router (batch jobs, health checks, another team's client): no replica routes it or
  learns of it; only the pods' events tell.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FaultSpec:
    restarts: int = 0
    resets: int = 0
    direct: float = 0.0

    def __post_init__(self) -> None:
        if self.restarts < 0 or self.resets < 0 or not 0.0 <= self.direct < 1.0:
            raise ValueError("restarts and resets must be >= 0, direct in [0, 1)")

    @property
    def any(self) -> bool:
        return bool(self.restarts or self.resets or self.direct)

    def times(self, count: int, span_s: float) -> list[float]:
        """``count`` instants spread evenly inside ``(0, span_s)``."""
        return [span_s * (i + 1) / (count + 1) for i in range(count)]

    def label(self) -> str:
        parts = []
        if self.restarts:
            parts.append(f"{self.restarts} restarts")
        if self.resets:
            parts.append(f"{self.resets} resets")
        if self.direct:
            parts.append(f"{self.direct:.0%} direct")
        return ", ".join(parts) or "no faults"

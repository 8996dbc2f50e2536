"""How late kvindex sees a pod's events: a seeded delay per published batch.

A batch leaves the pod when its step ends; the index applies it ``delay`` seconds of
virtual time later. The default is log-normal with a 2 ms median and sigma 1 (p90
7 ms, p99 20 ms, a heavier tail): ZMQ over a LAN plus the subscriber's batching, with
the occasional GC pause or busy Redis. A pod's batches stay in order (a late batch
holds back the ones after it), as one ZMQ stream does. Zero turns lag off.

The runner makes the lag deterministic: before a decision it publishes every batch
whose time has come and waits until kvindex applied them, so the index the router asks
at virtual time t holds exactly the batches released by t - whatever wall-clock speed
the machine runs at.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LagModel:
    median_ms: float = 2.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.median_ms < 0 or self.sigma < 0:
            raise ValueError("lag median and sigma must be >= 0")

    def sampler(self, seed: int) -> LagSampler:
        return LagSampler(self, seed)

    def describe(self) -> str:
        if self.median_ms == 0:
            return "no event lag"
        p99 = self.median_ms * math.exp(2.326 * self.sigma)
        return f"event lag log-normal, median {self.median_ms:g} ms, p99 {p99:.0f} ms"


class LagSampler:
    def __init__(self, model: LagModel, seed: int) -> None:
        self._mu = math.log(model.median_ms / 1000) if model.median_ms > 0 else None
        self._sigma = model.sigma
        self._rng = random.Random(seed ^ 0x5A5A)

    def delay_s(self) -> float:
        if self._mu is None:
            return 0.0
        return self._rng.lognormvariate(self._mu, self._sigma)

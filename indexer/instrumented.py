"""The ingest sink, instrumented: how late each engine batch is applied.

A wrapper around the :class:`~kvindex.events.ingest.sink.BatchSink` the subscriber
delivers to (the backends stay free of metrics): it observes each batch's event lag for
``/metrics`` and hands each member's latest lag to whoever routes by it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvindex.events.ingest.sink import BatchSink, Delivery
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.timestamps import TIMESTAMP_PROBLEMS, timestamp_problem

_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class MemberLag(Protocol):
    """Each member's latest event lag (``/route`` reads it to doubt a late pod)."""

    def record(self, member: str, lag: float, ts: float) -> None: ...

    def forget(self, member: str) -> None: ...


class InstrumentedSink:
    """Wraps a BatchSink to record event lag (now - the engine's batch timestamp).

    Timestamps that are no clock reading (NaN, ±inf, <= 0, a day or more away from now:
    :mod:`kvindex.events.wire.timestamps`) are counted by reason instead, so one broken
    engine clock cannot wreck the lag histogram for every pod.
    """

    def __init__(
        self,
        inner: BatchSink,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.time,
        lag: MemberLag | None = None,
    ) -> None:
        self._inner = inner
        self._clock = clock
        self._last_lag = lag  # each member's latest lag, for /route's staleness check
        self._lag = Histogram(
            "kvindex_event_lag_seconds",
            "Delay from an engine making a batch to kvindex applying it (clock skew included).",
            buckets=_LAG_BUCKETS,
            registry=registry,
        )
        bad = Counter(
            "kvindex_event_bad_timestamps",
            "Batches whose engine timestamp is no clock reading, left out of the event lag, "
            "by reason (not_a_number, infinite, not_positive, too_old, in_the_future).",
            ["reason"],
            registry=registry,
        )
        self._bad_ts = {reason: bad.labels(reason) for reason in TIMESTAMP_PROBLEMS}

    def deliver(self, deliveries: Sequence[Delivery]) -> None:
        self._inner.deliver(deliveries)
        now = self._clock()
        observe = self._lag.observe
        for delivery in deliveries:
            batch = delivery.batch
            # One observation per engine batch, also when a delivery holds several.
            for ts in batch.timestamps if delivery.batches > 1 else (batch.ts,):  # type: ignore[union-attr]
                problem = timestamp_problem(ts, now)
                if problem is None:
                    observe(max(0.0, now - ts))
                    if self._last_lag is not None and not delivery.replayed:
                        self._last_lag.record(delivery.stream.member, now - ts, ts)
                else:
                    self._bad_ts[problem].inc()

    def reset(self, stream: StreamId, reason: str) -> None:
        self._inner.reset(stream, reason)
        if self._last_lag is not None:
            self._last_lag.forget(stream.member)

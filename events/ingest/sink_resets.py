"""Sink resets the applier owes: asked for, and retried until the sink takes them.

A stream's entries are reset in the sink when its engine restarts and when the stream
leaves the table. The sink may refuse (the Redis backend is down): the reset is then
owed, a stream applies nothing until its own reset went through (its next batch belongs
after it), and the resets of streams already gone are retried on a timer.
"""

from __future__ import annotations

from collections.abc import Callable, Container

from kvindex.events.ingest.ratelog import RateLimitedLog
from kvindex.events.ingest.sink import BatchSink
from kvindex.events.ingest.status import ReasonCounts
from kvindex.events.wire.identity import StreamId


class PendingResets:
    """The owed resets, by stream, and the sink calls that settle them (applier thread
    only). ``retry_s`` spaces the retries of streams no longer in the table."""

    def __init__(
        self,
        sink: BatchSink,
        errors: ReasonCounts,
        ratelog: RateLimitedLog,
        clock: Callable[[], float],
        retry_s: float,
    ) -> None:
        self._sink = sink
        self._errors = errors
        self._ratelog = ratelog
        self._clock = clock
        self._retry_s = retry_s
        self._owed: dict[StreamId, str] = {}  # stream -> the reset's reason
        self._orphan_retry_at = 0.0

    def owe(self, sid: StreamId, reason: str) -> None:
        self._owed[sid] = reason

    def cancel(self, sid: StreamId) -> None:
        self._owed.pop(sid, None)

    def settle(self, sid: StreamId) -> bool:
        """Run ``sid``'s owed reset, if any; False when the sink refused it."""
        reason = self._owed.get(sid)
        return reason is None or self.reset(sid, reason)

    def reset(self, sid: StreamId, reason: str) -> bool:
        """Reset ``sid`` in the sink now; on success nothing is owed for it any more."""
        try:
            self._sink.reset(sid, reason)
        except Exception as exc:
            self._errors.add("sink_error")
            self._ratelog.error(
                "sink_reset_error",
                "KV events: the sink failed to reset %s (%s): %r",
                sid,
                reason,
                exc,
            )
            return False
        self._owed.pop(sid, None)
        return True

    def reset_pod(self, pod: str, reason: str, live: Container[StreamId]) -> None:
        """Run the owed resets of ``pod``'s streams that are not ``live``, as ``reason``."""
        for sid in [s for s in self._owed if s.pod == pod and s not in live]:
            self.reset(sid, reason)

    def retry_orphans(self, now: float, live: Container[StreamId]) -> None:
        """When due at ``now``: retry the owed resets of streams that are not ``live``."""
        if now < self._orphan_retry_at:
            return
        failed = False
        for sid, reason in list(self._owed.items()):
            if sid not in live and not self.reset(sid, reason):
                failed = True
        self._orphan_retry_at = self._clock() + (self._retry_s if failed else 0)

    def next_orphan_retry(self, live: Container[StreamId]) -> float:
        """When :meth:`retry_orphans` has work next (inf: none owed outside ``live``)."""
        if any(s not in live for s in self._owed):
            return self._orphan_retry_at
        return float("inf")

"""The applier's pauses and retries: sink failures, backoff, pending resets.

When the sink fails (the Redis backend is down) the stream's next seq to apply stays at
the first undelivered batch and the stream pauses with exponential backoff; at the retry
the undelivered batches are fetched again by replay, so nothing is lost silently when
the backend returns (without a replay endpoint they are counted as missed). A reset the
sink refused (after a restart, for a removed pod) is retried the same way, and a stream
applies nothing until its reset went through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvindex.events.stream import JobKind, Stream

if TYPE_CHECKING:
    from kvindex.events.applier import Applier
    from kvindex.events.identity import StreamId


class Resync:
    """A mixin of :class:`~kvindex.events.applier.Applier` (applier thread only)."""

    _stalled: set[StreamId]
    _pending_resets: dict[StreamId, str]
    _orphan_retry_at: float

    def _sink_failed(self: Applier, stream: Stream, first: int, last: int, exc: Exception) -> None:
        stream.sink_errors += 1
        self._errors.add("sink_error")
        self._ratelog.error(
            "sink_error",
            "KV events: the sink failed on batches %d-%d of %s: %r",
            first,
            last,
            stream.sid,
            exc,
        )
        rec = stream.recovery
        stream.tracker.rewind(first)
        rec.resync_until = last if rec.resync_until is None else max(rec.resync_until, last)
        if not stream.replay_endpoint:
            # Nothing can bring these batches back: count them lost now.
            self._lost(stream, last, last - first + 1, "the sink failed; no replay endpoint")
            stream.tracker.skip_to(last + 1)
            rec.resync_until = None
        self._stall(stream)

    def _stall(self: Applier, stream: Stream) -> None:
        config = self._config
        rec = stream.recovery
        rec.backoff = min(config.retry_max_s, max(config.retry_initial_s, rec.backoff * 2))
        rec.stalled_until = self._clock() + rec.backoff
        self._stalled.add(stream.sid)
        self._ready.pop(stream.sid, None)

    def _retry_due(self: Applier) -> None:
        now = self._clock()
        for sid in list(self._stalled):
            stream = self._streams.get(sid)
            if stream is None:
                self._stalled.discard(sid)
                continue
            rec = stream.recovery
            if rec.stalled_until is None or rec.stalled_until > now:
                continue
            self._stalled.discard(sid)
            rec.stalled_until = None
            self._guarded(stream, self._retry)
        if now >= self._orphan_retry_at:
            self._retry_orphan_resets()

    def _retry(self: Applier, stream: Stream) -> None:
        rec = stream.recovery
        if not self._owns(stream) or stream.blocked or not self._ensure_reset(stream):
            return
        expected = stream.tracker.expected
        until, rec.resync_until = rec.resync_until, None
        if until is not None and expected is not None and expected <= until:
            if self._can_replay(stream):
                rec.resync_until = until
                anchor = self._anchor(stream)
                start = expected if anchor is None else anchor.seq
                self._start_replay(stream, start, until, JobKind.GAP, anchor)
                return
            self._lost(stream, until, until - expected + 1, self._no_replay_reason(stream))
            stream.tracker.skip_to(until + 1)
        self._refresh_ready(stream)

    def _ensure_reset(self: Applier, stream: Stream) -> bool:
        """Run the stream's pending sink reset, if any; pause the stream if it fails."""
        reason = self._pending_resets.get(stream.sid)
        if reason is None:
            return True
        if self._try_reset(stream.sid, reason):
            return True
        self._stall(stream)
        return False

    def _try_reset(self: Applier, sid: StreamId, reason: str) -> bool:
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
        self._pending_resets.pop(sid, None)
        return True

    def _retry_orphan_resets(self: Applier) -> None:
        """Resets of removed streams that failed: retry until the sink takes them."""
        failed = False
        for sid, reason in list(self._pending_resets.items()):
            if sid not in self._streams and not self._try_reset(sid, reason):
                failed = True
        self._orphan_retry_at = self._clock() + (self._config.retry_initial_s if failed else 0)

    def _next_retry(self: Applier) -> float:
        due = float("inf")
        for sid in self._stalled:
            stream = self._streams.get(sid)
            if stream is not None and stream.recovery.stalled_until is not None:
                due = min(due, stream.recovery.stalled_until)
        if self._pending_resets and any(s not in self._streams for s in self._pending_resets):
            due = min(due, self._orphan_retry_at)
        return due

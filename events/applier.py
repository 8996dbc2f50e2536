"""The applier thread: every stream's messages, in order, into the sink.

It owns the stream table and every :class:`~kvindex.events.stream.Stream`; nothing else
writes them. It waits on the :class:`~kvindex.events.inbox.Inbox` for messages (per
stream lanes) and commands (replay results, control calls), drains the streams
round-robin (at most ``batches_per_turn`` at a time, so a flooding pod cannot starve the
others), runs the sequence state machine, decodes, and calls the sink - the sink is only
ever called from this thread. Recovery verdicts come from pure functions
(:mod:`~kvindex.events.sequence`, :mod:`~kvindex.events.recovery`,
:mod:`~kvindex.events.ownership`); the applier does the I/O they ask for. Its parts live
in their own modules, one concern each, all running on this thread: the stream table
(:mod:`~kvindex.events.stream_table`), pauses and retries
(:mod:`~kvindex.events.resync`), the gate (:mod:`~kvindex.events.ownership`) and
replay (:mod:`~kvindex.events.replaying`).

A failure while handling one stream (a bug, a gate that raises) is caught, counted
(``internal_error``) and pauses that stream with backoff: it never stops ingestion for
every pod.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvindex.events import scanned
from kvindex.events.config import SubscriberConfig
from kvindex.events.gate import StreamGate
from kvindex.events.heap import HeapTrim
from kvindex.events.identity import StreamId
from kvindex.events.in_order import InOrderRuns, Work
from kvindex.events.inbox import Inbox
from kvindex.events.ownership import OwnershipHandling
from kvindex.events.ratelog import RateLimitedLog
from kvindex.events.receiver import Arrival
from kvindex.events.recovery import Anchor
from kvindex.events.replaying import ReplayDone, ReplayRecovery, ReplayWorkers
from kvindex.events.resync import Resync
from kvindex.events.runs import TAG_NAMES, event_count, tag_counts
from kvindex.events.sequence import Action, plausible_gap
from kvindex.events.sglang import SglangBatchDecoder
from kvindex.events.sink import BatchSink, Delivery
from kvindex.events.status import IngestHealth, ReasonCounts
from kvindex.events.stream import COUNTERS, JobKind, Stream
from kvindex.events.stream_table import StreamTable
from kvindex.events.wire import (
    BatchDecoder,
    DecodedBatch,
    DecodeError,
)

log = logging.getLogger("kvindex.events.subscriber")

_IDLE_WAIT_S = 1.0


@dataclass(frozen=True, slots=True)
class Control:
    """A command: run ``fn`` on the applier thread, answer through ``future``."""

    fn: Callable[[], object]
    future: Future[object]


class Applier(StreamTable, Resync, OwnershipHandling, ReplayRecovery, InOrderRuns):
    """The stream table and the thread that applies it (see the module docstring).

    ``replay_endpoint(sid, arrival)`` is the one place a stream's replay endpoint is
    chosen; ``pinned(arrival)`` says whether the stream's pod is configured or
    discovered (never evicted for idling), ``pod_known(pod)`` whether it was discovered
    since (asked again before evicting).
    """

    def __init__(
        self,
        sink: BatchSink,
        config: SubscriberConfig,
        clock: Callable[[], float],
        inbox: Inbox,
        workers_factory: Callable[[Callable[[object], None]], ReplayWorkers],
        errors: ReasonCounts,
        ratelog: RateLimitedLog,
        gate: StreamGate | None,
        replay_endpoint: Callable[[StreamId, Arrival], str | None],
        pinned: Callable[[Arrival], bool],
        pod_known: Callable[[str], bool],
        stream_closed: Callable[[StreamId], None],
        health: IngestHealth,
    ) -> None:
        self._sink = sink
        self._health = health
        self._stream_closed = stream_closed
        self._config = config
        self._clock = clock
        self._inbox = inbox
        self._errors = errors
        self._ratelog = ratelog
        self._gate = gate
        self._replay_endpoint = replay_endpoint
        self._pinned = pinned
        self._pod_known = pod_known
        self._decoder = BatchDecoder()
        self._sglang_models = frozenset(config.sglang_models)
        self._sglang = SglangBatchDecoder()
        self._workers = workers_factory(inbox.post)
        # The stream table: written only here; the lock makes other threads' copies of
        # it consistent (the streams themselves they only read).
        self._table_lock = threading.Lock()
        self._streams: dict[StreamId, Stream] = {}
        self._retired = dict.fromkeys(COUNTERS, 0)  # counters of removed streams
        self._ready: dict[StreamId, None] = {}  # an ordered set, for round-robin turns
        self._stalled: set[StreamId] = set()
        self._pending_resets: dict[StreamId, str] = {}
        self._verify_at: dict[StreamId, float] = {}  # reconnected streams: prove by then
        self._forgotten: dict[str, float] = {}
        self._orphan_retry_at = 0.0
        self._ownership_check_at = 0.0
        self._idle_scan_at = 0.0
        self._event_counts: dict[str, int] = {}
        self._heap = HeapTrim(time.monotonic)
        self.thread: threading.Thread | None = None

    def event_counts(self) -> dict[str, int]:
        return dict(self._event_counts)

    # -- the thread --------------------------------------------------------------------

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="kvindex-applier", daemon=True)
        self.thread.start()

    def shutdown_workers(self) -> None:
        self._workers.shutdown()

    def _run(self) -> None:
        try:
            while True:
                if self._ready:
                    self._heap.busy()
                    trim_in = None
                else:  # a burst applied: give its buffers back after a moment
                    trim_in = self._heap.idle()
                timeout = self._wait_timeout()
                got = self._inbox.wait(timeout if trim_in is None else min(timeout, trim_in))
                if got is None:
                    break
                commands, touched = got
                for command in commands:
                    self._run_command(command)
                for sid in touched:
                    self._arrived(sid)
                self._check_ownership()
                self._retry_due()
                self._verify_when_due()
                self._evict_idle()
                for sid in list(self._ready):
                    stream = self._streams.get(sid)
                    if stream is None:
                        self._ready.pop(sid, None)
                    else:
                        self._guarded(stream, self._drain)
        except BaseException as exc:
            log.exception("KV-event applier thread failed; no more batches will be applied")
            self._health.failed(f"applier thread failed: {exc!r}")
            raise
        finally:
            for command in self._inbox.drain_commands():
                if isinstance(command, Control):
                    command.future.set_exception(RuntimeError("subscriber is stopped"))

    def _run_command(self, command: object) -> None:
        if isinstance(command, Control):
            try:
                command.future.set_result(command.fn())
            except Exception as exc:
                command.future.set_exception(exc)
        elif isinstance(command, ReplayDone):
            stream = command.job.stream
            self._guarded(stream, lambda s: self._finish_replay(command))

    def _guarded(self, stream: Stream, fn: Callable[[Stream], object]) -> None:
        """Run ``fn(stream)``; a failure pauses this stream only."""
        try:
            fn(stream)
        except Exception as exc:
            self._errors.add("internal_error")
            self._ratelog.error(
                "internal_error",
                "KV events: internal error on %s, pausing the stream: %r",
                stream.sid,
                exc,
            )
            log.debug("internal error on %s", stream.sid, exc_info=True)
            self._stall(stream)

    def _wait_timeout(self) -> float:
        if self._ready:
            return 0.0
        due = min(
            self._next_retry(),
            self._next_ownership_check(),
            self._idle_scan_at,
            self._next_verify(),
        )
        return min(_IDLE_WAIT_S, max(0.0, due - self._clock()))

    def _next_ownership_check(self) -> float:
        if self._gate is None or not self._streams:
            return float("inf")
        return self._ownership_check_at

    # -- draining a stream ---------------------------------------------------------------

    def _refresh_ready(self, stream: Stream) -> None:
        if not stream.blocked and (stream.held or stream.lane.queue):
            self._ready[stream.sid] = None
        else:
            self._ready.pop(stream.sid, None)
        if self._gate is not None and stream.epoch is not None and not stream.blocked:
            settled = (stream.epoch, stream.state)
            if settled != stream.settled:  # the gate hears of changes only
                stream.settled = settled
                self._gate.settled(stream.sid, stream.epoch, stream.model, stream.state)

    def _drain(self, stream: Stream) -> None:
        if stream.blocked or not self._owns(stream) or stream.blocked:
            self._refresh_ready(stream)
            return
        work: Work = list(stream.held)
        stream.held.clear()
        room = self._config.batches_per_turn - len(work)
        if room > 0:
            work.extend((a, False) for a in self._inbox.pop(stream.lane, room))
        if work:
            if self._ensure_reset(stream):
                self._process(stream, work)
                self._recover_dropped(stream)
            else:
                self._hold(stream, work, 0, work[0][1])
        self._refresh_ready(stream)

    def _process(self, stream: Stream, work: Work) -> None:
        """Apply a turn's messages in order; stop and hold the rest when one must wait."""
        tracker = stream.tracker
        pending: list[Delivery] = []
        merging = scanned.scanner is not None
        newest = work[-1][0]  # what the stream is now: per turn, not per message
        stream.model = newest.model
        if newest.topic is not None:
            stream.topic = newest.topic
        stream.replay_endpoint = self._replay_endpoint(stream.sid, newest)
        silence_s = self._config.verify_after_silence_s
        i, n = 0, len(work)
        while i < n:
            end = self._in_order(stream, work, i) if merging else i
            if end - i > 1 or (end > i and work[i][0].batches > 1):
                self._apply_run(stream, work, i, end, pending)
                i = end
                continue
            arrival, observed = work[i]
            if arrival.batches > 1:  # a group of messages that must be taken one by one
                work[i : i + 1] = [(one, observed) for one in arrival.split()]
                n = len(work)
                continue
            i += 1
            seq = arrival.seq
            if not observed:
                # A long silence may hide a restart (and a disconnect): the engine could
                # be a new incarnation that happens to continue the old seqs. Prove it.
                last = stream.last_live_at
                if last is not None and arrival.received_at - last >= silence_s:
                    stream.recovery.unverified = True
                stream.last_live_at = arrival.received_at
            verdict = tracker.position(seq) if observed else tracker.live(seq)
            if verdict.action is Action.RESTART:
                # Batches of the old engine first, then the reset, then the new engine.
                if not self._flush(stream, pending):
                    return self._hold(stream, work, i - 1, False)
                pending = []
                self._note_restart(stream, f"seq {seq} after {tracker.highest_live}")
                if not self._ensure_reset(stream):
                    return self._hold(stream, work, i - 1, False)
                verdict = tracker.live(seq)
            action = verdict.action
            if action is Action.DUPLICATE:
                stream.duplicates += 1
                continue
            if action is Action.APPLY:
                if stream.recovery.unverified and self._verify(stream, pending):
                    return self._hold(stream, work, i - 1, True)
                self._apply_live(stream, arrival, pending)
                continue
            if not self._flush(stream, pending):
                return self._hold(stream, work, i - 1, True)
            pending = []
            if action is Action.FIRST_CONTACT:
                catch_up = self._config.catch_up_on_first_contact
                if catch_up and self._can_replay(stream):
                    self._start_replay(stream, 0, seq - 1, JobKind.CATCH_UP)
                    return self._hold(stream, work, i - 1, True)
                if catch_up:  # joined late and nothing can fetch the history before
                    self._incomplete(stream, seq - 1, self._no_replay_reason(stream))
                tracker.skip_to(seq)
            else:  # GAP
                stream.gaps += 1
                if self._can_replay(stream):
                    anchor = self._anchor(stream)
                    start = verdict.missing_from if anchor is None else anchor.seq
                    self._start_replay(stream, start, verdict.missing_to, JobKind.GAP, anchor)
                    return self._hold(stream, work, i - 1, True)
                self._lost(
                    stream, verdict.missing_to, verdict.missing, self._no_replay_reason(stream)
                )
                tracker.skip_to(seq)
            self._apply_live(stream, arrival, pending)
        self._flush(stream, pending)
        return None

    def _verify(self, stream: Stream, pending: list[Delivery]) -> bool:
        """Start proving the stream's position (replay its anchor); True when started
        (the caller holds the message). Without an anchor or a replay endpoint there is
        nothing to prove it with, and the stream is taken as it is."""
        anchor = self._anchor(stream)
        if anchor is None or not stream.replay_endpoint:
            stream.recovery.unverified = False
            return False
        if not self._can_replay(stream) or not self._flush(stream, pending):
            return False  # cooldown (or the sink failed): verify at a later batch
        pending.clear()
        anchor = self._anchor(stream)
        if anchor is None:
            stream.recovery.unverified = False
            return False
        self._start_replay(stream, anchor.seq, anchor.seq, JobKind.VERIFY, anchor)
        return True

    def _hold(self, stream: Stream, work: Work, i: int, observed: bool) -> None:
        """Keep work[i:] for later, in order, one message each; work[i] with the given
        ``observed`` flag."""
        rest = [(work[i][0], observed), *work[i + 1 :]]
        if any(arrival.batches > 1 for arrival, _ in rest):
            rest = [(one, seen) for arrival, seen in rest for one in arrival.split()]
        stream.held.extendleft(reversed(rest))

    def _anchor(self, stream: Stream) -> Anchor | None:
        """The last applied batch, when it is the one right before the next expected
        (so a replay from it both verifies and fills)."""
        anchor = stream.recovery.anchor
        expected = stream.tracker.expected
        if anchor is None or expected is None or anchor.seq != expected - 1:
            return None
        return anchor if anchor.digest is not None else None

    def _recover_dropped(self, stream: Stream) -> None:
        """Once a stream's queue has drained, fetch what overflow dropped from it.

        Without this, the newest batches dropped by a full queue would only be noticed
        when the pod publishes again, which an idle pod may not do for a long time.
        """
        if stream.held or stream.blocked:
            return
        dropped = self._inbox.take_dropped(stream.lane)
        expected = stream.tracker.expected
        if dropped is None or expected is None or expected > dropped:
            return
        if not plausible_gap(expected, dropped + 1):
            return  # no engine got that far: nothing to fetch; its next message will say
        stream.gaps += 1
        if self._can_replay(stream):
            anchor = self._anchor(stream)
            start = expected if anchor is None else anchor.seq
            self._start_replay(stream, start, dropped, JobKind.GAP, anchor)
            return
        self._lost(stream, dropped, dropped - expected + 1, self._no_replay_reason(stream))
        stream.tracker.skip_to(dropped + 1)

    # -- applying ------------------------------------------------------------------------

    def _apply(
        self,
        stream: Stream,
        seq: int,
        payload: bytes,
        model: str,
        received_at: float,
        replayed: bool,
        pending: list[Delivery],
        decoded: DecodedBatch | None = None,
    ) -> None:
        """Decode one batch (unless the receiver did) and queue its delivery; an
        undecodable batch is consumed."""
        stream.tracker.applied(seq)
        stream.recovery.pending_anchor = (seq, payload)
        try:
            if decoded is None:
                decoder = self._sglang if model in self._sglang_models else self._decoder
                decoded = decoder.decode(payload, stream.layout)
        except DecodeError as exc:
            # Consumed: the seq is accounted for; the content was unusable.
            stream.decode_errors += 1
            self._errors.add(exc.reason)
            self._ratelog.warning(
                exc.reason, "KV events: skipped batch %d of %s: %s", seq, stream.sid, exc
            )
            return
        for reason, count in decoded.skipped.items():
            self._errors.add(reason, count)
            self._ratelog.warning(
                reason,
                "KV events: skipped %d event(s) in batch %d of %s (%s)",
                count,
                seq,
                stream.sid,
                reason,
            )
        batch = decoded.batch
        if event_count(batch):
            stream.layout = decoded.layout
        pending.append(Delivery(stream.sid, model, seq, batch, received_at, replayed))

    def _apply_live(self, stream: Stream, arrival: Arrival, pending: list[Delivery]) -> None:
        if arrival.bad is not None:  # counted by the receiver; consumes its seq
            stream.tracker.applied(arrival.seq)
            stream.recovery.pending_anchor = None
            stream.recovery.anchor = None  # its bytes are gone: nothing to verify with
            stream.decode_errors += 1
            return
        self._apply(
            stream,
            arrival.seq,
            arrival.payload,
            arrival.model,
            arrival.received_at,
            False,
            pending,
            arrival.decoded,
        )

    def _flush(self, stream: Stream, pending: list[Delivery]) -> bool:
        """Deliver ``pending``; on failure rewind to its first seq and pause the stream."""
        rec = stream.recovery
        if not pending:
            if rec.pending_anchor is not None:  # only undecodable batches were consumed
                rec.anchor, rec.pending_anchor = Anchor(*rec.pending_anchor), None
            return True
        last = pending[-1]
        try:
            self._sink.deliver(pending)
        except Exception as exc:
            rec.pending_anchor = None
            self._sink_failed(stream, pending[0].seq, last.last_seq, exc)
            return False
        counts = self._event_counts
        delivered = 0
        for delivery in pending:
            delivered += delivery.batches
            for name, count in zip(TAG_NAMES, tag_counts(delivery.batch), strict=True):
                if count:
                    counts[name] = counts.get(name, 0) + count
                    if name == "AllBlocksCleared" and delivery.last_seq > rec.lost_through:
                        # The engine dropped everything: whatever was lost before is moot.
                        rec.gapped = rec.incomplete = False
        if stream.first_seq is None:
            stream.first_seq = pending[0].seq
        stream.delivered += delivered
        stream.last_seq = last.last_seq
        stream.last_batch_ts = last.batch.ts
        rec.backoff = 0.0
        if rec.pending_anchor is not None:
            rec.anchor, rec.pending_anchor = Anchor(*rec.pending_anchor), None
        if self._gate is not None:
            anchor = rec.anchor
            digest = anchor.digest if anchor is not None and anchor.seq == last.last_seq else None
            self._gate.committed(stream.sid, last.last_seq, digest)
        return True

    def _note_restart(self, stream: Stream, why: str) -> None:
        """A new engine incarnation: clear its entries before its first batch, and start
        its recovery state afresh (no cooldown, gap or anchor of the old engine)."""
        log.info("KV events: %s restarted (%s); clearing its entries", stream.sid, why)
        stream.restarts += 1
        stream.tracker.restart()
        stream.first_seq = None
        stream.fresh_recovery()
        self._stalled.discard(stream.sid)
        self._inbox.set_dropped(stream.lane, None)  # seqs of the old engine
        self._pending_resets[stream.sid] = "engine_restart"

    def _lost(self, stream: Stream, through: int, count: int, why: str) -> None:
        if count <= 0:
            return
        stream.missed_batches += count
        rec = stream.recovery
        rec.gapped = True
        rec.lost_through = max(rec.lost_through, through)
        self._errors.add("missed_batches", count)
        self._ratelog.warning(
            "missed_batches",
            "KV events: lost %d batch(es) of %s (%s); its index entries may be stale until "
            "the engine clears or restarts. Give engines a replay_endpoint (bind mode: set "
            "replay_port) to recover gaps",
            count,
            stream.sid,
            why,
        )

    def _incomplete(self, stream: Stream, through: int, why: str) -> None:
        """History up to ``through`` cannot be fetched: the index may lack some of this
        engine's blocks until it clears or restarts."""
        if through < 0:
            return
        rec = stream.recovery
        rec.incomplete = True
        rec.lost_through = max(rec.lost_through, through)
        self._errors.add("incomplete_streams")
        self._ratelog.warning(
            "incomplete",
            "KV events: history of %s up to seq %d cannot be fetched (%s); the stream is "
            "incomplete until the engine clears or restarts",
            stream.sid,
            through,
            why,
        )

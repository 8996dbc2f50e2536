"""The applier thread: every stream's messages, in order, into the sink.

It owns every :class:`~kvindex.events.ingest.stream.Stream` and the table that holds them;
nothing else writes them. It waits on the :class:`~kvindex.events.ingest.inbox.Inbox` for
messages and commands (replay results, control calls), drains the streams round-robin
(at most ``batches_per_turn`` at a time, so a flooding pod cannot starve the others),
runs the sequence state machine, decodes, and calls the sink, which only this thread
calls. Verdicts come from pure functions (:mod:`~kvindex.events.ingest.sequence`,
:mod:`~kvindex.events.ingest.recovery`, :mod:`~kvindex.events.ingest.ownership`); the applier does
the
I/O they ask for. A failure while handling one stream is counted (``internal_error``) and
pauses that stream with backoff: it never stops ingestion for every pod.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.gate import Claim, StreamGate
from kvindex.events.ingest.heap import HeapTrim
from kvindex.events.ingest.in_order import Work, apply_run, in_order_end
from kvindex.events.ingest.inbox import Inbox
from kvindex.events.ingest.ownership import Step, ownership_step, plan_takeover
from kvindex.events.ingest.ratelog import RateLimitedLog
from kvindex.events.ingest.receiver import Arrival
from kvindex.events.ingest.recovery import (
    Anchor,
    AnchorCheck,
    ReplayCheck,
    ReplayRequest,
    check_replay,
    payload_digest,
)
from kvindex.events.ingest.replay_client import ReplayResult
from kvindex.events.ingest.replay_workers import ReplayDone, ReplayWorkers
from kvindex.events.ingest.sequence import Action, plausible_gap
from kvindex.events.ingest.sink import BatchSink, Delivery
from kvindex.events.ingest.sink_resets import PendingResets
from kvindex.events.ingest.status import IngestHealth, ReasonCounts
from kvindex.events.ingest.stream import JobKind, ReplayJob, Stream
from kvindex.events.ingest.stream_table import StreamTable
from kvindex.events.wire import scanned
from kvindex.events.wire.identity import IdentityError, StreamId, parse_topic, pod_host
from kvindex.events.wire.runs import TAG_NAMES, event_count, tag_counts
from kvindex.events.wire.sglang import SglangBatchDecoder
from kvindex.events.wire.vllm import (
    BatchDecoder,
    DecodedBatch,
    DecodeError,
)

log = logging.getLogger("kvindex.events.ingest.subscriber")

_IDLE_WAIT_S = 1.0
#: How often ownership is re-checked for every stream (the gate answers from memory).
_OWNERSHIP_CHECK_S = 0.5
#: How soon a stream whose ownership is unknown asks the gate again.
_GATE_RETRY_S = 0.1
#: The highest seq the wire can carry: an unheard engine may be anywhere.
_ANY_SEQ = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Control:
    """A command: run ``fn`` on the applier thread, answer through ``future``."""

    fn: Callable[[], object]
    future: Future[object]


class Applier:
    """The streams and the thread that applies them (see the module docstring).

    ``replay_endpoint(sid, arrival)`` is the one place a stream's replay endpoint is
    chosen; ``pinned(arrival)`` says whether the stream's pod is configured or
    discovered (never evicted for idling), ``pod_known(pod)`` whether it was discovered
    since (asked again before evicting). Other threads call only :meth:`streams`,
    :meth:`totals`, :meth:`event_counts` and the lifecycle methods; everything else runs
    on the applier thread (control calls arrive as :class:`Control` commands).
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
        self._decoder = BatchDecoder()
        self._sglang_models = frozenset(config.sglang_models)
        self._sglang = SglangBatchDecoder()
        self._workers = workers_factory(inbox.post)
        self._table = StreamTable(pod_known)
        self._resets = PendingResets(sink, errors, ratelog, clock, config.retry_initial_s)
        self._ready: dict[StreamId, None] = {}  # an ordered set, for round-robin turns
        self._stalled: set[StreamId] = set()  # paused: stream.recovery.stalled_until set
        self._verify_at: dict[StreamId, float] = {}  # reconnected streams: prove by then
        self._ownership_check_at = 0.0
        self._event_counts: dict[str, int] = {}
        self._heap = HeapTrim(time.monotonic)
        self.thread: threading.Thread | None = None

    # -- any thread ------------------------------------------------------------------------

    def event_counts(self) -> dict[str, int]:
        return dict(self._event_counts)

    def streams(self) -> list[Stream]:
        return self._table.snapshot()

    def totals(self) -> dict[str, int]:
        return self._table.totals()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="kvindex-applier", daemon=True)
        self.thread.start()

    def shutdown_workers(self) -> None:
        self._workers.shutdown()

    # -- control calls (applier thread) ----------------------------------------------------

    def expect(self, sid: StreamId, model: str, replay_endpoint: str | None) -> None:
        """On the applier thread: a configured pod's stream, before its first message.

        Until its engine is heard (a batch, or a replay) the stream is ``unheard``: after
        a restart without a snapshot its engine may hold a warm cache the index lacks,
        and an idle engine would otherwise look empty, without a word, until it next
        publishes. With a replay endpoint, an engine still silent after
        ``verify_after_reconnect_s`` (a busy one is heard first, and catches up as on
        any first contact) is asked for its whole buffer, so it proves what it holds
        (see :meth:`_verify_when_due`). A stream restored from a snapshot is left to the
        gate: it resumes from its saved position when heard.
        """
        if sid in self._table or (self._gate is not None and sid in self._gate.unheard(sid.pod)):
            return
        now = self._clock()
        stream = Stream(
            sid, self._inbox.open(sid), model, replay_endpoint, pinned=True, heard=False,
            created_at=now,
        )  # fmt: skip
        self._table.add(stream)
        log.info("KV events: expecting stream %s (model %s), not heard yet", sid, model)
        if replay_endpoint and self._config.catch_up_on_first_contact:
            self._verify_at[sid] = now + self._config.verify_after_reconnect_s

    def forget(self, pod: str) -> None:
        """On the applier thread: drop the pod's streams, then reset them in the sink.
        Messages from the pod are ignored for ``forget_quiet_s``."""
        victims = self._table.of_pod(pod)
        self._table.forget(pod, self._clock() + self._config.forget_quiet_s)
        for stream in victims:
            self._remove(stream, "pod_removed", "forgotten")
        # Restored (a snapshot) and not heard since: entries in the index, but no stream.
        restored = self._gate.unheard(pod) if self._gate is not None else []
        for sid in restored:
            self._resets.owe(sid, "pod_removed")
        self._resets.reset_pod(pod, "pod_removed", self._table)
        log.info(
            "KV events: forgot pod %s (%d stream(s), %d restored and not heard since)",
            pod,
            len(victims),
            len(restored),
        )

    def reconnected(self, pod: str) -> None:
        """The pod's endpoint was (re)connected: its streams' positions must be proven
        to belong to the engine now publishing before they read ``live`` again. The
        next batch proves it; if none comes within ``verify_after_reconnect_s``, a
        replay of the anchor does (see :meth:`_verify_when_due`)."""
        self._reconnected_where(lambda sid: sid.pod == pod)

    def reconnected_host(self, host: str) -> None:
        """A bind-mode connection came from ``host``: one of its engines may be a new
        incarnation, and which pod it is shows only in its messages, so every stream
        of the host proves its position (a stream of another engine there just
        passes)."""
        marked = self._reconnected_where(lambda sid: pod_host(sid.pod).strip("[]") == host)
        if marked:
            log.info("KV events: an engine on %s connected; verifying %d stream(s)", host, marked)

    # -- the thread ------------------------------------------------------------------------

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
                    stream = self._table.get(sid)
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
            self._table.next_idle_scan(),
            self._next_verify(),
        )
        return min(_IDLE_WAIT_S, max(0.0, due - self._clock()))

    # -- draining a stream -----------------------------------------------------------------

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
            end = in_order_end(stream, work, i, silence_s) if merging else i
            if end - i > 1 or (end > i and work[i][0].batches > 1):
                apply_run(stream, work, i, end, pending)
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

    # -- applying --------------------------------------------------------------------------

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
        self._resets.owe(stream.sid, "engine_restart")

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

    # -- the stream table ------------------------------------------------------------------
    # The table (stream_table.py) chooses who joins and who leaves; this is what a removal
    # costs: the lane, the door's cap (``stream_closed``), the gate's claim, the sink reset.

    def _arrived(self, sid: StreamId) -> None:
        stream = self._table.get(sid)
        if stream is None:
            stream = self._admit(sid)
            if stream is None:
                return
        stream.heard = True
        self._refresh_ready(stream)

    def _admit(self, sid: StreamId) -> Stream | None:
        """A lane with no stream: open one, unless the pod was just forgotten or the
        table is full of streams that may not be evicted."""
        lane = self._inbox.lane(sid)
        first = None if lane is None else self._inbox.peek(lane)
        if lane is None or first is None:
            return None
        now = self._clock()
        if self._table.forgotten(sid.pod, first.received_at):
            self._refuse(sid, "forgotten_pod")
            return None
        if len(self._table) >= self._config.max_streams:
            victim = self._table.victim(now, self._config.stream_evict_idle_s)
            if victim is None:
                self._refuse(sid, "too_many_streams")
                self._ratelog.warning(
                    "too_many_streams",
                    "KV events: ignoring new stream %s, max_streams (%d) reached and no "
                    "stream may be evicted",
                    sid,
                    self._config.max_streams,
                )
                return None
            self._remove(victim, "stream_evicted", "the stream table is full")
        stream = Stream(
            sid,
            lane,
            first.model,
            self._replay_endpoint(sid, first),
            topic=first.topic,
            pinned=self._pinned(first),
            created_at=now,
        )
        self._table.add(stream)
        log.info("KV events: new stream %s (model %s)", sid, first.model)
        return stream

    def _refuse(self, sid: StreamId, reason: str) -> None:
        lane = self._inbox.close(sid)
        if lane is not None:
            self._errors.add(reason, max(1, len(lane)))
        self._stream_closed(sid)

    def _drop_expected(self, stream: Stream) -> None:
        """Drop a stream opened for a configured pod before its engine was heard (it
        holds nothing: no reset)."""
        if not self._table.discard(stream):
            return
        self._inbox.close(stream.sid)
        self._stream_closed(stream.sid)
        self._ready.pop(stream.sid, None)
        self._verify_at.pop(stream.sid, None)

    def _evict_idle(self) -> None:
        """Unpinned streams silent for ``stream_idle_s`` leave the table (and the index)."""
        idle_s = self._config.stream_idle_s
        for stream in self._table.idle(self._clock(), idle_s):
            self._remove(stream, "stream_evicted", f"idle for {idle_s:g}s")

    def _remove(self, stream: Stream, reason: str, why: str) -> None:
        """Drop a stream from the table and reset it in the sink (``reason``)."""
        sid = stream.sid
        if not self._table.discard(stream):
            return
        self._inbox.close(sid)
        self._stream_closed(sid)
        self._ready.pop(sid, None)
        self._stalled.discard(sid)
        stream.recovery.replay_job = None  # a replay in flight is discarded when it ends
        if reason == "stream_evicted":
            self._errors.add("stream_evicted")
            log.info("KV events: evicted stream %s (%s)", sid, why)
        if self._gate is not None:
            self._gate.release(sid)
            if reason == "stream_evicted" and stream.epoch is None:
                return  # another replica applies it: its entries are not ours to reset
        self._resets.owe(sid, reason)
        self._resets.reset(sid, reason)

    # -- proving positions -----------------------------------------------------------------
    # The wire has no incarnation id: after a reconnect, or for a configured pod not heard
    # since start, a replay proves which engine the stream's position belongs to.

    def _reconnected_where(self, chosen: Callable[[StreamId], bool]) -> int:
        due = self._clock() + self._config.verify_after_reconnect_s
        marked = 0
        for stream in self._table:
            sid = stream.sid
            if chosen(sid) and stream.recovery.anchor is not None and stream.replay_endpoint:
                stream.recovery.unverified = True
                self._verify_at[sid] = due
                marked += 1
        return marked

    def _verify_when_due(self) -> None:
        """Prove the position of streams a reconnect left unverified and no batch has
        come for. An engine that restarted and published only while nobody was
        subscribed would otherwise keep its old incarnation's entries, unverified, until
        it publishes again: the anchor's replay finds the restart and fetches the new
        engine's buffer."""
        if not self._verify_at:
            return
        now = self._clock()
        for sid, due in list(self._verify_at.items()):
            if due > now:
                continue
            del self._verify_at[sid]
            stream = self._table.get(sid)
            if stream is not None and not stream.heard:
                self._guarded(stream, self._prove)
                continue
            if stream is None or not stream.recovery.unverified:
                continue
            if stream.blocked or stream.held or stream.lane.queue:
                continue  # a replay runs or a batch waits: that path verifies
            self._guarded(stream, self._verify_idle)

    def _verify_idle(self, stream: Stream) -> None:
        if not self._owns(stream) or not self._ensure_reset(stream):
            return
        if not self._can_replay(stream):  # the endpoint failed recently: after the cooldown
            self._verify_at[stream.sid] = stream.recovery.cooldown_until
            return
        self._verify(stream, [])
        self._refresh_ready(stream)

    def _prove(self, stream: Stream) -> None:
        """Ask an unheard stream's engine to replay its buffer from seq 0."""
        if not self._owns(stream) or stream.blocked or stream.heard:
            return
        if stream.tracker.expected not in (None, 0):
            return  # the gate placed it: its own resume proves it
        if not self._can_replay(stream):  # the endpoint failed recently: after the cooldown
            self._verify_at[stream.sid] = stream.recovery.cooldown_until
            return
        self._start_replay(stream, 0, _ANY_SEQ, JobKind.PROVE)

    def _next_verify(self) -> float:
        return min(self._verify_at.values(), default=float("inf"))

    # -- pauses and retries ----------------------------------------------------------------
    # When the sink fails the stream's next seq stays at the first undelivered batch and
    # the stream pauses with exponential backoff; the retry fetches those batches again by
    # replay (without a replay endpoint they are counted lost). A stream whose reset the
    # sink refused applies nothing until the reset went through.

    def _sink_failed(self, stream: Stream, first: int, last: int, exc: Exception) -> None:
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

    def _stall(self, stream: Stream) -> None:
        config = self._config
        rec = stream.recovery
        rec.backoff = min(config.retry_max_s, max(config.retry_initial_s, rec.backoff * 2))
        rec.stalled_until = self._clock() + rec.backoff
        self._stalled.add(stream.sid)
        self._ready.pop(stream.sid, None)

    def _retry_due(self) -> None:
        now = self._clock()
        for sid in list(self._stalled):
            stream = self._table.get(sid)
            if stream is None:
                self._stalled.discard(sid)
                continue
            rec = stream.recovery
            if rec.stalled_until is None or rec.stalled_until > now:
                continue
            self._stalled.discard(sid)
            rec.stalled_until = None
            self._guarded(stream, self._retry)
        self._resets.retry_orphans(now, self._table)

    def _retry(self, stream: Stream) -> None:
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

    def _ensure_reset(self, stream: Stream) -> bool:
        """Run the stream's pending sink reset, if any; pause the stream if it fails."""
        if self._resets.settle(stream.sid):
            return True
        self._stall(stream)
        return False

    def _next_retry(self) -> float:
        due = float("inf")
        for sid in self._stalled:
            stream = self._table.get(sid)
            if stream is not None and stream.recovery.stalled_until is not None:
                due = min(due, stream.recovery.stalled_until)
        return min(due, self._resets.next_orphan_retry(self._table))

    # -- ownership -------------------------------------------------------------------------
    # With a gate (several replicas, one index): act on ownership_step and plan_takeover.

    def _owns(self, stream: Stream) -> bool:
        """Whether this replica may apply ``stream`` now, acting on any change."""
        gate = self._gate
        if gate is None:
            return True
        claim = gate.claim(stream.sid)
        step = ownership_step(claim, stream.epoch)
        if step is Step.KEEP:
            return True
        if step is Step.TAKE_OVER:
            self._take_over(stream, claim)
            return True
        if step is Step.STAND_BY:
            self._stand_by(stream)
        else:
            self._wait_for_gate(stream)
        return False

    def _check_ownership(self) -> None:
        """Every ``_OWNERSHIP_CHECK_S``: act on ownership changes of idle streams too,
        so a takeover replays what the previous owner missed without waiting for the
        pod's next batch, and a replica that lost a stream stops at once."""
        if self._gate is None:
            return
        now = self._clock()
        if now < self._ownership_check_at:
            return
        self._ownership_check_at = now + _OWNERSHIP_CHECK_S
        for stream in list(self._table):
            if stream.recovery.stalled_until is None or stream.standby:
                self._guarded(stream, self._owns)

    def _next_ownership_check(self) -> float:
        if self._gate is None or not self._table:
            return float("inf")
        return self._ownership_check_at

    def _waiting(self, stream: Stream) -> list[Arrival]:
        """Every message of the stream not applied yet, oldest first; taken out."""
        arrivals = [a for a, _ in stream.held]
        stream.held.clear()
        arrivals.extend(self._inbox.take_all(stream.lane))
        self._ready.pop(stream.sid, None)
        return arrivals

    def _stand_by(self, stream: Stream) -> None:
        """Another replica applies this stream: drop what is queued, remember the last
        seq seen (a later takeover replays from the owner's position up to it)."""
        arrivals = self._waiting(stream)
        if arrivals:
            # the newest (of equal stamps the last: messages received as one group)
            stream.standby_seq = max(reversed(arrivals), key=lambda a: a.received_at).seq
            stream.not_owner += len(arrivals)
            self._errors.add("not_owner", len(arrivals))
        if stream.standby:
            return
        log.info("KV events: %s is applied by another replica; standing by", stream.sid)
        stream.standby = True
        stream.epoch = None
        stream.tracker.restart()
        self._forget_recovery(stream)

    def _forget_recovery(self, stream: Stream) -> None:
        """Drop this replica's recovery state of a stream whose ownership changed: the
        owner's stored position is the truth from now on."""
        stream.fresh_recovery()  # a replay in flight is discarded when it ends
        self._stalled.discard(stream.sid)
        self._resets.cancel(stream.sid)

    def _take_over(self, stream: Stream, claim: Claim) -> None:
        """This replica now owns the stream (again): forget local sequence state and
        resume after ``claim.resume_after``; fetch by replay what went by meanwhile."""
        sid, after = stream.sid, claim.resume_after
        tracker = stream.tracker
        dropped = self._inbox.peek_dropped(stream.lane)
        known = (stream.standby_seq, tracker.highest_live, stream.recovery.resync_until, dropped)
        seen = max((s for s in known if s is not None), default=None)
        stream.standby_seq = None
        if claim.rebuild:
            log.info("KV events: rebuilding %s: the index lost its entries", sid)
        else:
            log.info(
                "KV events: applying %s from here on (resuming after seq %s)",
                sid,
                "none" if after is None else after,
            )
        stream.epoch = claim.epoch
        stream.standby = False
        self._forget_recovery(stream)
        if claim.rebuild and self._can_replay(stream):
            # Batches applied between the loss and its notice come again in the replay:
            # start from nothing, or their blocks would count two copies. (A failed
            # reset is counted; the replay is still the better index.)
            self._resets.reset(sid, "index_lost")
        # Batches at or below the position were applied by the previous owner.
        fresh = [a for a in self._waiting(stream) if after is None or a.seq > after]
        plan = plan_takeover(
            after,
            claim.resume_digest,
            seen,
            fresh[-1].seq if fresh else None,
            self._can_replay(stream),
            claim.rebuild,
        )
        tracker.restart()
        tracker.expected, tracker.highest_live = plan.expected, plan.highest_live
        stream.held.extend((a, False) for a in fresh)  # classified live again
        if plan.dropped_until is not None:
            self._inbox.set_dropped(stream.lane, plan.dropped_until)
        if plan.incomplete_through is not None:
            why = "cannot verify the stored position"
            if claim.rebuild:
                why = f"the index lost its entries; {self._no_replay_reason(stream)}"
            self._incomplete(stream, plan.incomplete_through, why)
        if plan.replay is not None and plan.kind is not None:
            start, until = plan.replay
            anchor = Anchor(after, digest=claim.resume_digest) if plan.anchored else None
            if anchor is not None:
                tracker.expected = start + 1
            self._start_replay(stream, start, until, plan.kind, anchor)
        elif plan.lost:
            self._lost(stream, plan.skip_to - 1, plan.lost, self._no_replay_reason(stream))
        if plan.skip_to is not None:
            tracker.skip_to(plan.skip_to)
        if after is not None and plan.anchored:
            stream.recovery.anchor = Anchor(after, digest=claim.resume_digest)
        self._refresh_ready(stream)

    def _wait_for_gate(self, stream: Stream) -> None:
        """Ownership unknown: keep everything queued and ask again shortly."""
        stream.recovery.stalled_until = self._clock() + _GATE_RETRY_S
        self._stalled.add(stream.sid)
        self._ready.pop(stream.sid, None)

    # -- replay ----------------------------------------------------------------------------
    # Start a job (fetched by the workers, off this thread), then validate its result
    # (check_replay) and apply it, acting on what the anchor check says.

    def _can_replay(self, stream: Stream) -> bool:
        return bool(stream.replay_endpoint) and self._clock() >= stream.recovery.cooldown_until

    @staticmethod
    def _no_replay_reason(stream: Stream) -> str:
        if stream.replay_endpoint:
            return f"replay endpoint {stream.replay_endpoint} failed recently"
        return "no replay endpoint"

    def _start_replay(
        self,
        stream: Stream,
        start: int,
        until: int,
        kind: JobKind,
        anchor: Anchor | None = None,
    ) -> None:
        endpoint = stream.replay_endpoint
        if not endpoint:  # callers check _can_replay; never fetch from nowhere
            return
        job = ReplayJob(stream, start, until, kind, anchor)
        stream.recovery.replay_job = job
        self._ready.pop(stream.sid, None)
        if not self._workers.submit(job, endpoint):  # stopping
            stream.recovery.replay_job = None

    def _finish_replay(self, done: ReplayDone) -> None:
        job, result = done.job, done.result
        stream = job.stream
        if self._table.get(stream.sid) is not stream:
            return  # removed while the replay ran: discard everything it brought
        rec = stream.recovery
        if rec.replay_job is not job:
            return  # a restart or an ownership change made it moot
        rec.replay_job = None
        epoch = stream.epoch
        if not self._owns(stream) or stream.epoch != epoch:
            return  # nothing applied: the gap is found, and fetched, again once owned
        if job.kind is JobKind.PROVE and self._named_elsewhere(stream, result.topics):
            return
        check = check_replay(
            ReplayRequest(job.start, job.need_until, job.anchor, stream.topic, self._live(stream)),
            result.batches,
            result.topics,
        )
        self._count_bad_replies(stream, job, result, check)
        # Bad replies are survivable when the anchor proved the endpoint right; otherwise
        # the reply as a whole cannot be trusted to say anything about the engine.
        tainted = (
            bool(check.rejected or result.bad_replies) and check.anchor is not AnchorCheck.MATCH
        )
        if check.foreign:
            self._replay_failed(stream, job, result, "foreign")
        elif not result.complete:
            self._replay_failed(stream, job, result, result.reason)
        elif tainted:
            self._replay_failed(stream, job, result, "bad_reply")
        else:
            stream.replays_ok += 1
            stream.heard = True  # the engine answered: what it buffers is known now
        if check.foreign:
            check.batches.clear()  # another engine's batches: never indexed
        elif check.anchor is AnchorCheck.MISMATCH or (
            check.anchor is AnchorCheck.ABSENT
            and result.complete
            and not tainted
            # A resumed position the buffer has moved past is only unverifiable; a
            # clean reply with nothing at or after it means the engine's newest seq is
            # below it: the incarnation that published it is gone.
            and (job.kind is not JobKind.RESUME or not check.batches)
        ):
            self._unseen_restart(stream, job, check)
            return
        elif check.anchor is AnchorCheck.MATCH:
            rec.unverified = False
        elif job.kind is JobKind.RESUME and job.anchor is not None:
            self._incomplete(stream, job.anchor.seq, "the engine no longer has the stored seq")
        self._apply_replayed(stream, job, check, result, done.received_at)

    def _named_elsewhere(self, stream: Stream, topics: list[bytes | None]) -> bool:
        """Whether an expected stream's engine names itself otherwise: its replies'
        ``kv@<pod>@<model>`` topic (vLLM >= 0.26) wins over the configured pod, as for
        its live messages. Then its batches belong to that stream, which opens when it
        publishes, and this one (which holds nothing) is dropped."""
        for topic in topics:
            try:
                named = parse_topic(topic.decode(), self._config.default_serving_port)
            except (AttributeError, UnicodeDecodeError, IdentityError):
                continue  # no topic, or not the convention: the configured pod holds
            if named.pod != stream.sid.pod or named.model != stream.model:
                log.info(
                    "KV events: %s names itself %s (model %s) in its topic; dropping the "
                    "configured name %s (model %s) until it publishes",
                    stream.replay_endpoint, named.pod, named.model, stream.sid, stream.model,
                )  # fmt: skip
                self._drop_expected(stream)
                return True
        return False

    def _live(self, stream: Stream) -> dict[int, bytes]:
        """Digests of the live messages this stream holds, which replies must match."""
        return {a.seq: payload_digest(a.payload) for a, _ in stream.held if a.bad is None}

    def _count_bad_replies(
        self, stream: Stream, job: ReplayJob, result: ReplayResult, check: ReplayCheck
    ) -> None:
        if result.bad_replies:
            self._errors.add("bad_replay_reply", result.bad_replies)
        for reason, n in check.rejected.items():
            self._errors.add(f"bad_replay_{reason}", n)
        if check.rejected or result.bad_replies or check.foreign:
            self._ratelog.warning(
                "bad_replay_reply",
                "KV events: replay of %s from %s (seq %d..) sent bad replies: %s%s; "
                "they were discarded",
                stream.sid,
                stream.replay_endpoint,
                job.start,
                dict(check.rejected, malformed=result.bad_replies),
                "; its batches disagree with live ones (another engine?)" if check.foreign else "",
            )

    def _replay_failed(
        self, stream: Stream, job: ReplayJob, result: ReplayResult, why: str
    ) -> None:
        stream.replays_failed += 1
        # Do not stall this stream for a full timeout at every gap while its replay
        # endpoint is down: declare gaps lost at once until the cooldown ends.
        stream.recovery.cooldown_until = self._clock() + self._config.retry_max_s
        self._errors.add(f"replay_{why}")
        self._ratelog.warning(
            "replay_failed",
            "KV events: replay of %s from %s (seq %d..) ended with %s %s",
            stream.sid,
            stream.replay_endpoint,
            job.start,
            why,
            result.detail,
        )

    def _unseen_restart(self, stream: Stream, job: ReplayJob, check: ReplayCheck) -> None:
        """The replay's anchor disagrees (or is gone): the engine restarted without the
        stream seeing seq go back. Reset, then catch up the new engine from seq 0."""
        self._errors.add("unseen_restart")
        held = [(a, False) for a, _ in stream.held]  # to be classified against the new engine
        stream.held.clear()
        differs = check.anchor is AnchorCheck.MISMATCH
        self._note_restart(
            stream, f"replay of seq {job.start} {'differs' if differs else 'is gone'}"
        )
        stream.held.extend(held)
        if not held and self._ensure_reset(stream) and self._can_replay(stream):
            self._start_replay(stream, 0, job.need_until, JobKind.RESTARTED)
        self._refresh_ready(stream)

    def _apply_replayed(
        self,
        stream: Stream,
        job: ReplayJob,
        check: ReplayCheck,
        result: ReplayResult,
        received_at: float,
    ) -> None:
        tracker = stream.tracker
        incomplete = job.kind in (
            JobKind.CATCH_UP,
            JobKind.RESUME,
            JobKind.RESTARTED,
            JobKind.PROVE,
        )
        pending: list[Delivery] = []
        for seq, payload in check.batches:
            verdict = tracker.position(seq)
            action = verdict.action
            if action is Action.DUPLICATE:
                stream.duplicates += 1
                continue
            if action is Action.FIRST_CONTACT:
                # The buffer no longer reaches back to seq 0.
                self._incomplete(stream, seq - 1, "no longer in the engine's replay buffer")
                tracker.skip_to(seq)
            elif action is Action.GAP:
                why = "no longer in the engine's replay buffer"
                if incomplete:
                    self._incomplete(stream, verdict.missing_to, why)
                else:
                    self._lost(stream, verdict.missing_to, verdict.missing, why)
                tracker.skip_to(seq)
            self._apply(stream, seq, payload, stream.model, received_at, True, pending)
        if not self._flush(stream, pending):
            return
        expected = tracker.expected
        if job.kind is JobKind.PROVE:
            if not stream.heard:  # nothing is owed, but it is asked again after the cooldown
                self._verify_at[stream.sid] = stream.recovery.cooldown_until
        elif job.kind is JobKind.RESTARTED:
            clean = result.complete and not (check.rejected or result.bad_replies or check.foreign)
            if not clean and expected is None:  # nothing known of the new engine's history
                self._incomplete(stream, job.need_until, f"replay {result.reason}")
        elif job.kind is not JobKind.VERIFY and (expected is None or expected <= job.need_until):
            why = f"replay {'foreign' if check.foreign else result.reason}"
            first = expected if expected is not None else 0
            if incomplete and not (job.kind is JobKind.RESUME and expected is not None):
                self._incomplete(stream, job.need_until, why)
            else:
                self._lost(stream, job.need_until, job.need_until - first + 1, why)
            tracker.skip_to(job.need_until + 1)
        rec = stream.recovery
        expected = tracker.expected
        if rec.resync_until is not None and expected is not None and expected > rec.resync_until:
            rec.resync_until = None
        self._refresh_ready(stream)

"""The subscriber: every engine's KV-event stream, in order, into one BatchSink.

Topologies (both may be used at once):

* **bind** - one SUB socket that every engine's PUB connects to (engines configured with
  a non-wildcard endpoint such as ``tcp://kvindex:5557``). The topic ``kv@<pod>@<model>``
  is the only sender identity.
* **connect** - one SUB socket per engine endpoint (``tcp://<pod-ip>:5557``, vLLM's
  default ``tcp://*:5557`` on the engine side). The endpoint identifies the pod unless
  the topic does.

Threads and where work happens:

* the **receiver** thread (:mod:`kvindex.events.receiver`) owns every SUB socket, checks
  framing, attributes each message to a stream - ``StreamId(pod, rank)``, the rank read
  from the batch envelope - and appends it to that stream's bounded queue;
* the **applier** thread drains the streams round-robin, at most ``batches_per_turn`` at
  a time so a flooding pod cannot starve the others; it runs the sequence state machine
  (:mod:`kvindex.events.sequence`), decodes with :class:`~kvindex.events.wire.BatchDecoder`
  (remembering each stream's layout), and calls the sink - the sink is only ever called
  from this thread;
* **replay workers** fetch missed batches (:mod:`kvindex.events.replay`), so a slow or
  dead replay endpoint delays nothing but its own stream. While a stream replays, its
  live messages wait in its queue; the replayed batches are applied first, duplicates
  dropped, then the queue resumes.

Loss and recovery:

* **Queue overflow**: when a stream's queue is full the *newest* message is dropped and
  counted (``queue_overflow``). Keeping the oldest keeps the queue contiguous; the seq
  gap the drop leaves is seen on the next message and recovered by the normal replay
  path, exactly like a message PUB dropped.
* **Gap**: replay from the engine's replay endpoint (connect mode:
  ``PodEndpoint.replay_endpoint``; bind mode: ``tcp://<pod host>:<replay_port + rank>``).
  If there is none, or it fails or times out, the loss is counted (``missed_batches``),
  the stream is marked ``gapped`` and ingestion goes on.
* **Restart** (seq went backwards): ``sink.reset(stream, "engine_restart")`` before the
  new engine's first batch; then catch up from seq 0 by replay if the first seen is > 0.
* **Sink failure** (``deliver`` raised, e.g. the Redis backend is down): counted
  (``sink_error``), logged (rate limited); the stream's next seq to apply stays at the
  first undelivered batch and the stream pauses with exponential backoff. At the retry
  the undelivered batches are fetched again by replay, so nothing is lost silently when
  the backend returns; without a replay endpoint they are counted as missed.
* **Bad input** of every kind is skipped and counted by reason (:meth:`error_counts`) and
  logged at most once per ``log_interval_s`` per reason; the next valid message applies.

Several replicas (a :class:`~kvindex.events.gate.StreamGate`, optional):

* Before applying a stream the applier asks the gate. **Not owned**: another replica
  applies it; its batches are dropped here (counted ``not_owner``) and the stream stands
  by (state ``standby``), remembering only the last seq it saw. **Unknown** (the gate's
  store is unreachable): the batches stay queued, bounded like any queue, and nothing is
  applied until the gate can tell. **Owned under a new epoch** (just acquired, or
  re-acquired after the lease lapsed): local sequence state is dropped and the stream
  resumes after the seq the gate says was applied last; batches seen while standing by
  are fetched again by replay.
* After every successful delivery the gate is told the last applied seq, which is what
  the next owner resumes from. Ownership is re-checked every ``ownership_check_s`` even
  for idle streams, so a takeover does not wait for the pod's next batch.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from kvindex.events.config import SubscriberConfig
from kvindex.events.endpoints import PodEndpoint
from kvindex.events.gate import Claim, Ownership, StreamGate
from kvindex.events.identity import StreamId, normalize_pod
from kvindex.events.ratelog import RateLimitedLog
from kvindex.events.receiver import Arrival, Receiver
from kvindex.events.replay import ReplayResult, fetch_replay
from kvindex.events.sequence import Action, SequenceTracker
from kvindex.events.sink import BatchSink, Delivery
from kvindex.events.status import ReasonCounts, StreamStatus
from kvindex.events.wire import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Layout,
)

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0
_CONTROL_TIMEOUT_S = 10.0
#: How often ownership is re-checked for every stream (the gate answers from memory).
_OWNERSHIP_CHECK_S = 0.5
#: How soon a stream whose ownership is unknown asks the gate again.
_GATE_RETRY_S = 0.1


class _Stream:
    """Everything the subscriber keeps about one engine stream.

    ``queue`` is filled by the receiver (under the subscriber's lock); every other field
    is the applier thread's.
    """

    __slots__ = (
        "backoff",
        "decode_errors",
        "delivered",
        "dropped_until",
        "duplicates",
        "epoch",
        "first_seq",
        "gapped",
        "gaps",
        "held",
        "last_batch_ts",
        "last_received_at",
        "last_seq",
        "layout",
        "missed_batches",
        "model",
        "not_owner",
        "queue",
        "queue_overflows",
        "received",
        "replay_cooldown_until",
        "replay_endpoint",
        "replay_job",
        "replaying",
        "replays_failed",
        "replays_ok",
        "restarts",
        "resync_until",
        "sid",
        "sink_errors",
        "stalled_until",
        "standby",
        "standby_seq",
        "tracker",
    )

    def __init__(self, sid: StreamId, model: str, replay_endpoint: str | None) -> None:
        self.sid = sid
        self.model = model
        self.replay_endpoint = replay_endpoint
        self.queue: collections.deque[Arrival] = collections.deque()
        # Messages taken from the queue that must wait (for a replay, a retry); the flag
        # says whether the tracker already recorded them as received live.
        self.held: collections.deque[tuple[Arrival, bool]] = collections.deque()
        self.tracker = SequenceTracker()
        self.layout = Layout.ARRAY
        self.replaying = False
        self.replay_job: _ReplayJob | None = None  # the one whose result is awaited
        self.replay_cooldown_until = 0.0
        self.stalled_until: float | None = None
        self.resync_until: int | None = None  # last seq of a failed delivery
        self.dropped_until: int | None = None  # highest seq dropped by queue overflow
        self.backoff = 0.0
        self.gapped = False
        self.first_seq: int | None = None
        self.last_seq = -1
        self.last_batch_ts: float | None = None
        self.last_received_at: float | None = None
        self.received = 0
        self.delivered = 0
        self.duplicates = 0
        self.gaps = 0
        self.missed_batches = 0
        self.replays_ok = 0
        self.replays_failed = 0
        self.restarts = 0
        self.queue_overflows = 0
        self.decode_errors = 0
        self.sink_errors = 0
        # With a gate: the epoch this replica owns the stream under (None: not owned),
        # whether another replica applies it, and the last seq seen meanwhile.
        self.epoch: int | None = None
        self.standby = False
        self.standby_seq: int | None = None
        self.not_owner = 0

    @property
    def blocked(self) -> bool:
        return self.replaying or self.stalled_until is not None

    @property
    def state(self) -> str:
        if self.standby:
            return "standby"
        if self.replaying:
            return "replaying"
        if self.stalled_until is not None:
            return "resync"
        return "gapped" if self.gapped else "live"


#: The per-stream counters, summed by :meth:`Subscriber.totals`.
_COUNTERS = (
    "received",
    "delivered",
    "duplicates",
    "gaps",
    "missed_batches",
    "replays_ok",
    "replays_failed",
    "restarts",
    "queue_overflows",
    "decode_errors",
    "sink_errors",
    "not_owner",
)


@dataclass(frozen=True, slots=True)
class _ReplayJob:
    stream: _Stream
    start: int
    need_until: int  # the last seq this replay must bring back
    catch_up: bool  # first contact: seqs before the buffer are not a loss


_EVENT_NAMES: dict[type, str] = {}


def _event_name(event: object) -> str:
    cls = type(event)
    name = _EVENT_NAMES.get(cls)
    if name is None:
        for base in (BlockStored, BlockRemoved, AllBlocksCleared):
            if isinstance(event, base):
                name = base.__name__
                break
        else:
            name = cls.__name__
        _EVENT_NAMES[cls] = name
    return name


class Subscriber:
    """Consumes vLLM KV-event streams and hands them, in order, to a :class:`BatchSink`.

    Configure sockets with :meth:`bind` / :meth:`connect` before or after :meth:`start`;
    :meth:`stop` ends every thread and closes every socket. ``clock`` stamps
    ``received_at`` and drives retry timers. ``gate`` (optional) says which streams this
    replica may apply when several share one index.
    """

    def __init__(
        self,
        sink: BatchSink,
        config: SubscriberConfig | None = None,
        clock: Callable[[], float] = time.time,
        *,
        context: zmq.Context | None = None,
        gate: StreamGate | None = None,
    ) -> None:
        self._sink = sink
        self._gate = gate
        self._ownership_check_at = 0.0
        self._config = config if config is not None else SubscriberConfig()
        self._clock = clock
        self._own_context = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._errors = ReasonCounts()
        self._ratelog = RateLimitedLog(log, self._config.log_interval_s)
        self._decoder = BatchDecoder()
        self._cond = threading.Condition()
        # Guarded by _cond:
        self._streams: dict[StreamId, _Stream] = {}
        self._ready: dict[StreamId, None] = {}  # an ordered set, for round-robin turns
        self._controls: list[tuple[Callable[[], object], Future[object]]] = []
        self._replays_done: list[tuple[_ReplayJob, ReplayResult, float]] = []
        self._forgotten: dict[str, float] = {}
        self._retired = dict.fromkeys(_COUNTERS, 0)  # counters of forgotten streams
        self._applier_waiting = False
        self._stopping = False
        # Applier thread only:
        self._stalled: set[StreamId] = set()
        self._pending_resets: dict[StreamId, str] = {}
        self._orphan_retry_at = 0.0
        self._event_counts: dict[str, int] = {}
        self._receiver = Receiver(
            self._ctx, self._config, self._enqueue, self._errors, self._ratelog, clock
        )
        self._executor = ThreadPoolExecutor(
            max_workers=self._config.replay_workers, thread_name_prefix="kvindex-replay"
        )
        self._applier: threading.Thread | None = None
        self._started = False
        self._stopped = False

    # -- configuration (any thread) -------------------------------------------------

    def bind(self, endpoint: str) -> str:
        """Bind a SUB socket every engine connects to; return the endpoint actually bound
        (``tcp://127.0.0.1:0`` gets a free port).

        vLLM offsets a *connecting* endpoint by the data-parallel rank too, so engines
        with DP ranks 0..N-1 configured with ``tcp://kvindex:5557`` connect to ports
        5557..5557+N-1: bind each of them.
        """
        return self._receiver.bind(endpoint)

    def connect(self, target: PodEndpoint) -> None:
        """Subscribe to one engine endpoint (one data-parallel rank of one pod)."""
        self._receiver.connect(target)

    def disconnect(self, endpoint: str) -> bool:
        """Stop listening on an endpoint; the pod's streams and entries stay."""
        return self._receiver.disconnect(endpoint)

    def forget_pod(self, pod: str) -> None:
        """Remove a pod: its endpoints, queued messages and stream state, and reset its
        streams in the sink (``reason="pod_removed"``).

        Ordered on the applier thread, so no batch of the pod is delivered after its
        reset. Messages from the pod are then ignored for ``forget_quiet_s``.
        """
        pod = normalize_pod(pod, self._config.default_serving_port)
        self._receiver.disconnect_pod(pod)
        self._control(lambda: self._forget(pod))

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise RuntimeError("subscriber already started")
        self._started = True
        self._applier = threading.Thread(
            target=self._apply_loop, name="kvindex-applier", daemon=True
        )
        self._applier.start()
        self._receiver.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop receiving and applying; close every socket. Bounded by ``timeout_s`` plus
        the replay timeout (a replay in flight is allowed to end)."""
        if self._stopped:
            return
        self._stopped = True
        receiver_done = self._receiver.stop(timeout_s)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        applier_done = True
        if self._applier is not None:
            self._applier.join(timeout_s)
            applier_done = not self._applier.is_alive()
            if not applier_done:
                log.warning("applier thread did not stop within %.1fs", timeout_s)
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._own_context and receiver_done and applier_done:
            self._ctx.term()

    def is_running(self) -> bool:
        """True while both threads run: the readiness signal."""
        return (
            self._started
            and not self._stopped
            and self._receiver.alive
            and self._applier is not None
            and self._applier.is_alive()
        )

    def __enter__(self) -> Subscriber:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observability --------------------------------------------------------------

    def streams(self) -> list[StreamStatus]:
        """A snapshot of every stream, sorted by pod and rank."""
        with self._cond:
            streams = sorted(self._streams.values(), key=lambda s: s.sid)
            depths = [len(s.queue) + len(s.held) for s in streams]
        return [
            StreamStatus(
                pod=s.sid.pod,
                rank=s.sid.rank,
                member=s.sid.member,
                model=s.model,
                state=s.state,
                last_seq=s.last_seq,
                first_seq=s.first_seq,
                last_batch_ts=s.last_batch_ts,
                last_received_at=s.last_received_at,
                received=s.received,
                delivered=s.delivered,
                duplicates=s.duplicates,
                gaps=s.gaps,
                missed_batches=s.missed_batches,
                replays_ok=s.replays_ok,
                replays_failed=s.replays_failed,
                restarts=s.restarts,
                queue_overflows=s.queue_overflows,
                decode_errors=s.decode_errors,
                sink_errors=s.sink_errors,
                not_owner=s.not_owner,
                queue_depth=depth,
                layout=s.layout.value,
                replay_endpoint=s.replay_endpoint,
            )
            for s, depth in zip(streams, depths, strict=True)
        ]

    def totals(self) -> dict[str, int]:
        """Every per-stream counter summed over all streams since start, forgotten pods
        included, so each total only ever grows (Prometheus counters can wrap them):
        ``received``, ``delivered``, ``duplicates``, ``gaps``, ``missed_batches``,
        ``replays_ok``, ``replays_failed``, ``restarts``, ``queue_overflows``,
        ``decode_errors``, ``sink_errors``, ``not_owner``."""
        with self._cond:
            totals = dict(self._retired)
            for stream in self._streams.values():
                for name in _COUNTERS:
                    totals[name] += getattr(stream, name)
        return totals

    def error_counts(self) -> dict[str, int]:
        """Skipped or failed items by reason, since start (bad input, sink errors, ...)."""
        return self._errors.snapshot()

    def event_counts(self) -> dict[str, int]:
        """Events handed to the sink, by type (``BlockStored``, ...)."""
        return dict(self._event_counts)

    def endpoints(self) -> list[PodEndpoint | str]:
        """Current connect targets and bound endpoints."""
        return self._receiver.endpoints()

    # -- receiver side (receiver thread) -------------------------------------------

    def _enqueue(self, arrivals: list[Arrival]) -> None:
        capacity = self._config.queue_capacity
        with self._cond:
            for arrival in arrivals:
                sid = arrival.stream
                stream = self._streams.get(sid)
                if stream is None:
                    stream = self._open_stream(arrival)
                    if stream is None:
                        continue
                stream.received += 1
                stream.last_received_at = arrival.received_at
                stream.model = arrival.model
                stream.replay_endpoint = arrival.replay_endpoint
                if len(stream.queue) >= capacity:
                    stream.queue_overflows += 1
                    if stream.dropped_until is None or arrival.seq > stream.dropped_until:
                        stream.dropped_until = arrival.seq
                    self._errors.add("queue_overflow")
                    self._ratelog.warning(
                        "queue_overflow",
                        "KV events: queue of %s is full (%d); dropping the newest batch, "
                        "replay will recover it (raise queue_capacity if this persists)",
                        sid,
                        capacity,
                    )
                    continue
                stream.queue.append(arrival)
                if not stream.blocked:
                    self._ready[sid] = None
            if self._applier_waiting:
                self._cond.notify()

    def _open_stream(self, arrival: Arrival) -> _Stream | None:
        sid = arrival.stream
        quiet_until = self._forgotten.get(sid.pod)
        if quiet_until is not None:
            if arrival.received_at < quiet_until:
                self._errors.add("forgotten_pod")
                return None
            del self._forgotten[sid.pod]
        if len(self._streams) >= self._config.max_streams:
            self._errors.add("too_many_streams")
            self._ratelog.warning(
                "too_many_streams",
                "KV events: ignoring new stream %s, max_streams (%d) reached",
                sid,
                self._config.max_streams,
            )
            return None
        stream = _Stream(sid, arrival.model, arrival.replay_endpoint)
        self._streams[sid] = stream
        log.info("KV events: new stream %s (model %s)", sid, arrival.model)
        return stream

    # -- the applier thread ---------------------------------------------------------

    def _apply_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._has_work():
                        self._applier_waiting = True
                        self._cond.wait(self._wait_timeout())
                        self._applier_waiting = False
                    if self._stopping:
                        break
                    controls, self._controls = self._controls, []
                    replays, self._replays_done = self._replays_done, []
                    ready = [self._streams[sid] for sid in self._ready if sid in self._streams]
                for fn, future in controls:
                    try:
                        future.set_result(fn())
                    except Exception as exc:
                        future.set_exception(exc)
                for job, result, received_at in replays:
                    self._finish_replay(job, result, received_at)
                self._check_ownership()
                self._retry_due()
                for stream in ready:
                    self._drain(stream)
        except Exception:
            log.exception("KV-event applier thread failed; no more batches will be applied")
            raise
        finally:
            with self._cond:
                controls, self._controls = self._controls, []
            for _, future in controls:
                future.set_exception(RuntimeError("subscriber is stopped"))

    def _has_work(self) -> bool:
        if self._controls or self._replays_done or self._ready:
            return True
        return min(self._next_retry(), self._next_ownership_check()) <= self._clock()

    def _next_ownership_check(self) -> float:
        if self._gate is None or not self._streams:
            return float("inf")
        return self._ownership_check_at

    def _next_retry(self) -> float:
        due = float("inf")
        for sid in self._stalled:
            stream = self._streams.get(sid)
            if stream is not None and stream.stalled_until is not None:
                due = min(due, stream.stalled_until)
        if self._pending_resets and any(s not in self._streams for s in self._pending_resets):
            due = min(due, self._orphan_retry_at)
        return due

    def _wait_timeout(self) -> float:
        due = min(self._next_retry(), self._next_ownership_check())
        return min(_IDLE_WAIT_S, max(0.0, due - self._clock()))

    def _control(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the applier thread (inline if that is this thread or none runs)."""
        applier = self._applier
        if applier is None or not applier.is_alive() or threading.current_thread() is applier:
            return fn()
        future: Future[object] = Future()
        with self._cond:
            self._controls.append((fn, future))
            self._cond.notify()
        return future.result(timeout=_CONTROL_TIMEOUT_S)

    def _drain(self, stream: _Stream) -> None:
        sid = stream.sid
        with self._cond:
            if self._streams.get(sid) is not stream or stream.blocked:
                self._ready.pop(sid, None)
                return
        if not self._owns(stream) or stream.blocked:
            return
        with self._cond:
            work = list(stream.held)
            stream.held.clear()
            for _ in range(min(self._config.batches_per_turn - len(work), len(stream.queue))):
                work.append((stream.queue.popleft(), False))
            if not stream.queue:
                self._ready.pop(sid, None)
        if not work:
            return
        if not self._ensure_reset(stream):
            self._hold(stream, work, 0, work[0][1])
            return
        self._process(stream, work)
        self._recover_dropped(stream)

    def _recover_dropped(self, stream: _Stream) -> None:
        """Once a stream's queue has drained, fetch what overflow dropped from it.

        Without this, the newest batches dropped by a full queue would only be noticed
        when the pod publishes again, which an idle pod may not do for a long time.
        """
        with self._cond:
            dropped = stream.dropped_until
            if dropped is None or stream.queue or stream.held or stream.blocked:
                return
            stream.dropped_until = None
        expected = stream.tracker.expected
        if expected is None or expected > dropped:
            return
        stream.gaps += 1
        if self._can_replay(stream):
            self._start_replay(_ReplayJob(stream, expected, dropped, False))
            return
        self._lost(stream, dropped - expected + 1, self._no_replay_reason(stream))
        stream.tracker.skip_to(dropped + 1)

    def _process(self, stream: _Stream, work: list[tuple[Arrival, bool]]) -> None:
        """Apply a turn's messages in order; stop and hold the rest when one must wait."""
        tracker = stream.tracker
        pending: list[Delivery] = []
        for i, (arrival, observed) in enumerate(work):
            seq = arrival.seq
            verdict = tracker.position(seq) if observed else tracker.live(seq)
            if verdict.action is Action.RESTART:
                # Batches of the old engine first, then the reset, then the new engine.
                if not self._flush(stream, pending):
                    return self._hold(stream, work, i, False)
                pending = []
                self._note_restart(stream, seq)
                if not self._ensure_reset(stream):
                    return self._hold(stream, work, i, False)
                verdict = tracker.live(seq)
            action = verdict.action
            if action is Action.APPLY:
                self._apply_live(stream, arrival, pending)
            elif action is Action.DUPLICATE:
                stream.duplicates += 1
            elif action is Action.FIRST_CONTACT:
                if self._config.catch_up_on_first_contact and self._can_replay(stream):
                    if not self._flush(stream, pending):
                        return self._hold(stream, work, i, True)
                    self._start_replay(_ReplayJob(stream, 0, seq - 1, True))
                    return self._hold(stream, work, i, True)
                tracker.skip_to(seq)  # joined late, nothing to catch up from
                self._apply_live(stream, arrival, pending)
            else:  # GAP
                if not self._flush(stream, pending):
                    return self._hold(stream, work, i, True)
                pending = []
                stream.gaps += 1
                if self._can_replay(stream):
                    self._start_replay(
                        _ReplayJob(stream, verdict.missing_from, verdict.missing_to, False)
                    )
                    return self._hold(stream, work, i, True)
                self._lost(stream, verdict.missing, self._no_replay_reason(stream))
                tracker.skip_to(seq)
                self._apply_live(stream, arrival, pending)
        self._flush(stream, pending)
        return None

    def _hold(
        self, stream: _Stream, work: list[tuple[Arrival, bool]], i: int, observed: bool
    ) -> None:
        """Keep work[i:] for later, in order; work[i] with the given ``observed`` flag."""
        rest = [(work[i][0], observed), *work[i + 1 :]]
        with self._cond:
            stream.held.extendleft(reversed(rest))
            if not stream.blocked:
                self._ready[stream.sid] = None

    def _apply(
        self,
        stream: _Stream,
        seq: int,
        payload: bytes,
        model: str,
        received_at: float,
        replayed: bool,
        pending: list[Delivery],
    ) -> None:
        """Decode one batch and queue its delivery; an undecodable batch is consumed."""
        stream.tracker.applied(seq)
        try:
            decoded = self._decoder.decode(payload, stream.layout)
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
        if batch.events:
            stream.layout = decoded.layout
        pending.append(Delivery(stream.sid, model, seq, batch, received_at, replayed))

    def _apply_live(self, stream: _Stream, arrival: Arrival, pending: list[Delivery]) -> None:
        if arrival.bad is not None:  # counted by the receiver; consumes its seq
            stream.tracker.applied(arrival.seq)
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
        )

    def _can_replay(self, stream: _Stream) -> bool:
        return bool(stream.replay_endpoint) and self._clock() >= stream.replay_cooldown_until

    @staticmethod
    def _no_replay_reason(stream: _Stream) -> str:
        if stream.replay_endpoint:
            return f"replay endpoint {stream.replay_endpoint} failed recently"
        return "no replay endpoint"

    def _flush(self, stream: _Stream, pending: list[Delivery]) -> bool:
        """Deliver ``pending``; on failure rewind to its first seq and pause the stream."""
        if not pending:
            return True
        try:
            self._sink.deliver(pending)
        except Exception as exc:
            self._sink_failed(stream, pending[0].seq, pending[-1].seq, exc)
            return False
        counts = self._event_counts
        for delivery in pending:
            for event in delivery.batch.events:
                name = _event_name(event)
                counts[name] = counts.get(name, 0) + 1
        last = pending[-1]
        if stream.first_seq is None:
            stream.first_seq = pending[0].seq
        stream.delivered += len(pending)
        stream.last_seq = last.seq
        stream.last_batch_ts = last.batch.ts
        stream.backoff = 0.0
        if self._gate is not None:
            self._gate.committed(stream.sid, last.seq)
        return True

    def _sink_failed(self, stream: _Stream, first: int, last: int, exc: Exception) -> None:
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
        stream.tracker.rewind(first)
        stream.resync_until = (
            last if stream.resync_until is None else max(stream.resync_until, last)
        )
        if not stream.replay_endpoint:
            # Nothing can bring these batches back: count them lost now.
            self._lost(stream, last - first + 1, "the sink failed; no replay endpoint")
            stream.tracker.skip_to(last + 1)
            stream.resync_until = None
        self._stall(stream)

    def _stall(self, stream: _Stream) -> None:
        config = self._config
        stream.backoff = min(config.retry_max_s, max(config.retry_initial_s, stream.backoff * 2))
        stream.stalled_until = self._clock() + stream.backoff
        self._stalled.add(stream.sid)
        with self._cond:
            self._ready.pop(stream.sid, None)

    def _retry_due(self) -> None:
        now = self._clock()
        for sid in list(self._stalled):
            stream = self._streams.get(sid)
            if stream is None:
                self._stalled.discard(sid)
                continue
            if stream.stalled_until is None or stream.stalled_until > now:
                continue
            self._stalled.discard(sid)
            stream.stalled_until = None
            if not self._owns(stream) or stream.blocked:
                continue
            if not self._ensure_reset(stream):
                continue
            expected = stream.tracker.expected
            until = stream.resync_until
            stream.resync_until = None
            if until is not None and expected is not None and expected <= until:
                if self._can_replay(stream):
                    stream.resync_until = until
                    self._start_replay(_ReplayJob(stream, expected, until, False))
                    continue
                self._lost(stream, until - expected + 1, self._no_replay_reason(stream))
                stream.tracker.skip_to(until + 1)
            self._wake_stream(stream)
        if now >= self._orphan_retry_at:
            self._retry_orphan_resets()

    def _wake_stream(self, stream: _Stream) -> None:
        with self._cond:
            if not stream.blocked and (stream.queue or stream.held):
                self._ready[stream.sid] = None

    def _ensure_reset(self, stream: _Stream) -> bool:
        """Run the stream's pending sink reset, if any; pause the stream if it fails."""
        reason = self._pending_resets.get(stream.sid)
        if reason is None:
            return True
        if self._try_reset(stream.sid, reason):
            return True
        self._stall(stream)
        return False

    def _try_reset(self, sid: StreamId, reason: str) -> bool:
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

    def _retry_orphan_resets(self) -> None:
        """Resets of forgotten streams that failed: retry until the sink takes them."""
        failed = False
        for sid, reason in list(self._pending_resets.items()):
            if sid not in self._streams and not self._try_reset(sid, reason):
                failed = True
        self._orphan_retry_at = self._clock() + (self._config.retry_initial_s if failed else 0)

    def _note_restart(self, stream: _Stream, seq: int) -> None:
        log.info(
            "KV events: %s restarted (seq %d after %s); clearing its entries",
            stream.sid,
            seq,
            stream.tracker.highest_live,
        )
        stream.restarts += 1
        stream.tracker.restart()
        stream.gapped = False
        stream.first_seq = None
        stream.resync_until = None
        with self._cond:
            stream.dropped_until = None  # seqs of the old engine
        self._pending_resets[stream.sid] = "engine_restart"

    def _lost(self, stream: _Stream, count: int, why: str) -> None:
        if count <= 0:
            return
        stream.missed_batches += count
        stream.gapped = True
        self._errors.add("missed_batches", count)
        self._ratelog.warning(
            "missed_batches",
            "KV events: lost %d batch(es) of %s (%s); its index entries may be stale. "
            "Give engines a replay_endpoint (bind mode: set replay_port) to recover gaps",
            count,
            stream.sid,
            why,
        )

    # -- ownership (with a gate) ------------------------------------------------------

    def _owns(self, stream: _Stream) -> bool:
        """Whether this replica may apply ``stream`` now, acting on any change: a new
        epoch resumes from the gate's position, a lost stream stands by, an unknown one
        waits with its queue intact."""
        gate = self._gate
        if gate is None:
            return True
        claim = gate.claim(stream.sid)
        if claim.ownership is Ownership.OWNED:
            if claim.epoch != stream.epoch:
                self._take_over(stream, claim)
            return True
        if claim.ownership is Ownership.NOT_OWNED:
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
        with self._cond:
            streams = list(self._streams.values())
        for stream in streams:
            if stream.stalled_until is None or stream.standby:
                self._owns(stream)

    def _stand_by(self, stream: _Stream) -> None:
        """Another replica applies this stream: drop what is queued, remember the last
        seq seen (a later takeover replays from the owner's position up to it)."""
        sid = stream.sid
        with self._cond:
            arrivals = [a for a, _ in stream.held] + list(stream.queue)
            stream.held.clear()
            stream.queue.clear()
            self._ready.pop(sid, None)
            stream.dropped_until = None
        if arrivals:
            stream.standby_seq = max(arrivals, key=lambda a: a.received_at).seq
            stream.not_owner += len(arrivals)
            self._errors.add("not_owner", len(arrivals))
        if stream.standby:
            return
        log.info("KV events: %s is applied by another replica; standing by", sid)
        stream.standby = True
        stream.epoch = None
        stream.tracker.restart()
        self._forget_recovery(stream)

    def _forget_recovery(self, stream: _Stream) -> None:
        """Drop this replica's replay, retry and gap state of a stream whose ownership
        changed: the owner's stored position is the truth from now on."""
        stream.replaying = False
        stream.replay_job = None  # a replay in flight is discarded when it ends
        stream.stalled_until = None
        stream.resync_until = None
        stream.backoff = 0.0
        stream.gapped = False
        self._stalled.discard(stream.sid)
        self._pending_resets.pop(stream.sid, None)

    def _take_over(self, stream: _Stream, claim: Claim) -> None:
        """This replica now owns the stream (again): forget local sequence state and
        resume after ``claim.resume_after``; fetch by replay what went by meanwhile."""
        sid, after = stream.sid, claim.resume_after
        tracker = stream.tracker
        with self._cond:
            # The newest seq this replica knows the engine published: seen standing by,
            # received live, or undelivered because the index failed or a queue overflowed.
            known = (stream.standby_seq, tracker.highest_live, stream.resync_until)
            seen = max((s for s in (*known, stream.dropped_until) if s is not None), default=None)
            stream.dropped_until = None
        stream.standby_seq = None
        log.info(
            "KV events: applying %s from here on (resuming after seq %s)",
            sid,
            "none" if after is None else after,
        )
        stream.epoch = claim.epoch
        stream.standby = False
        self._forget_recovery(stream)
        tracker.restart()
        if after is not None:
            tracker.expected = after + 1
        if after is not None or seen is not None:
            tracker.highest_live = max(-1 if after is None else after, -1 if seen is None else seen)
        with self._cond:
            # Batches at or below the position were applied by the previous owner.
            waiting = [a for a, _ in stream.held] + list(stream.queue)
            fresh = [a for a in waiting if after is None or a.seq > after]
            stream.held.clear()
            stream.queue.clear()
            stream.queue.extend(fresh)  # classified as live again, against the new state
            if fresh:
                self._ready[sid] = None
                if seen is not None and seen > fresh[-1].seq:
                    stream.dropped_until = seen  # fetched once the queue has drained
        if seen is None or (after is not None and seen <= after) or fresh:
            return
        if self._can_replay(stream):
            start = 0 if after is None else after + 1
            self._start_replay(_ReplayJob(stream, start, seen, after is None))
        elif after is not None:
            self._lost(stream, seen - after, self._no_replay_reason(stream))
            tracker.skip_to(seen + 1)

    def _wait_for_gate(self, stream: _Stream) -> None:
        """Ownership unknown: keep everything queued and ask again shortly."""
        stream.stalled_until = self._clock() + _GATE_RETRY_S
        self._stalled.add(stream.sid)
        with self._cond:
            self._ready.pop(stream.sid, None)

    # -- replay -----------------------------------------------------------------

    def _start_replay(self, job: _ReplayJob) -> None:
        stream = job.stream
        stream.replaying = True
        stream.replay_job = job
        with self._cond:
            self._ready.pop(stream.sid, None)
        endpoint = stream.replay_endpoint
        assert endpoint is not None
        try:
            self._executor.submit(self._run_replay, job, endpoint)
        except RuntimeError:  # executor shut down: stopping
            stream.replaying = False
            stream.replay_job = None

    def _run_replay(self, job: _ReplayJob, endpoint: str) -> None:
        """On a replay worker: fetch, then hand the result to the applier."""
        try:
            result = fetch_replay(
                endpoint,
                job.start,
                timeout_s=self._config.replay_timeout_s,
                max_batches=self._config.replay_max_batches,
                context=self._ctx,
            )
        except Exception as exc:
            result = ReplayResult(reason="error", detail=repr(exc))
        with self._cond:
            self._replays_done.append((job, result, self._clock()))
            self._cond.notify()

    def _finish_replay(self, job: _ReplayJob, result: ReplayResult, received_at: float) -> None:
        stream = job.stream
        if self._streams.get(stream.sid) is not stream:
            return  # forgotten while the replay ran: discard everything it brought
        if stream.replay_job is not job:
            return  # ownership changed while it ran: what it brought is not ours to apply
        stream.replaying = False
        stream.replay_job = None
        epoch = stream.epoch
        if not self._owns(stream) or stream.epoch != epoch:
            return  # nothing applied: the gap is found, and fetched, again once owned
        if result.complete:
            stream.replays_ok += 1
        else:
            stream.replays_failed += 1
            # Do not stall this stream for a full timeout at every gap while its replay
            # endpoint is down: declare gaps lost at once until the cooldown ends.
            stream.replay_cooldown_until = self._clock() + self._config.retry_max_s
            self._errors.add(f"replay_{result.reason}")
            self._ratelog.warning(
                "replay_failed",
                "KV events: replay of %s from %s (seq %d..) ended with %s %s",
                stream.sid,
                stream.replay_endpoint,
                job.start,
                result.reason,
                result.detail,
            )
        if result.bad_replies:
            self._errors.add("bad_replay_reply", result.bad_replies)
        tracker = stream.tracker
        pending: list[Delivery] = []
        for seq, payload in result.batches:
            verdict = tracker.position(seq)
            action = verdict.action
            if action is Action.DUPLICATE:
                stream.duplicates += 1
                continue
            if action is Action.FIRST_CONTACT:
                tracker.skip_to(seq)  # the buffer no longer reaches back to seq 0
            elif action is Action.GAP:
                self._lost(stream, verdict.missing, "no longer in the engine's replay buffer")
                tracker.skip_to(seq)
            self._apply(stream, seq, payload, stream.model, received_at, True, pending)
        if not self._flush(stream, pending):
            return
        expected = tracker.expected
        if expected is None or expected <= job.need_until:
            if not job.catch_up:
                missing = job.need_until - (expected if expected is not None else 0) + 1
                self._lost(stream, missing, f"replay {result.reason}")
            tracker.skip_to(job.need_until + 1)
        if (
            stream.resync_until is not None
            and tracker.expected is not None
            and (tracker.expected > stream.resync_until)
        ):
            stream.resync_until = None
        self._wake_stream(stream)

    # -- pod removal ------------------------------------------------------------------

    def _forget(self, pod: str) -> None:
        """On the applier thread: drop the pod's streams, then reset them in the sink."""
        with self._cond:
            victims = [s for sid, s in self._streams.items() if sid.pod == pod]
            for stream in victims:
                del self._streams[stream.sid]
                self._ready.pop(stream.sid, None)
                for name in _COUNTERS:
                    self._retired[name] += getattr(stream, name)
            self._forgotten[pod] = self._clock() + self._config.forget_quiet_s
        for stream in victims:
            self._stalled.discard(stream.sid)
            self._pending_resets[stream.sid] = "pod_removed"
            if self._gate is not None:
                self._gate.release(stream.sid)
        for sid in [s for s in self._pending_resets if s.pod == pod]:
            self._try_reset(sid, "pod_removed")
        log.info("KV events: forgot pod %s (%d stream(s))", pod, len(victims))

"""The subscriber: every engine's KV-event stream, in order, into one BatchSink.

Topologies (both at once is fine): **bind**, one SUB socket every engine's PUB connects
to, the topic ``kv@<pod>@<model>`` the only sender identity; **connect**, one SUB socket
per engine endpoint, which identifies the pod unless the topic does.

This module only wires the threads together. The **receiver** thread
(:mod:`~kvindex.events.ingest.receiver`) owns every socket and queues each message on its
stream's lane in the :mod:`~kvindex.events.ingest.inbox`; the **applier** thread
(:mod:`~kvindex.events.ingest.applier`) owns every stream's state and is the only caller of the
sink; **replay workers** (:mod:`~kvindex.events.ingest.replay_workers`) fetch missed batches and
answer through the inbox, as control calls (``forget_pod``, ``connect``) do. What is
lost, recovered and reported, and when: docs/correctness.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import zmq

from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.ingest.applier import Applier, Control
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.gate import StreamGate
from kvindex.events.ingest.heap import memory_limit
from kvindex.events.ingest.inbox import Inbox
from kvindex.events.ingest.ratelog import RateLimitedLog
from kvindex.events.ingest.receiver import Arrival, Receiver
from kvindex.events.ingest.replay_workers import ReplayWorkers
from kvindex.events.ingest.sink import BatchSink
from kvindex.events.ingest.status import IngestHealth, ReasonCounts, StreamStatus
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.wire.identity import IdentityError, StreamId, normalize_pod

log = logging.getLogger(__name__)

_CONTROL_TIMEOUT_S = 10.0
#: New streams the inbox may hold beyond ``max_streams`` until the applier admits or
#: refuses them.
_ADMISSION_SLACK = 64


class Subscriber:
    """Consumes vLLM KV-event streams and hands them, in order, to a :class:`BatchSink`.

    Configure sockets with :meth:`bind` / :meth:`connect` before or after :meth:`start`;
    :meth:`stop` ends every thread and closes every socket. ``clock`` stamps
    ``received_at`` and drives retry timers. ``gate`` (optional) says which streams this
    replica may apply when several share one index. ``replay_resolver`` (optional) is
    the one place a bind-mode stream's replay endpoint is chosen (None: bind mode's
    ``replay_port`` rule; connect-mode streams use their PodEndpoint's). ``pod_known``
    (optional) says whether a pod is discovered, which pins its streams like a
    connect-mode pod's (never evicted for idling). ``discovered_pods`` (optional): bind
    mode accepts only these pods' streams (:mod:`kvindex.events.ingest.admission`).
    """

    def __init__(
        self,
        sink: BatchSink,
        config: SubscriberConfig | None = None,
        clock: Callable[[], float] = time.time,
        *,
        context: zmq.Context | None = None,
        gate: StreamGate | None = None,
        replay_resolver: Callable[[StreamId], str | None] | None = None,
        pod_known: Callable[[str], bool] | None = None,
        discovered_pods: KnownPods | None = None,
    ) -> None:
        self._config = config if config is not None else SubscriberConfig()
        self._clock = clock
        # The process-wide context, not one of our own: a private Context that the garbage
        # collector reaches inside a reference cycle (a Subscriber dropped without stop())
        # runs Context.__del__ -> term() after the cycle's weakrefs are cleared, so it
        # closes none of our sockets and blocks whatever thread collected it, for good.
        self._ctx = context if context is not None else zmq.Context.instance()
        self._errors = ReasonCounts()
        self._health = IngestHealth()
        self._ratelog = RateLimitedLog(log, self._config.log_interval_s)
        self._resolver = replay_resolver
        self._pod_known = pod_known
        self._inbox = Inbox(
            self._config.queue_capacity,
            self._config.max_streams + _ADMISSION_SLACK,
            self._errors,
            self._overflowed,
            self._refused,
            self._config.queue_bytes or memory_limit() // 4,
        )
        self._applier = Applier(
            sink,
            self._config,
            clock,
            self._inbox,
            lambda post: ReplayWorkers(self._config, self._ctx, post, clock, self._health),
            self._errors,
            self._ratelog,
            gate,
            self._replay_endpoint,
            self._pinned,
            self._discovered,
            self._stream_closed,
            self._health,
        )
        self._receiver = Receiver(
            self._ctx, self._config, self._inbox.put_arrivals, self._errors, self._ratelog, clock,
            discovered_pods, self._on_reconnect, self._on_accept, self._health,
        )  # fmt: skip
        self._started = False
        self._stopped = False

    # -- the one place a stream's replay endpoint and pinning are decided ------------------

    def _replay_endpoint(self, sid: StreamId, arrival: Arrival) -> str | None:
        if self._resolver is not None and not arrival.connected:
            return self._resolver(sid)
        return arrival.replay_endpoint

    def _pinned(self, arrival: Arrival) -> bool:
        return arrival.connected or self._discovered(arrival.stream.pod)

    def _discovered(self, pod: str) -> bool:
        return self._pod_known is not None and self._pod_known(pod)

    def _stream_closed(self, sid: StreamId) -> None:
        """A stream left the applier's table, or never got a place (any thread)."""
        self._receiver.release_stream(sid)

    def _overflowed(self, sid: StreamId, capacity: int) -> None:
        self._ratelog.warning(
            "queue_overflow",
            "KV events: queue of %s is full (%d batches, or its share of %d MiB for all "
            "queues); dropping the newest batch, replay will recover it (raise "
            "--stream-queue / --queue-memory if this persists)",
            sid,
            capacity,
            self._inbox.budget >> 20,
        )

    def _refused(self, sid: StreamId) -> None:
        self._stream_closed(sid)
        self._ratelog.warning(
            "too_many_streams",
            "KV events: ignoring new stream %s, too many new streams at once (max_streams %d)",
            sid,
            self._config.max_streams,
        )

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
        """Subscribe to one engine endpoint (one data-parallel rank of one pod).

        A pod whose streams exist already (re-subscribed: an address change, a restart
        of discovery) has its position verified against the engine before it reads
        ``live`` again. A target whose pod and model are known has its stream from now
        on, ``unheard`` until its engine is heard (:meth:`Applier.expect`)."""
        self._receiver.connect(target)
        if target.pod is not None:
            try:
                pod = normalize_pod(target.pod, self._config.default_serving_port)
            except IdentityError:
                return
            self._post(lambda: self._applier.reconnected(pod))
            model = target.model or self._config.default_model
            if model:  # its stream is known before its engine says a word: unheard
                sid = StreamId(pod, target.rank)
                replay = target.replay_endpoint
                self._post(lambda: self._applier.expect(sid, model, replay))

    def _on_reconnect(self, pod: str) -> None:
        """The receiver saw ZMQ reconnect one of the pod's endpoints (receiver thread)."""
        self._post(lambda: self._applier.reconnected(pod))

    def _on_accept(self, host: str) -> None:
        """A bind-mode socket accepted a connection from ``host`` (receiver thread)."""
        self._post(lambda: self._applier.reconnected_host(host))

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
        self._control(lambda: self._applier.forget(pod))

    def _control(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the applier thread (inline if that is this thread or none runs)."""
        applier = self._applier.thread
        if applier is None or not applier.is_alive() or threading.current_thread() is applier:
            return fn()
        future: Future[object] = Future()
        self._inbox.post(Control(fn, future))
        return future.result(timeout=_CONTROL_TIMEOUT_S)

    def _post(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the applier thread without waiting for it (discovery must not
        block on an applier busy with a slow sink)."""
        applier = self._applier.thread
        if applier is None or not applier.is_alive() or threading.current_thread() is applier:
            fn()
            return
        self._inbox.post(Control(fn, Future()))

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise RuntimeError("subscriber already started")
        self._started = True
        self._applier.start()
        self._receiver.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop receiving and applying; close every socket. Bounded by ``timeout_s`` plus
        the replay timeout (a replay in flight is allowed to end)."""
        if self._stopped:
            return
        self._stopped = True
        self._receiver.stop(timeout_s)
        self._inbox.stop()
        thread = self._applier.thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("applier thread did not stop within %.1fs", timeout_s)
        self._applier.shutdown_workers()

    def is_running(self) -> bool:
        """True while both threads run: the readiness signal."""
        thread = self._applier.thread
        return (
            self._started
            and not self._stopped
            and self._receiver.alive
            and thread is not None
            and thread.is_alive()
        )

    @property
    def failure(self) -> str | None:
        """Why ingestion stopped for good (an ingest thread died); None while it runs.
        Every stream then reads ``stopped``: the index no longer follows any engine."""
        return self._health.failure

    def wait_for_failure(self, timeout_s: float | None = None) -> str | None:
        """Block until an ingest thread dies (or ``timeout_s`` passes): its failure."""
        return self._health.wait(timeout_s)

    def __enter__(self) -> Subscriber:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- observability --------------------------------------------------------------

    def streams(self) -> list[StreamStatus]:
        """A snapshot of every stream, sorted by pod and rank (read while the applier
        runs, so it may be a few batches behind)."""
        streams = sorted(self._applier.streams(), key=lambda s: s.sid)
        stopped = self._health.failure is not None
        return [
            StreamStatus(
                pod=s.sid.pod,
                rank=s.sid.rank,
                member=s.sid.member,
                model=s.model,
                state="stopped" if stopped else s.state,
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
                queue_depth=len(s.lane) + len(s.held),
                layout=s.layout.value,
                replay_endpoint=s.replay_endpoint,
                not_owner=s.not_owner,
            )
            for s in streams
        ]

    def totals(self) -> dict[str, int]:
        """Every per-stream counter summed over all streams since start, forgotten pods
        included, so each total only ever grows (Prometheus counters can wrap them):
        ``received``, ``delivered``, ``duplicates``, ``gaps``, ``missed_batches``,
        ``replays_ok``, ``replays_failed``, ``restarts``, ``queue_overflows``,
        ``decode_errors``, ``sink_errors``, ``not_owner``."""
        return self._applier.totals()

    def error_counts(self) -> dict[str, int]:
        """Skipped or failed items by reason, since start (bad input, sink errors, ...)."""
        return self._errors.snapshot()

    def event_counts(self) -> dict[str, int]:
        """Events handed to the sink, by type (``BlockStored``, ...)."""
        return self._applier.event_counts()

    def endpoints(self) -> list[PodEndpoint | str]:
        """Current connect targets and bound endpoints."""
        return self._receiver.endpoints()

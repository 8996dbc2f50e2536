"""The receiving end: every SUB socket, on one thread, and the cheap checks at the door.

ZMQ sockets are single-threaded, so one thread owns them all and multiplexes them with a
poller. Calls from other threads (bind, connect, disconnect - Kubernetes discovery makes
them while the service runs) are queued as commands and the thread is woken through an
inproc PAIR socket, so they take effect at once instead of at the next poll timeout.

Per message the receiver does only what it must to route it: framing (3 frames, an
8-byte seq, a UTF-8 topic, a payload under the limit), the sender's identity (topic or
connect endpoint), in bind mode whether the sender may speak for that pod (its
``Peer-Address``, discovery, the per-sender stream cap: :mod:`kvindex.events.admission`)
and the batch envelope. The envelope is decoded here, with the event
list left as raw msgpack (skipped over, not parsed), because in bind mode the
data-parallel rank inside the payload is the only way to tell a pod's ranks apart, and
each rank is its own stream with its own seq counter. Full event decoding happens later
on the applier thread, only for batches that will be applied (duplicates never are).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from kvindex.events.admission import (
    SENDER_STREAM_CAP,
    UNDISCOVERED_POD,
    Allowlist,
    sender_problem,
    stream_cap_problem,
)
from kvindex.events.config import SubscriberConfig
from kvindex.events.endpoints import (
    HARD_MESSAGE_CAP,
    PodEndpoint,
    bind_socket,
    endpoint_host,
    prepare_socket,
    tcp_endpoint,
)
from kvindex.events.identity import IdentityError, StreamId, normalize_pod, parse_topic, pod_host
from kvindex.events.known_pods import KnownPods
from kvindex.events.ratelog import RateLimitedLog
from kvindex.events.status import ReasonCounts
from kvindex.events.wire import (
    MAX_DP_RANK,
    BatchDecoder,
    DecodedBatch,
    DecodeError,
    EnvelopeDecoder,
    Layout,
)

log = logging.getLogger(__name__)

#: Messages taken from one socket per poll round, so one busy socket cannot starve the
#: others or the command queue.
_DRAIN_PER_SOCKET = 256

_TOPIC_CACHE_SIZE = 1024
_COMMAND_TIMEOUT_S = 10.0
_wake_ids = itertools.count()


@dataclass(slots=True)
class Arrival:
    """A message that passed the door checks, attributed to its stream."""

    stream: StreamId
    model: str
    seq: int
    payload: bytes
    received_at: float
    replay_endpoint: str | None
    #: Set when the payload's envelope is unusable (the reason, already counted): the
    #: message still accounts for its seq, so its stream sees no false gap.
    bad: str | None = None
    #: The topic frame as sent (replay replies of vLLM >= 0.26 must repeat it).
    topic: bytes | None = None
    #: Received on a connect-mode socket: the pod is configured, not just claimed.
    connected: bool = False
    #: The payload, decoded here to read its rank (None: the applier decodes it).
    decoded: DecodedBatch | None = None


@dataclass(slots=True)
class _Source:
    """One SUB socket: a bind endpoint, or a connect-mode pod endpoint."""

    endpoint: str
    target: PodEndpoint | None  # None in bind mode
    # topic bytes -> (pod, model) or a skip reason; bounded, per socket.
    identities: dict[bytes, tuple[str, str] | str] = field(default_factory=dict)
    # Pods whose messages arrived here (from topics), so forget_pod finds the socket.
    pods: set[str] = field(default_factory=set)


class Receiver:
    """Owns the SUB sockets; hands attributed messages to ``deliver`` in batches.

    ``deliver`` is called on the receiver thread with every message of one poll round,
    in arrival order per socket. ``discovered`` is Kubernetes discovery's pods, when
    bind mode must accept only those.
    """

    def __init__(
        self,
        context: zmq.Context,
        config: SubscriberConfig,
        deliver: Callable[[list[Arrival]], None],
        errors: ReasonCounts,
        ratelog: RateLimitedLog,
        clock: Callable[[], float],
        discovered: KnownPods | None = None,
    ) -> None:
        self._ctx = context
        self._config = config
        self._known = discovered
        self._allowlist = Allowlist.parse(config.bind_allow, config.default_serving_port)
        # Bind mode, receiver thread only: the streams each sender address opened, and
        # the address verdicts already worked out, per (pod, sender).
        self._sender_streams: dict[str, set[StreamId]] = {}
        self._address_verdicts: dict[tuple[str, str | None], str | None] = {}
        self._deliver = deliver
        self._errors = errors
        self._ratelog = ratelog
        self._clock = clock
        self._envelope = EnvelopeDecoder()
        self._batches = BatchDecoder()
        self._layout = Layout.ARRAY  # what the last payload was: the first guess
        self._sources: dict[zmq.Socket, _Source] = {}
        self._poller = zmq.Poller()
        wake = f"inproc://kvindex-receiver-wake-{next(_wake_ids)}"
        self._wake_rx = context.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx = context.socket(zmq.PAIR)
        self._wake_tx.connect(wake)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._commands: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._command_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False

    # -- commands (any thread) ----------------------------------------------------

    def bind(self, endpoint: str) -> str:
        """Bind a SUB socket every engine's PUB connects to; return the bound endpoint."""
        return self._call(lambda: self._bind(endpoint))

    def connect(self, target: PodEndpoint) -> None:
        """Subscribe to one engine's PUB endpoint (replacing its target if known)."""
        self._call(lambda: self._connect(target))

    def disconnect(self, endpoint: str) -> bool:
        """Close the SUB socket of a connect or bind endpoint; False if unknown."""
        return self._call(lambda: self._disconnect(endpoint))

    def disconnect_pod(self, pod: str) -> list[str]:
        """Close every connect-mode socket that belongs to ``pod``; return their endpoints."""
        return self._call(lambda: self._disconnect_pod(pod))

    def endpoints(self) -> list[PodEndpoint | str]:
        """Current sources: PodEndpoints (connect mode) and bound endpoints (bind mode)."""
        return self._call(lambda: [s.target or s.endpoint for s in self._sources.values()])

    def _call(self, fn: Callable[[], Any]) -> Any:
        with self._command_lock:
            if self._closed:
                raise RuntimeError("subscriber is stopped")
            thread = self._thread
            if thread is None or not thread.is_alive():
                return fn()  # no thread owns the sockets yet: run here
            future: Future[Any] = Future()
            self._commands.append((fn, future))
            self._wake_tx.send(b"")
        return future.result(timeout=_COMMAND_TIMEOUT_S)

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        with self._command_lock:
            if self._thread is not None:
                raise RuntimeError("receiver already started")
            # From here on the thread owns every socket (Thread.start is a memory barrier).
            self._thread = threading.Thread(target=self._run, name="kvindex-receiver", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread and close every socket; False if the thread did not end."""
        with self._command_lock:
            if self._closed:
                return True
            self._closed = True
            self._stopping = True
            thread = self._thread
            if thread is not None and thread.is_alive():
                self._wake_tx.send(b"")
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("receiver thread did not stop within %.1fs", timeout_s)
                return False
        else:
            self._close_sockets()
        self._wake_tx.close(linger=0)
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the receiver thread ------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                ready = dict(self._poller.poll(1000))
                arrivals: list[Arrival] = []
                for sock in ready:
                    source = self._sources.get(sock)
                    if source is not None:
                        self._drain(sock, source, arrivals)
                if arrivals:
                    self._deliver(arrivals)
                if self._wake_rx in ready:
                    self._run_commands()
        except Exception:
            log.exception("receiver thread failed; no more KV events will be received")
            raise
        finally:
            self._fail_pending_commands()
            self._close_sockets()

    def _run_commands(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        with self._command_lock:
            commands, self._commands = self._commands, []
        for fn, future in commands:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _fail_pending_commands(self) -> None:
        with self._command_lock:
            commands, self._commands = self._commands, []
        for _, future in commands:
            future.set_exception(RuntimeError("subscriber is stopped"))

    def _close_sockets(self) -> None:
        for sock in list(self._sources):
            sock.close(linger=0)
        self._sources.clear()
        self._wake_rx.close(linger=0)

    def _new_sub(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self._config.receive_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_CAP)
        return sock

    def _bind(self, endpoint: str) -> str:
        sock = self._new_sub()
        try:
            bound = bind_socket(sock, endpoint)
            sock.setsockopt(zmq.SUBSCRIBE, self._config.topic_filter.encode("utf-8"))
        except Exception:
            sock.close(linger=0)
            raise
        self._add(sock, _Source(bound, None))
        log.info("KV events: bound %s (topic filter %r)", bound, self._config.topic_filter)
        return bound

    def _connect(self, target: PodEndpoint) -> None:
        if target.pod is not None:
            pod = normalize_pod(target.pod, self._config.default_serving_port)
            target = PodEndpoint(
                target.endpoint, pod, target.model, target.replay_endpoint, target.rank
            )
        for source in self._sources.values():
            if source.target is not None and source.endpoint == target.endpoint:
                source.target = target
                source.identities.clear()
                return
        sock = self._new_sub()
        try:
            prepare_socket(sock, target.endpoint)
            sock.connect(target.endpoint)
            # vLLM's default topic is "": take everything the engine publishes.
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        except Exception:
            sock.close(linger=0)
            raise
        self._add(sock, _Source(target.endpoint, target))
        log.info("KV events: connected to %s", target.endpoint)

    def _add(self, sock: zmq.Socket, source: _Source) -> None:
        self._sources[sock] = source
        self._poller.register(sock, zmq.POLLIN)

    def _remove(self, sock: zmq.Socket) -> None:
        self._poller.unregister(sock)
        del self._sources[sock]
        sock.close(linger=0)

    def _disconnect(self, endpoint: str) -> bool:
        for sock, source in list(self._sources.items()):
            if source.endpoint == endpoint or (
                source.target is not None and source.target.endpoint == endpoint
            ):
                self._remove(sock)
                return True
        return False

    def _disconnect_pod(self, pod: str) -> list[str]:
        for streams in self._sender_streams.values():
            streams.difference_update([sid for sid in streams if sid.pod == pod])
        removed = []
        for sock, source in list(self._sources.items()):
            target = source.target
            if target is None:
                continue
            if target.pod == pod or pod in source.pods:
                removed.append(source.endpoint)
                self._remove(sock)
        return removed

    # -- per message --------------------------------------------------------------

    def _drain(self, sock: zmq.Socket, source: _Source, out: list[Arrival]) -> None:
        bind_mode = source.target is None
        peer: str | None = None
        for _ in range(_DRAIN_PER_SOCKET):
            try:
                if bind_mode:
                    # Frames, not bytes: only a Frame carries the sender's Peer-Address.
                    received = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    peer = _peer_address(received[0])
                    frames = [frame.bytes for frame in received]
                else:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            arrival = self._admit(source, frames, peer)
            if arrival is not None:
                out.append(arrival)

    def _admit(self, source: _Source, frames: list[bytes], peer: str | None) -> Arrival | None:
        if len(frames) != 3:
            return self._skip("bad_frame_count", source, "message with %d frames", len(frames))
        topic, seq_frame, payload = frames
        if len(seq_frame) != 8:
            return self._skip("bad_seq_frame", source, "seq frame of %d bytes", len(seq_frame))
        if len(payload) > self._config.max_payload_bytes:
            return self._skip(
                "payload_too_large",
                source,
                "payload of %d bytes (max_payload_bytes is %d)",
                len(payload),
                self._config.max_payload_bytes,
            )
        identity = source.identities.get(topic)
        if identity is None:
            identity = self._identify(source, topic)
            if len(source.identities) >= _TOPIC_CACHE_SIZE:
                source.identities.clear()
            source.identities[topic] = identity
        if isinstance(identity, str):
            return self._skip(identity, source, "topic %r", topic[:200])
        pod, model = identity
        target = source.target
        if target is None:
            problem = self._sender_problem(pod, peer)
            if problem is not None:
                return self._skip(problem, source, "topic %r from %s", topic[:200], peer)
        seq = int.from_bytes(seq_frame, "big")
        # The rank routes the payload to its stream. Decoding the whole batch here, once,
        # costs less than skipping over its events to read the rank and decoding them
        # again in the applier (a batch's token ids are most of its bytes). A batch that
        # does not decode whole takes the envelope path, which counts why.
        decoded = self._decode(payload)
        try:
            rank = (
                decoded.batch.data_parallel_rank
                if decoded is not None
                else self._envelope.decode(payload).data_parallel_rank
            )
        except msgspec.DecodeError as exc:
            reason = (
                "invalid_batch" if isinstance(exc, msgspec.ValidationError) else "malformed_msgpack"
            )
            self._skip(reason, source, "payload %d from %s: %s", seq, pod, exc)
            if target is None:
                # Bind mode: without the payload's rank the stream is unknown, and
                # guessing could make another rank's seq look like a restart. Drop it;
                # the seq gap it leaves is handled like any other.
                return None
            # Connect mode: one socket is one engine, so the stream is known; let the
            # message account for its seq (it is consumed, not applied).
            return Arrival(
                StreamId(pod, target.rank), model, seq, b"", self._clock(),
                target.replay_endpoint, reason, topic, True,
            )  # fmt: skip
        if rank is None:
            rank = target.rank if target is not None else 0
        if target is None and not self._admit_stream(StreamId(pod, rank), peer or ""):
            return self._skip(
                SENDER_STREAM_CAP,
                source,
                "new stream %s from %s (max_streams_per_sender is %d)",
                StreamId(pod, rank),
                peer,
                self._config.max_streams_per_sender,
            )
        if target is not None:
            replay = target.replay_endpoint
        elif self._config.replay_port:
            replay = tcp_endpoint(pod_host(pod), self._config.replay_port + rank)
        else:
            replay = None
        return Arrival(
            StreamId(pod, rank), model, seq, payload, self._clock(), replay,
            topic=topic, connected=target is not None, decoded=decoded,
        )  # fmt: skip

    def _decode(self, payload: bytes) -> DecodedBatch | None:
        """The whole batch, or None when it is not a usable batch with a valid rank."""
        try:
            decoded = self._batches.decode(payload, self._layout)
        except DecodeError:
            return None
        rank = decoded.batch.data_parallel_rank
        if rank is not None and rank > MAX_DP_RANK:
            return None  # the envelope decoder rejects it, and counts it
        if decoded.batch.events:
            self._layout = decoded.layout
        return decoded

    def _sender_problem(self, pod: str, peer: str | None) -> str | None:
        """:func:`~kvindex.events.admission.sender_problem`, with the address part (fixed
        for a pod and sender) remembered; discovery's answer can change, so it is not."""
        if self._known is not None and pod not in self._known:
            return UNDISCOVERED_POD
        key = (pod, peer)
        try:
            return self._address_verdicts[key]
        except KeyError:
            pass
        problem = sender_problem(pod, peer, self._allowlist, None)
        if len(self._address_verdicts) >= _TOPIC_CACHE_SIZE:
            self._address_verdicts.clear()
        self._address_verdicts[key] = problem
        return problem

    def _admit_stream(self, sid: StreamId, peer: str) -> bool:
        """Whether ``peer`` may send on ``sid``: a stream it opened, or room for one more."""
        streams = self._sender_streams.get(peer)
        if streams is None:
            streams = self._sender_streams[peer] = set()
        elif sid in streams:
            return True
        if stream_cap_problem(True, len(streams), self._config.max_streams_per_sender):
            return False
        streams.add(sid)
        return True

    def _identify(self, source: _Source, topic_bytes: bytes) -> tuple[str, str] | str:
        """(pod, model) for a topic on this socket, or the reason it names no pod."""
        try:
            topic = topic_bytes.decode("utf-8")
        except UnicodeDecodeError:
            return "bad_topic_encoding"
        port = self._config.default_serving_port
        target = source.target
        try:
            parsed = parse_topic(topic, port)
        except IdentityError as exc:
            if target is None:
                self._ratelog.warning(
                    "bad_topic",
                    "KV events: bind-mode topic names no pod (%s); engines must publish "
                    "under kv@<pod>@<model> (and set the default serving port if <pod> has "
                    "no port)",
                    exc,
                )
                return "bad_topic"
        else:
            if target is not None:
                source.pods.add(parsed.pod)
            return parsed.pod, parsed.model
        # Connect mode, topic not in the kv@<pod>@<model> convention: the endpoint says.
        pod = target.pod
        if pod is None:
            host = endpoint_host(target.endpoint)
            if host is None or port is None:
                self._ratelog.warning(
                    "unknown_pod",
                    "KV events from %s name no pod: set the PodEndpoint's pod, the "
                    "default serving port, or the engine's topic to kv@<pod>@<model>",
                    target.endpoint,
                )
                return "unknown_pod"
            try:
                pod = normalize_pod(host, port)
            except IdentityError:
                return "unknown_pod"
        model = target.model or self._config.default_model
        if model is None:
            self._ratelog.warning(
                "unknown_model",
                "KV events from %s name no model: set the PodEndpoint's model, the "
                "default model, or the engine's topic to kv@<pod>@<model>",
                target.endpoint,
            )
            return "unknown_model"
        return pod, model

    def _skip(self, reason: str, source: _Source, detail: str, *args: object) -> None:
        self._errors.add(reason)
        self._ratelog.warning(
            reason,
            "KV events: skipped a message from %s (%s): " + detail,
            source.endpoint,
            reason,
            *args,
        )
        return None


def _peer_address(frame: zmq.Frame) -> str | None:
    """The sender's IP address as ZMQ saw it (TCP); None for ipc/inproc."""
    try:
        return frame.get("Peer-Address") or None
    except zmq.ZMQError:
        return None

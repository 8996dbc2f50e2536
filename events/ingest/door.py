"""The checks at the door: one received message -> an :class:`Arrival` for its stream, or
a counted skip.

Per message only what routing needs: framing (3 frames, an 8-byte seq, a payload under
the limit), the sender's identity (topic or connect endpoint, cached per socket), in
bind mode whether the sender may speak for that pod (its ``Peer-Address``, discovery,
the per-sender stream cap: :mod:`kvindex.events.ingest.admission`), in either mode whether
its model may be indexed (``max_models``), and the batch's
data-parallel rank, which in bind mode is the only way to tell a pod's ranks apart
(each rank is its own stream with its own seq counter). The batch is decoded here once;
one that does not decode whole takes the envelope path, which counts why.

Owned by the receiver thread (:mod:`kvindex.events.ingest.receiver`), which reads the sockets;
this module never touches one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.ingest.admission import (
    MODEL_CAP,
    SENDER_STREAM_CAP,
    UNDISCOVERED_POD,
    UNLISTED_POD,
    Allowlist,
    ModelAdmission,
    address_problem,
    roster_problem,
    stream_cap_problem,
)
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.ratelog import RateLimitedLog
from kvindex.events.ingest.status import ReasonCounts
from kvindex.events.wire.endpoints import PodEndpoint, endpoint_host, tcp_endpoint
from kvindex.events.wire.identity import (
    IdentityError,
    StreamId,
    normalize_pod,
    parse_topic,
    pod_host,
)
from kvindex.events.wire.runs import event_count
from kvindex.events.wire.scanned import ScannedBatch, scan
from kvindex.events.wire.sglang import SglangBatchDecoder
from kvindex.events.wire.vllm import (
    MAX_DP_RANK,
    BatchDecoder,
    DecodedBatch,
    DecodeError,
    EnvelopeDecoder,
    Layout,
    NestedTooDeep,
)

#: Topics (per socket) and address verdicts remembered before the cache starts over.
_TOPIC_CACHE_SIZE = 1024
#: Bytes a waiting message holds besides its payload and hashes (the Arrival, the scan's
#: objects, a run tuple), about.
QUEUED_OVERHEAD = 640
#: What to change when a pod the operator wants is refused at the door.
_SETTING_HINTS = {
    UNLISTED_POD: "; bind mode accepts only the configured pods: add it to --pod-role, "
    "or its host's network to --bind-allow",
    UNDISCOVERED_POD: "; with --k8s-namespace only discovered pods are accepted",
}


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
    #: Consecutive messages this stands for (seqs ``seq`` ..), read as one group by the
    #: receiver's drain: ``decoded`` holds a ScannedBatch of them all, ``payload`` is the
    #: last one's.
    batches: int = 1

    @property
    def nbytes(self) -> int:
        """About the memory it holds while it waits: the payloads, what was read from
        them (a scan's hashes and spans, or msgspec's objects), and the objects around."""
        decoded = self.decoded
        if decoded is None:
            return len(self.payload) + QUEUED_OVERHEAD
        batch = decoded.batch
        if type(batch) is not ScannedBatch:  # msgspec's events: Python ints and structs
            return 2 * len(self.payload) + QUEUED_OVERHEAD
        payloads = batch.payloads
        size = len(payloads[0]) if len(payloads) == 1 else sum(map(len, payloads))
        return size + len(batch.hashes) + 12 * batch.n_events + QUEUED_OVERHEAD * self.batches

    def split(self) -> list[Arrival]:
        """One Arrival per message (itself when it stands for one)."""
        if self.batches == 1:
            return [self]
        assert self.decoded is not None  # only the scanner groups messages
        parts = self.decoded.batch.parts()
        return [
            Arrival(
                self.stream,
                self.model,
                self.seq + i,
                part.payloads[0],
                self.received_at,
                self.replay_endpoint,
                None,
                self.topic,
                self.connected,
                DecodedBatch(part, part.layout),
            )
            for i, part in enumerate(parts)
        ]


@dataclass(slots=True)
class Source:
    """One SUB socket: a bind endpoint, or a connect-mode pod endpoint."""

    endpoint: str
    target: PodEndpoint | None  # None in bind mode
    # topic bytes -> (pod, model) or a skip reason; bounded, per socket.
    identities: dict[bytes, tuple[str, str] | str] = field(default_factory=dict)
    # Pods whose messages arrived here (from topics), so forget_pod finds the socket.
    pods: set[str] = field(default_factory=set)
    # Connect mode: the connection dropped and ZMQ has not reconnected it yet.
    dropped: bool = False


class Door:
    """The receiver thread's per-message checks and the state they keep (bind mode: the
    streams each sender opened, the address verdicts per (pod, sender))."""

    def __init__(
        self,
        config: SubscriberConfig,
        errors: ReasonCounts,
        ratelog: RateLimitedLog,
        clock: Callable[[], float],
        discovered: KnownPods | None = None,
    ) -> None:
        self._config = config
        self._known = discovered
        self._allowlist = Allowlist.parse(config.bind_allow, config.default_serving_port)
        self._configured = frozenset(config.pods)
        configured_models = set(config.models)
        if config.default_model:
            configured_models.add(config.default_model)
        self._models = ModelAdmission(configured_models, config.max_models)
        self._sender_streams: dict[str, set[StreamId]] = {}
        # Streams the applier dropped (evicted, forgotten, refused), from its thread; taken
        # off the senders' tallies before a new stream is counted.
        self._released: list[StreamId] = []
        self._released_lock = threading.Lock()
        self._address_verdicts: dict[tuple[str, str | None], str | None] = {}
        self._errors = errors
        self._ratelog = ratelog
        self._clock = clock
        self._envelope = EnvelopeDecoder()
        self._batches = BatchDecoder()
        self._sglang_models = frozenset(config.sglang_models)
        self._sglang = SglangBatchDecoder()
        self._layout = Layout.ARRAY  # what the last payload was: the first guess

    def forget_pod(self, pod: str) -> None:
        """The pod's streams no longer count against their senders' caps."""
        for streams in self._sender_streams.values():
            streams.difference_update([sid for sid in streams if sid.pod == pod])

    def release(self, sid: StreamId) -> None:
        """Any thread: ``sid`` left the stream table, so it stops counting against its
        sender's cap. Without this a sender's tally only grew: an address whose engines
        come and go (pods on one host, restarts on new ports) was locked out for good
        once ``max_streams_per_sender`` streams had ever been opened from it, even after
        kvindex evicted them for idling."""
        with self._released_lock:
            self._released.append(sid)

    def _take_released(self) -> None:
        with self._released_lock:
            released, self._released = self._released, []
        if not released:
            return
        gone = set(released)
        for peer, streams in list(self._sender_streams.items()):
            streams -= gone
            if not streams:
                del self._sender_streams[peer]

    def admit_group(
        self, source: Source, topic: bytes, peer: str | None, seq: int, batch: ScannedBatch
    ) -> Arrival | None:
        """Consecutive messages of one sender, framed well, read by the receiver's drain
        as one ScannedBatch: one Arrival for them all, or None when they are skipped
        (counted per message, as :meth:`admit` would count each)."""
        identity = source.identities.get(topic)
        if identity is None:
            identity = self._identify(source, topic)
            if len(source.identities) >= _TOPIC_CACHE_SIZE:
                source.identities.clear()
            source.identities[topic] = identity
        count = batch.batches
        if isinstance(identity, str):
            return self._skip(identity, source, "topic %r", topic[:200], count=count)
        pod, model = identity
        target = source.target
        if target is None:
            problem = self._sender_problem(pod, peer)
            if problem is not None:
                return self._skip(
                    problem, source, "topic %r from %s%s", topic[:200], peer,
                    _SETTING_HINTS.get(problem, ""), count=count,
                )  # fmt: skip
        if not self._admit_model(model, target):
            return self._skip_model(source, model, count)
        rank = batch.data_parallel_rank
        if rank is None:
            rank = target.rank if target is not None else 0
        sid = StreamId(pod, rank)
        if target is None and not self._admit_stream(sid, peer or ""):
            return self._skip(
                SENDER_STREAM_CAP,
                source,
                "new stream %s from %s (max_streams_per_sender is %d)",
                sid,
                peer,
                self._config.max_streams_per_sender,
                count=count,
            )
        if target is not None:
            replay = target.replay_endpoint
        elif self._config.replay_port:
            replay = tcp_endpoint(pod_host(pod), self._config.replay_port + rank)
        else:
            replay = None
        if batch.n_events:
            self._layout = batch.layout
        if model in self._sglang_models:
            batch.decode_events_with(self._sglang.events)
        return Arrival(
            sid, model, seq, batch.payloads[-1], self._clock(), replay,
            topic=topic, connected=target is not None,
            decoded=DecodedBatch(batch, batch.layout), batches=count,
        )  # fmt: skip

    def refuse(self, source: Source, reason: str, detail: int) -> None:
        """A message the receiver's drain found badly framed (counted as :meth:`admit`
        counts it)."""
        if reason == "bad_frame_count":
            self._skip(reason, source, "message with %d frames", detail)
        elif reason == "bad_seq_frame":
            self._skip(reason, source, "seq frame of %d bytes", detail)
        else:
            self._skip(
                reason,
                source,
                "payload of %d bytes (max_payload_bytes is %d)",
                detail,
                self._config.max_payload_bytes,
            )

    def admit(self, source: Source, frames: list[bytes], peer: str | None) -> Arrival | None:
        """The message as an Arrival, or None when it is skipped (counted and logged)."""
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
                return self._skip(
                    problem, source, "topic %r from %s%s", topic[:200], peer,
                    _SETTING_HINTS.get(problem, ""),
                )  # fmt: skip
        if not self._admit_model(model, target):
            return self._skip_model(source, model, 1)
        seq = int.from_bytes(seq_frame, "big")
        # The rank routes the payload to its stream. Decoding the whole batch here, once,
        # costs less than skipping over its events to read the rank and decoding them
        # again in the applier (a batch's token ids are most of its bytes). A batch that
        # does not decode whole takes the envelope path, which counts why.
        decoded = self._decode(payload, model)
        try:
            rank = (
                decoded.batch.data_parallel_rank
                if decoded is not None
                else self._envelope.decode(payload).data_parallel_rank
            )
        except msgspec.DecodeError as exc:
            if isinstance(exc, NestedTooDeep):
                reason = exc.reason
            elif isinstance(exc, msgspec.ValidationError):
                reason = "invalid_batch"
            else:
                reason = "malformed_msgpack"
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
        sid = StreamId(pod, rank)
        if target is None and not self._admit_stream(sid, peer or ""):
            return self._skip(
                SENDER_STREAM_CAP,
                source,
                "new stream %s from %s (max_streams_per_sender is %d)",
                sid,
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
            sid, model, seq, payload, self._clock(), replay,
            topic=topic, connected=target is not None, decoded=decoded,
        )  # fmt: skip

    def _decode(self, payload: bytes, model: str) -> DecodedBatch | None:
        """The whole batch, or None when it is not a usable batch with a valid rank.

        The compiled scanner reads the batches vLLM sends (no Python int per hash, token
        ids skipped at memory speed); msgspec decodes whatever it does not take, and
        every batch of a model with SGLang pods (:mod:`kvindex.events.wire.sglang`)."""
        if model in self._sglang_models:
            try:
                decoded = self._sglang.decode(payload, self._layout)
            except DecodeError:
                return None
            rank = decoded.batch.data_parallel_rank
            return None if rank is not None and rank > MAX_DP_RANK else decoded
        scanned = scan(payload)
        if scanned is not None:  # a valid rank, nothing skipped: the scanner checked
            if scanned.n_events:
                self._layout = scanned.layout
            return DecodedBatch(scanned, scanned.layout)
        try:
            decoded = self._batches.decode(payload, self._layout)
        except DecodeError:
            return None
        rank = decoded.batch.data_parallel_rank
        if rank is not None and rank > MAX_DP_RANK:
            return None  # the envelope decoder rejects it, and counts it
        if event_count(decoded.batch):
            self._layout = decoded.layout
        return decoded

    def _sender_problem(self, pod: str, peer: str | None) -> str | None:
        """:func:`~kvindex.events.ingest.admission.sender_problem`, with the parts fixed for a
        pod and sender (its address, the configured roster) remembered; discovery's
        answer can change, so it is not."""
        known = self._known
        if known is not None and pod not in known and pod not in self._configured:
            return UNDISCOVERED_POD
        key = (pod, peer)
        try:
            return self._address_verdicts[key]
        except KeyError:
            pass
        problem = address_problem(pod, peer, self._allowlist)
        if problem is None and known is None:
            problem = roster_problem(pod, None, self._configured, self._allowlist)
        if len(self._address_verdicts) >= _TOPIC_CACHE_SIZE:
            self._address_verdicts.clear()
        self._address_verdicts[key] = problem
        return problem

    def _admit_model(self, model: str, target: PodEndpoint | None) -> bool:
        """Whether ``model`` may be indexed: configured (a connect target's own model
        too), already admitted, or room for one more."""
        if target is not None and model == target.model:
            return True
        return self._models.problem(model) is None

    def _skip_model(self, source: Source, model: str, count: int) -> None:
        return self._skip(
            MODEL_CAP,
            source,
            "model %r is not configured and max_models (%d) others are indexed: raise "
            "--max-models, or name the model in --model-config",
            model[:200],
            self._config.max_models,
            count=count,
        )

    def _admit_stream(self, sid: StreamId, peer: str) -> bool:
        """Whether ``peer`` may send on ``sid``: a stream it opened, or room for one more."""
        streams = self._sender_streams.get(peer)
        if streams is not None and sid in streams:
            return True
        self._take_released()  # a new stream (rare): first drop the streams that left
        streams = self._sender_streams.get(peer)
        if streams is None:
            streams = self._sender_streams[peer] = set()
        if stream_cap_problem(True, len(streams), self._config.max_streams_per_sender):
            return False
        streams.add(sid)
        return True

    def _identify(self, source: Source, topic_bytes: bytes) -> tuple[str, str] | str:
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

    def _skip(
        self, reason: str, source: Source, detail: str, *args: object, count: int = 1
    ) -> None:
        self._errors.add(reason, count)
        self._ratelog.warning(
            reason,
            "KV events: skipped a message from %s (%s): " + detail,
            source.endpoint,
            reason,
            *args,
        )
        return None

"""An engine-side KV-event publisher that behaves like a given vLLM release on the wire.

Tests, the cluster simulator and operators replaying recorded traffic need a stand-in
for a vLLM engine: the same socket rules, framing, sequence numbers, replay service and
payload layout, but driven by hand. :class:`EnginePublisher` is that stand-in. It also
offers what a real engine cannot: a batch that is buffered for replay but never sent (a
PUB drop, to provoke a gap), a restart that resets the seq, raw frames for bad-input
tests, and a wait for subscribers.

Sockets and threads: the PUB side is used only by the calling thread (ZMQ sockets are
single-threaded); the replay ROUTER is served by a background thread; the replay buffer
is shared between them under a lock.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable, Sequence

import zmq

from kvindex.events.ingest.replay_client import END_SEQ
from kvindex.events.wire.endpoints import (
    bind_socket,
    is_bind_endpoint,
    offset_endpoint_port,
    prepare_socket,
)
from kvindex.events.wire.layouts import WireFormat, wire_format
from kvindex.events.wire.vllm import AllBlocksCleared, BlockRemoved, BlockStored

log = logging.getLogger(__name__)

EventLike = BlockStored | BlockRemoved | AllBlocksCleared


class EnginePublisher:
    """A vLLM-compatible PUB (+ replay ROUTER) publisher.

    ``endpoint`` follows vLLM's rule: bind when it contains ``*`` or ``::`` or is
    ipc/inproc, connect otherwise; ``bind`` overrides the rule (tests bind
    ``tcp://127.0.0.1:0`` so nothing listens beyond loopback). Both endpoints are offset
    by ``data_parallel_rank`` exactly as vLLM does. ``vllm_version`` picks the payload
    and replay layout (see :mod:`kvindex.events.wire.layouts`).

    The PUB side is an XPUB socket: identical on the wire, but it sees subscriptions, so
    :meth:`wait_for_subscribers` can replace sleeps (a PUB drops everything published
    before a subscription has arrived - ZMQ's "slow joiner").
    """

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        vllm_version: str = "0.33",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        bind: bool | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.format: WireFormat = wire_format(vllm_version)
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self._topic_bytes = topic.encode("utf-8")
        self._ctx = context if context is not None else zmq.Context.instance()
        self._seq = 0
        self._subscriptions = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._closing = threading.Event()

        endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.setsockopt(zmq.LINGER, 0)
        try:
            if is_bind_endpoint(endpoint) if bind is None else bind:
                self.endpoint = bind_socket(self._pub, endpoint)
            else:
                prepare_socket(self._pub, endpoint)
                self._pub.connect(endpoint)
                self.endpoint = endpoint
        except zmq.ZMQError:
            self._pub.close(linger=0)
            raise

        self.replay_endpoint: str | None = None
        self._router: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            # Room for a whole replay plus its end marker even if the client is slow; a
            # ROUTER silently drops what does not fit.
            router.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            router.setsockopt(zmq.LINGER, 0)
            try:
                self.replay_endpoint = bind_socket(
                    router, offset_endpoint_port(replay_endpoint, data_parallel_rank)
                )
            except zmq.ZMQError:
                router.close(linger=0)
                self._pub.close(linger=0)
                raise
            self._router = router
            # The thread owns the ROUTER from here on (starting it is a memory barrier).
            self._thread = threading.Thread(
                target=self._serve_replay, name="kvindex-publisher-replay", daemon=True
            )
            self._thread.start()

    # -- publishing ---------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The seq the next published batch will get."""
        return self._seq

    def encode(self, events: Iterable[EventLike], ts: float | None = None) -> bytes:
        """The payload this release would send for ``events`` (nothing is published)."""
        rank = self.data_parallel_rank if self.format.batch_has_rank else None
        return self.format.encode_batch(events, time.time() if ts is None else ts, rank)

    def publish(
        self, events: Iterable[EventLike], ts: float | None = None, *, send: bool = True
    ) -> int:
        """Publish one batch; return its seq.

        With ``send=False`` the batch takes a seq and is buffered for replay but never
        leaves the socket: exactly what a subscriber sees when PUB drops a message.
        """
        return self.publish_payload(self.encode(events, ts), send=send)

    def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        """Publish an already encoded payload (possibly a malformed one) under the next seq."""
        seq = self._seq
        self._seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        if send:
            self._pub.send_multipart([self._topic_bytes, seq.to_bytes(8, "big"), payload])
        return seq

    def send_frames(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames as one message; no seq is consumed, nothing is buffered."""
        self._pub.send_multipart(list(frames))

    def restart(self) -> None:
        """Behave like a restarted engine: seq starts again at 0 and the buffer is empty.

        The sockets stay up (a real restart would recreate them; keeping them avoids a
        reconnect that tests would have to wait for).
        """
        with self._lock:
            self._buffer.clear()
        self._seq = 0

    def wait_for_subscribers(self, count: int = 1, timeout_s: float = 5.0) -> bool:
        """Wait until ``count`` subscriptions have arrived in total; False on timeout.

        Call from the publishing thread (the PUB socket is single-threaded).
        """
        deadline = time.monotonic() + timeout_s
        while self._subscriptions < count:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self._pub.poll(remaining_ms, zmq.POLLIN):
                return self._subscriptions >= count
            message = self._pub.recv()
            if message[:1] == b"\x01":
                self._subscriptions += 1
        return True

    # -- replay service -----------------------------------------------------------

    def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        try:
            while not self._closing.is_set():
                if not router.poll(50, zmq.POLLIN):
                    continue
                frames = router.recv_multipart()
                try:
                    self._answer(router, frames)
                except zmq.ZMQError as exc:
                    log.warning("replay reply to a client failed: %s", exc)
        finally:
            router.close(linger=0)

    def _answer(self, router: zmq.Socket, frames: list[bytes]) -> None:
        # A DEALER sends [b"", start]; the ROUTER prepends the client's identity.
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("ignoring malformed replay request with %d frames", len(frames))
            return
        client, _, start_frame = frames
        start = int.from_bytes(start_frame, "big")
        with self._lock:
            wanted = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        with_topic = self.format.replay_has_topic
        for seq, payload in wanted:
            seq_frame = seq.to_bytes(8, "big")
            if with_topic:  # vLLM >= 0.26
                router.send_multipart([client, b"", self._topic_bytes, seq_frame, payload])
            else:  # vLLM <= 0.25
                router.send_multipart([client, b"", seq_frame, payload])
        if with_topic:
            router.send_multipart([client, b"", b"", END_SEQ, b""])
        else:
            router.send_multipart([client, b"", END_SEQ, b""])

    # -- lifecycle ----------------------------------------------------------------

    def close(self, linger_ms: int = 0) -> None:
        """Stop the replay thread and close both sockets.

        ``linger_ms`` > 0 gives queued messages that long to leave before the PUB
        socket is closed. Call from the publishing thread.
        """
        if self._closing.is_set():
            return
        self._closing.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._pub.close(linger=linger_ms)

    def __enter__(self) -> EnginePublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

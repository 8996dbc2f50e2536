"""Replay client: fetch the batches an engine still buffers, from a given seq on.

A vLLM engine started with ``replay_endpoint`` keeps its last ``buffer_steps`` batches
(10,000 by default) and serves them on a ROUTER socket. One request yields a stream of
replies and then an end marker:

* request ``[b"", start_seq (8 bytes, big-endian)]``;
* replies up to vLLM 0.25: ``[b"", seq, payload]``, end ``[b"", ff*8, b""]``;
* replies from vLLM 0.26: ``[b"", topic, seq, payload]``, end ``[b"", b"", ff*8, b""]``.

Both are accepted, so a cluster in the middle of an upgrade replays fine. Every fetch is
bounded by a total timeout and a batch count: an endpoint that never answers (dead pod,
wrong port, firewall) ends in ``timeout``, never in a hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq

from kvindex.events.wire.endpoints import HARD_MESSAGE_CAP, prepare_socket

#: The seq frame of the end-of-replay marker (-1 as a signed 64-bit big-endian int).
END_SEQ = b"\xff" * 8


@dataclass(slots=True)
class ReplayResult:
    """What one replay fetch got.

    ``batches`` are ``(seq, payload)`` in the order the engine sent them. ``complete`` is
    True only when the end marker arrived; ``reason`` is ``"complete"``, ``"timeout"``,
    ``"max_batches"`` or ``"error"`` (with ``detail``). ``bad_replies`` counts replies
    that were not in either layout and were skipped. ``topics`` is parallel to
    ``batches``: each reply's topic frame (vLLM >= 0.26), None in the older layout.
    """

    batches: list[tuple[int, bytes]] = field(default_factory=list)
    topics: list[bytes | None] = field(default_factory=list)
    complete: bool = False
    reason: str = "timeout"
    bad_replies: int = 0
    detail: str = ""


def fetch_replay(
    endpoint: str,
    start_seq: int,
    *,
    timeout_s: float = 2.0,
    max_batches: int = 20_000,
    context: zmq.Context | None = None,
) -> ReplayResult:
    """Ask ``endpoint`` for every buffered batch with seq >= ``start_seq``.

    Safe to call from any thread: the socket is created, used and closed (linger 0)
    inside the call. Never raises for network trouble; the result says what happened.
    """
    if not 0 <= start_seq < 2**63:
        raise ValueError(f"start_seq {start_seq} out of range")
    ctx = context if context is not None else zmq.Context.instance()
    result = ReplayResult()
    deadline = time.monotonic() + timeout_s
    # DEALER, not REQ: a REQ socket enforces one reply per request and would discard
    # every batch after the first. A DEALER receives the whole stream; it just has to add
    # the empty delimiter frame that REQ would have added for the ROUTER.
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_CAP)
        sock.setsockopt(zmq.RCVHWM, max_batches + 16)
        prepare_socket(sock, endpoint)
        sock.connect(endpoint)
        if not _send_request(sock, start_seq, deadline):
            return result
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                return result
            frames = sock.recv_multipart(zmq.NOBLOCK)
            reply = _parse_reply(frames)
            if reply is None:
                result.bad_replies += 1
                continue
            if reply is _END:
                result.complete = True
                result.reason = "complete"
                return result
            seq, payload, topic = reply
            result.batches.append((seq, payload))
            result.topics.append(topic)
            if len(result.batches) >= max_batches:
                result.reason = "max_batches"
                return result
    except zmq.ZMQError as exc:
        result.reason = "error"
        result.detail = f"{endpoint}: {exc}"
        return result
    finally:
        sock.close(linger=0)


def _send_request(sock: zmq.Socket, start_seq: int, deadline: float) -> bool:
    request = [b"", start_seq.to_bytes(8, "big")]
    while True:
        try:
            sock.send_multipart(request, zmq.NOBLOCK)
            return True
        except zmq.Again:
            # No peer yet (connection still being set up): wait for room, bounded.
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return False
            sock.poll(min(remaining_ms, 50), zmq.POLLOUT)


_END = (-1, b"", None)


def _parse_reply(frames: list[bytes]) -> tuple[int, bytes, bytes | None] | None:
    """``(seq, payload, topic)``, the ``_END`` sentinel, or None for a reply in neither
    layout."""
    topic: bytes | None = None
    if len(frames) == 3:  # vLLM <= 0.25
        delimiter, seq_frame, payload = frames
    elif len(frames) == 4:  # vLLM >= 0.26: a topic frame after the delimiter
        delimiter, topic, seq_frame, payload = frames
    else:
        return None
    if delimiter != b"" or len(seq_frame) != 8:
        return None
    if seq_frame == END_SEQ:
        return _END
    return int.from_bytes(seq_frame, "big"), payload, topic

"""Record what an endpoint publishes, and publish a recording again.

Bugs in the field ("our gateway scores 0 for pod X") are easiest to reproduce from the
exact bytes the engines sent. :func:`record` captures every message of a live endpoint
with its receive time; :func:`replay_capture` publishes a capture again with the original
pacing (scaled), so the subscriber and index can be debugged offline.

File format (version 1): a sequence of records, each a 4-byte big-endian length followed
by that many bytes of msgpack. The first record is a header map
``{"format": "kvindex-capture", "version": 1, "endpoint": str, "started_at": float}``;
every further record is ``[recv_time: float, frames: [bytes, ...]]`` - all frames of one
message exactly as received (normally ``[topic, seq, payload]``, but bad messages are
kept as they were). Times are Unix seconds. A truncated last record is ignored.
"""

from __future__ import annotations

import itertools
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec
import zmq

from kvindex.events.wire.endpoints import (
    HARD_MESSAGE_CAP,
    bind_socket,
    is_bind_endpoint,
    prepare_socket,
)
from kvindex.events.wire.publisher import EnginePublisher

FORMAT = "kvindex-capture"
VERSION = 1
_LENGTH = struct.Struct(">I")


class CaptureError(ValueError):
    """A file that is not a kvindex capture (or of an unknown version)."""


class CaptureHeader(msgspec.Struct, frozen=True):
    format: str
    version: int
    endpoint: str
    started_at: float


class CapturedMessage(msgspec.Struct, array_like=True, frozen=True):
    """One recorded message: when it arrived and its frames."""

    recv_time: float
    frames: list[bytes]


def record(
    endpoint: str,
    path: str | Path,
    *,
    max_messages: int | None = None,
    duration_s: float | None = None,
    topic: str = "",
    bind: bool | None = None,
    stop: threading.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
    context: zmq.Context | None = None,
) -> int:
    """Capture what ``endpoint`` publishes into ``path``; return the number of messages.

    The SUB socket connects to ``endpoint``, or binds it when vLLM's engines would be the
    connecting side (``*``, ``::``, ipc, inproc; ``bind`` overrides). Recording ends after
    ``max_messages``, after ``duration_s``, when ``stop`` is set, or on KeyboardInterrupt
    - whichever comes first (with none of them, it runs until interrupted).
    ``on_ready`` is called with the endpoint actually bound/connected once listening.
    """
    ctx = context if context is not None else zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_CAP)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    count = 0
    try:
        if is_bind_endpoint(endpoint) if bind is None else bind:
            actual = bind_socket(sock, endpoint)
        else:
            prepare_socket(sock, endpoint)
            sock.connect(endpoint)
            actual = endpoint
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        deadline = None if duration_s is None else time.monotonic() + duration_s
        encoder = msgspec.msgpack.Encoder()
        with open(path, "wb") as out:
            header = CaptureHeader(FORMAT, VERSION, actual, time.time())
            _write(out, encoder.encode(header))
            out.flush()
            if on_ready is not None:
                on_ready(actual)
            while max_messages is None or count < max_messages:
                if stop is not None and stop.is_set():
                    break
                wait_ms = 100
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wait_ms = max(1, min(wait_ms, int(left * 1000)))
                if not sock.poll(wait_ms, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart()
                _write(out, encoder.encode(CapturedMessage(time.time(), frames)))
                count += 1
    except KeyboardInterrupt:
        pass
    finally:
        sock.close(linger=0)
    return count


def read_capture(path: str | Path) -> tuple[CaptureHeader, Iterator[CapturedMessage]]:
    """The header of a capture and an iterator over its messages (read lazily)."""
    handle = open(path, "rb")  # noqa: SIM115 - closed by the iterator
    try:
        first = _read(handle)
        if first is None:
            if os.fstat(handle.fileno()).st_size == 0:
                raise CaptureError(f"{path} is empty, not a kvindex capture")
            # any file's first 4 bytes read as a length; a non-capture's is rarely whole
            raise CaptureError(f"{path} is not a kvindex capture (no capture header)")
        try:
            header = msgspec.msgpack.decode(first, type=CaptureHeader)
        except msgspec.DecodeError as exc:
            raise CaptureError(f"{path} is not a kvindex capture: {exc}") from None
        if header.format != FORMAT or header.version != VERSION:
            raise CaptureError(
                f"{path}: format {header.format!r} version {header.version} "
                f"(this kvindex reads {FORMAT!r} version {VERSION})"
            )
    except BaseException:
        handle.close()
        raise
    return header, _messages(handle, path)


def replay_capture(
    path: str | Path,
    endpoint: str,
    *,
    speed: float = 1.0,
    bind: bool | None = None,
    wait_for_subscribers: int = 0,
    subscriber_timeout_s: float = 10.0,
    context: zmq.Context | None = None,
) -> int:
    """Publish a capture on ``endpoint`` with its original pacing divided by ``speed``.

    The PUB socket binds or connects by vLLM's rule (``bind`` overrides), so a subscriber
    sees exactly what it saw from the engines. ``speed=float("inf")`` sends as fast as
    possible. With ``wait_for_subscribers`` > 0, nothing is sent until that many
    subscriptions arrived (or ``subscriber_timeout_s`` passed: TimeoutError). Returns
    the number of messages sent.
    """
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    _, messages = read_capture(path)
    publisher = EnginePublisher(endpoint, bind=bind, context=context)
    sent = 0
    try:
        if wait_for_subscribers and not publisher.wait_for_subscribers(
            wait_for_subscribers, subscriber_timeout_s
        ):
            raise TimeoutError(
                f"no {wait_for_subscribers} subscriber(s) on {publisher.endpoint} "
                f"within {subscriber_timeout_s}s"
            )
        start_wall = time.monotonic()
        first_recv: float | None = None
        for message in messages:
            if first_recv is None:
                first_recv = message.recv_time
            delay = (message.recv_time - first_recv) / speed
            wait = start_wall + delay - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            publisher.send_frames(message.frames)
            sent += 1
    finally:
        close = getattr(messages, "close", None)
        if close is not None:
            close()
        # Give queued messages a moment to leave before the socket goes.
        publisher.close(linger_ms=1000)
    return sent


def _write(out: BinaryIO, record: bytes) -> None:
    out.write(_LENGTH.pack(len(record)))
    out.write(record)


def _read(handle: BinaryIO) -> bytes | None:
    prefix = handle.read(_LENGTH.size)
    if len(prefix) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(prefix)
    body = handle.read(length)
    if len(body) < length:
        return None
    return body


def _messages(handle: BinaryIO, path: str | Path) -> Iterator[CapturedMessage]:
    decoder = msgspec.msgpack.Decoder(CapturedMessage)
    with handle:
        for number in itertools.count(1):
            body = _read(handle)
            if body is None:
                return
            try:
                message = decoder.decode(body)
            except msgspec.DecodeError as exc:
                raise CaptureError(f"{path}: message {number} is damaged: {exc}") from None
            yield message

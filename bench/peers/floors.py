"""Floors: what the cheapest conceivable step alone costs, so a figure has a ceiling to read
against (pyzmq receive alone, msgspec decode alone, SHA-256 alone)."""

from __future__ import annotations

import hashlib
import pickle
import threading
import time

import msgspec
import zmq

from .feed import BLOCK


def zmq_receive(payloads: list[bytes], blocks: int, timeout_s: float = 60.0) -> float:
    """Blocks/s a bare SUB socket receives the same messages over loopback TCP."""
    ctx = zmq.Context.instance()
    pub, sub = ctx.socket(zmq.XPUB), ctx.socket(zmq.SUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    if not pub.poll(5000):
        raise SystemExit("floor: SUB never subscribed")
    pub.recv()

    def send() -> None:
        for seq, payload in enumerate(payloads):
            pub.send_multipart((b"kv@x@m", seq.to_bytes(8, "big"), payload))

    thread = threading.Thread(target=send, daemon=True)
    started = time.perf_counter()
    thread.start()
    deadline = time.monotonic() + timeout_s
    for _ in payloads:
        if not sub.poll(max(1, int(1000 * (deadline - time.monotonic())))):
            raise SystemExit("floor: receive timed out")
        sub.recv_multipart(copy=False)
    elapsed = time.perf_counter() - started
    thread.join(10)
    pub.close(0)
    sub.close(0)
    return blocks / elapsed


def msgspec_decode(payloads: list[bytes], blocks: int) -> float:
    """Blocks/s msgspec turns the same payloads into Python objects (no validation)."""
    decode = msgspec.msgpack.Decoder().decode
    started = time.perf_counter()
    for payload in payloads:
        decode(payload)
    return blocks / (time.perf_counter() - started)


def sha256_prompt(prompt: list[int], repeat: int = 20) -> float:
    """Microseconds to SHA-256 a prompt's blocks as vLLM's sha256 hashes them (pickle of
    parent hash, block tokens, extra keys), the pickling done beforehand: hashing alone."""
    parent = b"\0" * 32
    inputs = [
        pickle.dumps((parent, tuple(prompt[i : i + BLOCK]), None), protocol=5)
        for i in range(0, len(prompt) - BLOCK + 1, BLOCK)
    ]
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for data in inputs:
            hashlib.sha256(data).digest()
        best = min(best, time.perf_counter() - started)
    return best * 1e6

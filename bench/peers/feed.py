"""The events both peers ingest: vLLM 0.33 batches from N loopback ZMQ publishers.

Every payload is encoded before a measurement starts (kvindex's own encoder, real vLLM
sha256 block hashes of random prompts, so kvindex's sampled hash check passes and
Dynamo's own token hashes see the same token ids). Each peer gets its own publisher
sockets, so the two are fed the same bytes one after the other and never compete for
the CPU while one is measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import zmq

from kvindex.events.wire.layouts import wire_format
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig

BLOCK = 16
BLOCKS_PER_EVENT = 32
EVENT_TOKENS = BLOCK * BLOCKS_PER_EVENT
MODEL = "bench/model"


def pod_name(i: int) -> str:
    """kvindex's name of publisher i (Dynamo calls it instance i + 1)."""
    return f"127.0.1.{i + 1}:8000"


@dataclass
class Batches:
    """Pre-encoded messages, round-robin over publishers, and each publisher's last prompt."""

    payloads: list[tuple[int, bytes]]  # (publisher, payload)
    last_tokens: dict[int, list[int]]  # publisher -> token ids of its last event
    blocks: int


def fresh_batches(blocks: int, per_message: int, publishers: int, seed: int) -> Batches:
    """``blocks`` never-seen blocks as ``per_message``-event messages (32-block events)."""
    fmt = wire_format("0.33")
    hasher = BlockHasher(HashConfig(block_size=BLOCK), memo_size=0)
    rng = np.random.default_rng(seed)
    messages = max(1, blocks // (BLOCKS_PER_EVENT * per_message))
    payloads: list[tuple[int, bytes]] = []
    last: dict[int, list[int]] = {}
    for m in range(messages):
        events = []
        for tokens in rng.integers(0, 150_000, (per_message, EVENT_TOKENS)).tolist():
            events.append(BlockStored(hasher.keys(tokens), None, tokens, BLOCK))
            last[m % publishers] = tokens
        payloads.append((m % publishers, fmt.encode_batch(events, time.time(), 0)))
    return Batches(payloads, last, messages * per_message * BLOCKS_PER_EVENT)


def prefix_fill(prompt: list[int], publishers: int) -> list[tuple[int, bytes]]:
    """Pod i holds the first 8·(i+1) blocks of ``prompt``: every pod a different match."""
    fmt = wire_format("0.33")
    keys = BlockHasher(HashConfig(block_size=BLOCK)).keys(prompt)
    out = []
    for i in range(publishers):
        n = min(len(keys), 8 * (i + 1))
        event = BlockStored(keys[:n], None, prompt[: n * BLOCK], BLOCK)
        out.append((i, fmt.encode_batch([event], time.time(), 0)))
    return out


class Publishers:
    """N XPUB sockets bound on 127.0.0.1: XPUB tells when the peer's SUB has subscribed."""

    def __init__(self, ctx: zmq.Context, count: int) -> None:
        self.sockets = []
        self.endpoints = []
        self.seq = [0] * count
        for _ in range(count):
            sock = ctx.socket(zmq.XPUB)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop: the peers' queues are what is measured
            sock.setsockopt(zmq.LINGER, 0)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            self.sockets.append(sock)
            self.endpoints.append(f"tcp://127.0.0.1:{port}")

    def wait_subscribed(self, timeout_s: float) -> None:
        """Return once every socket has seen a subscription; SystemExit after the timeout."""
        deadline = time.monotonic() + timeout_s
        for i, sock in enumerate(self.sockets):
            while not sock.poll(50):
                if time.monotonic() > deadline:
                    raise SystemExit(f"publisher {i}: no subscriber after {timeout_s:.0f} s")
            sock.recv()

    def send(self, payloads: list[tuple[int, bytes]]) -> None:
        for i, payload in payloads:
            topic = f"kv@{pod_name(i)}@{MODEL}".encode()
            self.sockets[i].send_multipart((topic, self.seq[i].to_bytes(8, "big"), payload))
            self.seq[i] += 1

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(0)

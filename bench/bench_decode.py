"""Decode throughput of KV-event payloads, in block hashes per second, on one core.

The applier thread decodes every batch it applies, so this is the ceiling of what one
kvindex process can ingest (target: >= 2,000,000 hashes/s). Payloads are realistic:
BlockStored events of 32 blocks of 16 tokens, with token ids, as vLLM sends them,
in the array layout (vLLM <= 0.23) and the map layout (vLLM >= 0.24). Also shown: the
receiver's envelope peek (rank and ts, events skipped) and a decode whose first layout
guess is wrong (what a stream pays once, when its engine is upgraded), and the compiled
scanner (``events/wire/_wire_scan.c``: hashes as one uint64 buffer, token ids skipped),
which is what the receiver runs when it is built. Last, an SGLang 0.5.23 batch (map
events, signed int64 hashes, ``session_id``) through ``events/wire/sglang.py``'s decoder,
which every batch of a model with SGLang pods takes (decode and normalisation to vLLM's
structs; no compiled scanner).

Run: ``python bench/bench_decode.py [--seconds 1.0]``. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import msgspec

from kvindex.events.wire import scanned
from kvindex.events.wire.layouts import wire_format
from kvindex.events.wire.sglang import SglangBatchDecoder
from kvindex.events.wire.vllm import BatchDecoder, BlockStored, EnvelopeDecoder, Layout

BLOCKS_PER_EVENT = 32
BLOCK_SIZE = 16
EVENTS_PER_BATCH = 8


def make_payload(version: str, rng: random.Random) -> bytes:
    events = []
    parent = None
    for _ in range(EVENTS_PER_BATCH):
        hashes = [rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)]
        tokens = [rng.randrange(150_000) for _ in range(BLOCKS_PER_EVENT * BLOCK_SIZE)]
        events.append(BlockStored(hashes, parent, tokens, BLOCK_SIZE, None, "GPU"))
        parent = hashes[-1]
    return wire_format(version).encode_batch(events, time.time(), 0)


def make_sglang_payload(rng: random.Random) -> bytes:
    """SGLang 0.5.23's shape: map events with every field its BlockStored sends."""
    events = []
    parent = None
    for _ in range(EVENTS_PER_BATCH):
        hashes = [rng.getrandbits(64) - 2**63 for _ in range(BLOCKS_PER_EVENT)]
        tokens = [rng.randrange(150_000) for _ in range(BLOCKS_PER_EVENT * BLOCK_SIZE)]
        events.append(
            {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
             "token_ids": tokens, "block_size": BLOCK_SIZE, "lora_id": None,
             "medium": "GPU", "session_id": "session-1"}
        )  # fmt: skip
        parent = hashes[-1]
    return msgspec.msgpack.encode([time.time(), events, 0])


def rate(fn: Callable[[], object], seconds: float) -> float:
    """Calls per second of ``fn`` over about ``seconds``."""
    for _ in range(50):  # warm up
        fn()
    calls = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(100):
            fn()
        calls += 100
        now = time.perf_counter()
        if now >= deadline:
            return calls / (now - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="time per figure")
    args = parser.parse_args()
    rng = random.Random(1)
    hashes_per_batch = BLOCKS_PER_EVENT * EVENTS_PER_BATCH
    print(
        f"msgspec {msgspec.__version__}; {EVENTS_PER_BATCH} BlockStored x {BLOCKS_PER_EVENT} blocks"
    )
    print(f"{'case':<34}{'payload B':>10}{'batches/s':>12}{'hashes/s':>14}")
    envelope = EnvelopeDecoder()
    for label, version, layout in (("array layout (vLLM 0.22)", "0.22", Layout.ARRAY),
                                   ("map layout (vLLM 0.33)", "0.33", Layout.MAP)):  # fmt: skip
        payload = make_payload(version, rng)
        decoder = BatchDecoder()
        other = Layout.MAP if layout is Layout.ARRAY else Layout.ARRAY
        cases = (
            (f"decode, {label}", lambda p=payload, d=decoder, lay=layout: d.decode(p, lay)),
            ("  wrong first guess", lambda p=payload, d=decoder, o=other: d.decode(p, o)),
            ("  envelope peek only", lambda p=payload: envelope.decode(p)),
        )
        if scanned.scanner is not None:  # what the receiver runs when it is built
            cases += (("  compiled scan (_wire_scan.c)", lambda p=payload: scanned.scan(p)),)
        for name, fn in cases:
            per_s = rate(fn, args.seconds)
            print(f"{name:<34}{len(payload):>10}{per_s:>12,.0f}{per_s * hashes_per_batch:>14,.0f}")
    payload = make_sglang_payload(rng)
    sglang = SglangBatchDecoder()
    per_s = rate(lambda: sglang.decode(payload, Layout.MAP), args.seconds)
    name = "decode, SGLang 0.5.23 (sglang.py)"
    print(f"{name:<34}{len(payload):>10}{per_s:>12,.0f}{per_s * hashes_per_batch:>14,.0f}")


if __name__ == "__main__":
    main()

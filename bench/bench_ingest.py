"""End-to-end ingest: frames on a ZMQ socket -> subscriber -> ingestor -> memory index.

A publisher process sends pre-encoded vLLM batches (32-block BlockStored events with
their token ids, ``medium="GPU"`` and ``group_idx=0`` as vLLM 0.33's BlockPool sends
them: real vLLM hashes of random prompts, every block a fresh key, no payload sent
twice) as fast as ZMQ takes them; this
process runs the real Subscriber (receiver + applier threads), Ingestor (with the
sampled hash check) and MemoryBackend, pinned to one core, and measures blocks applied
per second from the first delivery to the last, and per CPU-second this process used
in that interval (the figure a dedicated core would give, on a shared machine where
wall time also counts other work). Prints figures; asserts nothing.

    python bench/bench_ingest.py [--blocks 2000000] [--events-per-batch 1 8]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

import numpy as np

from kvindex.api.testing import free_port
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.wire import scanned
from kvindex.events.wire.layouts import wire_format
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.keys import BlockHasher, HashConfig
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import ModelCatalog
from kvindex.indexer.verify import HashVerifier

BLOCKS_PER_EVENT = 32
BLOCK_SIZE = 16
EVENT_TOKENS = BLOCKS_PER_EVENT * BLOCK_SIZE


def _publish(endpoint: str, batches: int, events_per_batch: int, version: str, ready) -> None:
    """Publisher process: connects to the bound SUB and sends every batch."""
    import zmq

    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) == 1:
        # Inherited the measured process's pinning: move to the other cores.
        others = set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0)
        if others:
            os.sched_setaffinity(0, others)

    fmt = wire_format(version)
    rng = np.random.default_rng(7)
    hasher = BlockHasher(HashConfig(block_size=BLOCK_SIZE), memo_size=0)
    payloads = []
    # Every batch is encoded up front and sent once: every block is a fresh key (real
    # vLLM hashes of random prompts, so the sampled hash check passes), as when engines
    # compute new prompts; the index grows (and rebuilds) as it would.
    for _ in range(batches):
        events = []
        for tokens in rng.integers(0, 150_000, (events_per_batch, EVENT_TOKENS)).tolist():
            keys = hasher.keys(tokens)
            events.append(BlockStored(keys, None, tokens, BLOCK_SIZE, medium="GPU", group_idx=0))
        payloads.append(fmt.encode_batch(events, time.time(), 0))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # XPUB: it hears the subscription, so nothing is sent before
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.connect(endpoint)
    ready.wait(10)
    if not pub.poll(600_000):  # generous: under valgrind the subscriber is slow to start
        raise SystemExit("publisher: the subscriber never subscribed")
    pub.recv()
    topic = b"kv@127.0.0.1:8000@bench"
    for seq, payload in enumerate(payloads):
        pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), copy=False)
    pub.close(linger=-1)
    ctx.term()


class CountingSink:
    """Wraps the ingestor to timestamp the first and last delivery."""

    def __init__(self, inner: Ingestor) -> None:
        self.inner = inner
        self.batches = 0
        self.first = 0.0
        self.last = 0.0
        self.cpu_first = 0.0  # this process's CPU time (all threads), same instants
        self.cpu_last = 0.0

    def deliver(self, deliveries) -> None:
        if not self.batches:
            self.first, self.cpu_first = time.perf_counter(), time.process_time()
        self.inner.deliver(deliveries)
        self.batches += sum(d.batches for d in deliveries)
        self.last, self.cpu_last = time.perf_counter(), time.process_time()

    def reset(self, stream, reason) -> None:
        self.inner.reset(stream, reason)


def run(
    blocks: int,
    events_per_batch: int,
    version: str,
    stream_queue: int = 1_000_000,
    expected_keys: int | None = None,
) -> dict[str, float]:
    batches = blocks // (BLOCKS_PER_EVENT * events_per_batch)
    backend = MemoryBackend(expected_keys=expected_keys)
    catalog = ModelCatalog()
    ingestor = Ingestor(backend, catalog, HashVerifier(catalog.keying, catalog.hasher))
    sink = CountingSink(ingestor)
    subscriber = Subscriber(
        sink, SubscriberConfig(queue_capacity=stream_queue, catch_up_on_first_contact=False)
    )
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    subscriber.bind(endpoint)
    subscriber.start()
    ready = multiprocessing.Event()
    proc = multiprocessing.Process(
        target=_publish, args=(endpoint, batches, events_per_batch, version, ready)
    )
    proc.start()
    ready.set()
    deadline = time.monotonic() + 600  # includes the publisher hashing every batch
    seen, quiet_until = 0, deadline
    while sink.batches < batches and time.monotonic() < min(quiet_until, deadline):
        time.sleep(0.05)
        if sink.batches != seen:
            seen, quiet_until = sink.batches, deadline
        elif not proc.is_alive() and subscriber.error_counts().get("queue_overflow"):
            # A full queue dropped batches: they never arrive. Take what is still
            # queued, until nothing more comes for 10 s.
            quiet_until = min(quiet_until, time.monotonic() + 10.0)
    proc.join(30)
    subscriber.stop()
    elapsed = max(sink.last - sink.first, 1e-9)
    cpu = max(sink.cpu_last - sink.cpu_first, 1e-9)
    # The first batch's blocks are not inside the measured interval.
    applied = (sink.batches - 1) * events_per_batch * BLOCKS_PER_EVENT
    stats = backend.stats()
    return {
        "batches": sink.batches,
        "expected": batches,
        "blocks_per_s": applied / elapsed,
        "blocks_per_cpu_s": applied / cpu,
        "seconds": elapsed,
        "overflows": subscriber.error_counts().get("queue_overflow", 0),
        "index_keys": stats.keys,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=2_000_000)
    parser.add_argument("--events-per-batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--vllm-version", default="0.33")
    parser.add_argument("--cpu", type=int, default=0, help="core to pin this process to (-1: none)")
    parser.add_argument(
        "--stream-queue",
        type=int,
        default=1_000_000,
        help="the subscriber's queue per stream (the service's --stream-queue); the "
        "default holds every batch, a smaller one shows what a burst overflows",
    )
    parser.add_argument(
        "--presize",
        action="store_true",
        help="size the index for --blocks keys up front (MemoryBackend expected_keys), "
        "so it does not grow from empty",
    )
    args = parser.parse_args()
    if args.cpu >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})
    print(
        f"end-to-end ingest, {BLOCKS_PER_EVENT}-block BlockStored events with token ids, "
        f"vLLM {args.vllm_version} layout, subscriber pinned to core {args.cpu}, "
        f"payloads read by {scanned.implementation()}"
    )
    for per_batch in args.events_per_batch:
        presize = args.blocks if args.presize else None
        r = run(args.blocks, per_batch, args.vllm_version, args.stream_queue, presize)
        print(
            f"  {per_batch} event(s)/batch: {r['blocks_per_s']:>12,.0f} blocks/s "
            f"({r['blocks_per_cpu_s']:,.0f} per CPU-second of this process)  "
            f"({r['batches']:,}/{r['expected']:,} batches in {r['seconds']:.2f} s, "
            f"{r['overflows']} queue overflows, {r['index_keys']:,} keys in index)"
        )


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    main()

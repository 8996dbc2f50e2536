"""Recovery after ``kill -9`` with a memory-backend snapshot.

Two parts, both printed, nothing asserted:

1. **In process**: a MemoryBackend holding ``--entries`` (block, pod) entries spread
   over ``--pods`` pods: how long a consistent cut takes (the index's arrays copied
   while ingest pauses), writing the file, and reading + installing it.
2. **End to end**: a real ``kvindex serve --snapshot`` fed over ZMQ by ``--pods``
   engines (connect mode, each with its replay buffer) until it holds the entries and
   has written a snapshot; then ``SIGKILL``; each engine publishes ``--tail`` more
   batches while kvindex is down (only its replay buffer has them); then kvindex starts
   again. Measured from the restart: until ``/readyz`` (process start + restore), and
   until every stream is ``live`` with the engine's block count (the tail replayed).

    python bench/bench_snapshot.py [--entries 2000000] [--pods 8] [--tail 500]
"""

from __future__ import annotations

import argparse
import random
import signal
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from kvindex.api.testing import ServeProcess, free_port
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.snapshot import SnapshotGate, Snapshotter
from kvindex.indexer.models import ModelCatalog

MODEL = "bench/model"
EVENTS_PER_BATCH = 8
BLOCKS_PER_EVENT = 32


def in_process(entries: int, pods: int, directory: Path) -> None:
    backend = MemoryBackend()
    rng = np.random.default_rng(1)
    per_pod = entries // pods
    shared = rng.integers(1, 2**64 - 1, per_pod // 4, dtype=np.uint64)  # a common prefix set
    for p in range(pods):
        own = rng.integers(1, 2**64 - 1, per_pod - shared.size, dtype=np.uint64)
        keys = np.concatenate((shared, own))
        backend.apply([Change(Op.STORE, f"127.10.0.{p}:8000", MODEL, Tier.GPU, keys)])
    stats = backend.stats()
    gate = SnapshotGate()
    path = directory / "inproc.snap"
    snapshotter = Snapshotter(path, 0, backend, Ingestor(backend, ModelCatalog()), gate)
    started = time.perf_counter()
    cut = gate.cut(backend.to_state)
    cut_s = time.perf_counter() - started
    del cut
    started = time.perf_counter()
    snapshotter.write()
    write_s = time.perf_counter() - started
    fresh = MemoryBackend()
    restorer = Snapshotter(path, 0, fresh, Ingestor(fresh, ModelCatalog()), SnapshotGate())
    started = time.perf_counter()
    restorer.restore()
    restore_s = time.perf_counter() - started
    print(
        f"in process: {sum(stats.blocks.values()):,} entries ({stats.keys:,} keys, {pods} pods), "
        f"file {path.stat().st_size / 2**20:.0f} MiB"
    )
    print(f"  cut (ingest paused)  {cut_s * 1000:8.0f} ms")
    print(f"  cut + write + fsync  {write_s * 1000:8.0f} ms")
    print(f"  read + restore       {restore_s * 1000:8.0f} ms")


class Engine:
    def __init__(self, host: str, replay_port: int, seed: int) -> None:
        self.pod = f"{host}:8000"
        self.pub = EnginePublisher(
            f"tcp://{host}:{free_port()}", replay_endpoint=f"tcp://{host}:{replay_port}", bind=True
        )
        self.rng = random.Random(seed)
        self.held = 0

    def batch(self) -> None:
        events = []
        for _ in range(EVENTS_PER_BATCH):
            keys = [self.rng.getrandbits(64) for _ in range(BLOCKS_PER_EVENT)]
            events.append(BlockStored(keys, None, [], 16))
        self.held += EVENTS_PER_BATCH * BLOCKS_PER_EVENT
        self.pub.publish(events)


def _counts(url: str) -> dict[str, tuple[str | None, int]]:
    pods = httpx.get(f"{url}/index/pods", timeout=30).json()["pods"]
    return {p["pod"]: (p["stream_state"], p["blocks"]["gpu"]) for p in pods}


def _wait(check, timeout_s: float, what: str) -> float:
    started = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)
    return time.perf_counter() - started


def end_to_end(entries: int, pods: int, tail: int, directory: Path) -> None:
    replay_port = free_port()
    engines = [Engine(f"127.0.0.{51 + i}", replay_port, i) for i in range(pods)]
    path = directory / "serve.snap"
    flags = ["--snapshot", str(path), "--snapshot-interval", "2", "--replay-port", str(replay_port)]
    for e in engines:
        flags += ["--zmq-connect", f"{e.pod}@{MODEL}={e.pub.endpoint}"]
    baseline = ServeProcess(log_path=directory / "serve-0.log")  # what starting alone costs
    started = time.perf_counter()
    baseline.wait_ready(600)
    empty_ready_s = time.perf_counter() - started
    baseline.stop()
    server = ServeProcess(*flags, log_path=directory / "serve-1.log")
    try:
        server.wait_ready(60)
        for e in engines:
            e.pub.wait_for_subscribers(1, 10)
        per_batch = EVENTS_PER_BATCH * BLOCKS_PER_EVENT
        for _ in range(max(1, entries // pods // per_batch)):
            for e in engines:
                e.batch()
            time.sleep(0.0005 * pods)  # keep within the subscriber's queues
        want = {e.pod: ("live", e.held) for e in engines}
        _wait(lambda: _counts(server.url) == want, 600, "the first ingest")
        before = sum(e.held for e in engines)
        written = path.stat().st_mtime if path.exists() else 0.0
        _wait(lambda: path.exists() and path.stat().st_mtime > written + 0.001, 60, "a snapshot")
        server.stop(signal.SIGKILL)
        for _ in range(tail):
            for e in engines:
                e.batch()
        started = time.perf_counter()
        server = ServeProcess(*flags, log_path=directory / "serve-2.log")
        server.wait_ready(600)
        ready_s = time.perf_counter() - started
        for e in engines:
            e.pub.wait_for_subscribers(2, 10)
            e.batch()  # the first live batch: the stream is heard and resumed
        want = {e.pod: ("live", e.held) for e in engines}
        _wait(lambda: _counts(server.url) == want, 600, "every stream live and complete")
        live_s = time.perf_counter() - started
        metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
        restore_s = next(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("kvindex_snapshot_restore_seconds")
        )
        print(
            f"kill -9 and restart: {before:,} entries over {pods} pods when killed, then "
            f"{tail} batches per pod ({tail * EVENTS_PER_BATCH * BLOCKS_PER_EVENT * pods:,} "
            f"blocks) published while down; snapshot {path.stat().st_size / 2**20:.0f} MiB"
        )
        print(f"  restore (read + install)              {restore_s:6.2f} s")
        print(f"  restart -> /readyz                    {ready_s:6.2f} s")
        print(f"  restart -> every stream live, exact   {live_s:6.2f} s")
        print(f"  (an empty kvindex serve -> /readyz    {empty_ready_s:6.2f} s)")
    finally:
        server.stop(signal.SIGKILL)
        for e in engines:
            e.pub.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=2_000_000)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--tail", type=int, default=500)
    parser.add_argument("--in-process-entries", type=int, default=10_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvindex-bench-snapshot-") as tmp:
        in_process(args.in_process_entries, args.pods, Path(tmp))
        end_to_end(args.entries, args.pods, args.tail, Path(tmp))


if __name__ == "__main__":
    main()

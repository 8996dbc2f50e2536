"""A new memory replica copying a live peer's index (``kvindex serve --peers``).

A real ``kvindex serve`` peer fed over ZMQ by ``--pods`` engines (connect mode, each
with its replay buffer) until it holds ``--entries`` entries; each engine then
publishes ``--tail`` more batches (the peer applies them; the copy has them only by
replay from its positions if they came after the dump); then a second replica starts
with ``--peers`` pointing at the first. Printed, nothing asserted: the dump's size, the
copy's fetch + install time (``kvindex_peer_recovery_seconds``), start to ``/readyz``,
start to every stream live with the engine's block count, and both processes' resident
memory.

    python bench/bench_peer_copy.py [--entries 1000000] [--pods 8] [--tail 200]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

import httpx

from kvindex.api.testing import ServeProcess, free_port

try:  # run as a script: bench/ is sys.path[0]
    from bench_snapshot import BLOCKS_PER_EVENT, EVENTS_PER_BATCH, MODEL, Engine, _counts, _wait
except ModuleNotFoundError:
    from bench.bench_snapshot import (
        BLOCKS_PER_EVENT,
        EVENTS_PER_BATCH,
        MODEL,
        Engine,
        _counts,
        _wait,
    )

TOKEN = "bench"


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def run(entries: int, pods: int, tail: int, directory: Path) -> None:
    replay_port = free_port()
    engines = [Engine(f"127.0.0.{61 + i}", replay_port, i) for i in range(pods)]
    flags = ["--replay-port", str(replay_port)]
    for e in engines:
        flags += ["--zmq-connect", f"{e.pod}@{MODEL}={e.pub.endpoint}"]
    env = {**os.environ, "KVINDEX_ADMIN_TOKEN": TOKEN}
    nobody = f"http://127.0.0.1:{free_port()}"
    peer = ServeProcess(*flags, "--peers", nobody, env=env, log_path=directory / "peer.log")
    fresh: ServeProcess | None = None
    try:
        peer.wait_ready(120)
        for e in engines:
            e.pub.wait_for_subscribers(1, 10)
        per_batch = EVENTS_PER_BATCH * BLOCKS_PER_EVENT
        for _ in range(max(1, entries // pods // per_batch)):
            for e in engines:
                e.batch()
            time.sleep(0.0005 * pods)  # keep within the subscriber's queues
        want = {e.pod: ("live", e.held) for e in engines}
        _wait(lambda: _counts(peer.url) == want, 600, "the peer's ingest")
        held = sum(e.held for e in engines)
        for _ in range(tail):
            for e in engines:
                e.batch()
        started = time.perf_counter()
        fresh = ServeProcess(*flags, "--peers", peer.url, env=env, log_path=directory / "new.log")
        fresh.wait_ready(600)
        ready_s = time.perf_counter() - started
        for e in engines:
            e.pub.wait_for_subscribers(2, 10)
            e.batch()  # the first live batch: the stream is heard and resumed
        want = {e.pod: ("live", e.held) for e in engines}
        _wait(lambda: _counts(fresh.url) == want, 600, "every stream live and complete")
        live_s = time.perf_counter() - started
        copy_s = _metric(fresh.url, "kvindex_peer_recovery_seconds")
        size = _metric(fresh.url, "kvindex_peer_recovery_bytes")
        rss = {
            name: _metric(server.url, "process_resident_memory_bytes") / 2**20
            for name, server in (("peer", peer), ("new", fresh))
        }
        print(
            f"peer copy: {held:,} entries over {pods} pods in the peer, then {tail} batches "
            f"per pod ({tail * per_batch * pods:,} blocks) more; dump {size / 2**20:.0f} MiB"
        )
        print(f"  fetch + install the dump             {copy_s:6.2f} s")
        print(f"  start -> /readyz                     {ready_s:6.2f} s")
        print(f"  start -> every stream live, exact    {live_s:6.2f} s")
        print(f"  resident memory: peer {rss['peer']:.0f} MiB, new replica {rss['new']:.0f} MiB")
    finally:
        for server in (peer, fresh):
            if server is not None:
                server.stop(signal.SIGKILL)
        for e in engines:
            e.pub.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--tail", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvindex-bench-peer-") as tmp:
        run(args.entries, args.pods, args.tail, Path(tmp))


if __name__ == "__main__":
    main()

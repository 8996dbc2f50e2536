"""What a thread hop costs /score over the memory backend (api/http/offload.py). Prints figures.

    python bench/bench_offload.py            # about ten seconds
    python bench/bench_offload.py --quick

The index work of one /score (``Scorer.score_keys``: a 512-block chain across 64 pods,
the bench_index profile) run through :class:`kvindex.api.http.offload.IndexWork` from an
asyncio loop, inline (as the memory backend does) and on its 8 threads (as the Redis
backend does), side by side in interleaved rounds: one caller (latency) and 16
concurrent callers (throughput). The memory backend's lookup holds the GIL, so threads
can only add the hop; this measures how much, to justify running it inline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import numpy as np

from kvindex.api.http.offload import IndexWork
from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import ModelCatalog
from kvindex.scoring.scorer import Scorer

MODEL = "bench-model"
CHAIN, PODS, CALLERS, ROUNDS = 512, 64, 16, 5


def populated() -> tuple[Scorer, list[int]]:
    rng = np.random.default_rng(7)
    chain = rng.integers(0, 2**63, CHAIN, dtype=np.uint64).tolist()
    backend = MemoryBackend()
    for i in range(PODS):
        held = int(rng.integers(1, CHAIN + 1))
        backend.apply([Change(Op.STORE, f"127.10.0.{i + 1}:8000", MODEL, Tier.GPU, chain[:held])])
    return Scorer(backend, ModelCatalog()), chain


async def one_caller(work: IndexWork, scorer: Scorer, chain: list[int], n: int) -> float:
    """Median µs per call, one caller."""
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await work.run(scorer.score_keys, MODEL, chain)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


async def many_callers(work: IndexWork, scorer: Scorer, chain: list[int], n: int) -> float:
    """Calls per second, ``CALLERS`` at once."""
    left = iter(range(n))

    async def caller() -> None:
        for _ in left:
            await work.run(scorer.score_keys, MODEL, chain)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    return n / (time.perf_counter() - t0)


async def run(n: int) -> dict[str, tuple[list[float], list[float]]]:
    scorer, chain = populated()
    ways = {
        "inline (memory backend)": IndexWork(inline=True, deadline_s=5, max_in_flight=64),
        "8 threads (Redis backend)": IndexWork(inline=False, deadline_s=5, max_in_flight=64),
    }
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in ways}
    try:
        for work in ways.values():  # warm up: memo, threads
            await many_callers(work, scorer, chain, 200)
        for _ in range(ROUNDS):
            for name, work in ways.items():
                out[name][0].append(await one_caller(work, scorer, chain, n // ROUNDS))
                out[name][1].append(await many_callers(work, scorer, chain, n // ROUNDS))
    finally:
        for work in ways.values():
            work.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    n = 1000 if args.quick else args.calls
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"Scorer.score_keys over the memory backend ({CHAIN}-block chain, {PODS} pods) "
        f"through IndexWork, {n} calls each way in {ROUNDS} interleaved rounds; "
        f"load average {load} on {os.cpu_count()} CPUs"
    )
    for name, (latency, rate) in asyncio.run(run(n)).items():
        print(
            f"  {name:<26} 1 caller p50 {statistics.median(latency):7.1f} µs   "
            f"{CALLERS} callers {statistics.median(rate):8,.0f} calls/s"
        )


if __name__ == "__main__":
    main()

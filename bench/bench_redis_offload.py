"""How a Redis lookup waits off the event loop (bench_redis.py's "off the event loop" half).

Two figures, 16 concurrent callers on one asyncio loop, the ways interleaved round by
round so a change in the machine's load hits each alike:

* **hop**: the CPU one call costs the process (``time.process_time``, every thread) for
  work that does nothing: the price of leaving the loop and coming back. IndexWork
  (api/http/offload.py: a SimpleQueue and ``call_soon_threadsafe``) against what it replaced,
  a ``ThreadPoolExecutor`` awaited through ``asyncio.wrap_future``;
* **lookups**: the 512-block lookup itself, inline on the loop (what a hung Redis would
  stall), through IndexWork, and through the executor: lookups/s and CPU per lookup.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from kvindex.api.http.offload import THREADS, IndexWork
from kvindex.indexer.backend import MemberMatch
from kvindex.indexer.redis.backend import RedisBackend

CALLERS, ROUNDS = 16, 5
MODEL = "bench/model"

Way = Callable[[], Awaitable[object]]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


async def _drive(call: Way, n: int) -> tuple[float, float]:
    """``n`` calls from CALLERS concurrent callers: calls/s and CPU µs per call."""
    left = iter(range(n))

    async def caller() -> None:
        for _ in left:
            await call()

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(CALLERS)))
    return n / (time.perf_counter() - t0), (time.process_time() - cpu0) / n * 1e6


async def _compare(ways: dict[str, Way], n: int) -> dict[str, list[tuple[float, float]]]:
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for call in ways.values():
        await _drive(call, min(n, 200))  # warm up: threads started, connections made
    for _ in range(ROUNDS):
        for name, call in ways.items():
            got[name].append(await _drive(call, n // ROUNDS))
    return got


def _print(rows: dict[str, list[tuple[float, float]]], unit: str) -> None:
    for name, rounds in rows.items():
        rate = statistics.median(r for r, _ in rounds)
        cpu = statistics.median(c for _, c in rounds)
        print(
            f"  {name:<34} {cpu:7.1f} µs CPU per {unit} {rate:9,.0f} {unit}s/s "
            f"(CPU by round: {', '.join(f'{c:.0f}' for _, c in rounds)})"
        )


def _ways(work: Callable[[], object]) -> tuple[dict[str, Way], Callable[[], None]]:
    """The same ``work`` through IndexWork and through an executor of as many threads."""
    index_work = IndexWork(inline=False, deadline_s=10, max_in_flight=64)
    pool = ThreadPoolExecutor(THREADS)

    async def through_index_work() -> object:
        return await index_work.run(work)

    async def through_executor() -> object:
        return await asyncio.wrap_future(pool.submit(work))

    def close() -> None:
        index_work.close()
        pool.shutdown()

    ways = {
        f"IndexWork, {THREADS} threads": through_index_work,
        f"ThreadPoolExecutor, {THREADS} threads": through_executor,
    }
    return ways, close


def bench_off_loop(backend: RedisBackend, chain: list[int], lookups: int) -> None:
    expected = backend.lookup(MODEL, chain)

    def lookup() -> list[MemberMatch]:
        return backend.lookup(MODEL, chain)

    async def run() -> None:
        print(
            f"off the event loop: {CALLERS} concurrent callers on one asyncio loop, "
            f"{ROUNDS} interleaved rounds (medians); load average {load_average()}"
        )
        ways, close = _ways(lambda: None)
        try:
            print(f"  hop, work that does nothing ({lookups * 5:,} calls each way):")
            _print(await _compare(ways, lookups * 5), "call")
        finally:
            close()
        ways, close = _ways(lookup)

        async def inline() -> object:
            return lookup()

        ways = {"inline on the loop": inline, **ways}
        try:
            for call in ways.values():
                assert await call() == expected, "a lookup answered differently"
            print(f"  the 512-block lookup ({lookups:,} each way):")
            _print(await _compare(ways, lookups), "lookup")
        finally:
            close()
        print(f"  load average after: {load_average()}")

    asyncio.run(run())

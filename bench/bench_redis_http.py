"""/score over HTTP with the Redis backend, and issue 13's Redis target (bench_redis.py's
HTTP half: a ``kvindex serve --backend redis://...`` subprocess and a load generator in
a process of its own).

Beside the rates it prints what one request costs each side, so kvindex's own CPU and
Redis's can be told apart: the replica's CPU per request (``/proc/<pid>/stat``), and
Redis's per lookup: its busy time in the lookup transactions (``INFO commandstats``,
``MULTI`` + ``EXEC``) and its whole process CPU (``INFO cpu``), the latter including
reading and writing the sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import redis

from kvindex.api.testing import ServeProcess
from kvindex.indexer.keys import BlockHasher, HashConfig
from kvindex.indexer.redis.connection import RedisOptions

MODEL = "bench/model"
PROMPT_TOKENS = 8192
TARGET_CLIENTS, TARGET_RPS, TARGET_P50_MS = 16, 2_000, 2.0  # issue 13, Redis backend


def percentiles(samples_s: list[float]) -> str:
    ordered = sorted(samples_s)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return (
        f"p50 {at(0.5):6.3f} ms   p99 {at(0.99):6.3f} ms   "
        f"mean {statistics.fmean(ordered) * 1000:6.3f} ms"
    )


def timed(call: Callable[[], object], n: int) -> list[float]:
    for _ in range(min(20, n)):
        call()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def redis_cpu_s(client: redis.Redis) -> float:
    """Redis's process CPU so far (user + system), seconds."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def redis_busy_us(client: redis.Redis) -> float:
    """Redis's time inside commands since the last CONFIG RESETSTAT, µs: top-level
    commands only (the commands a transaction or a script ran are inside its time)."""
    stats = client.info("commandstats")
    outer = {"cmdstat_multi", "cmdstat_exec", "cmdstat_evalsha", "cmdstat_eval"}
    if not outer & stats.keys():
        outer = set(stats) - {"cmdstat_config|resetstat", "cmdstat_info", "cmdstat_config"}
    return sum(v["usec"] for k, v in stats.items() if k in outer)


def process_cpu_s(pid: int) -> float:
    """A process's CPU so far (user + system), seconds, from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


# -- /score over HTTP ---------------------------------------------------------------------------


def bench_http(args: argparse.Namespace, url: str, prefix: str, tokens: list[int]) -> None:
    server = ServeProcess(
        "--backend", url, "--redis-prefix", prefix, "--log-level", "warning"
    )  # fmt: skip
    try:
        server.wait_ready()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        bodies = {
            "same prompt each time": [json.dumps({"model": MODEL, "token_ids": tokens}).encode()],
            "fresh second half each time": [
                json.dumps(
                    {"model": MODEL, "token_ids": tokens[: PROMPT_TOKENS // 2] + fresh}
                ).encode()
                for fresh in (
                    [int(t) for t in np.random.default_rng(i).integers(0, 150_000, 4096)]
                    for i in range(64)
                )
            ],
        }
        print(
            f"/score over HTTP: {PROMPT_TOKENS}-token prompt (token_ids), 64 pods, "
            f"one client, sequential keep-alive requests, kvindex serve --backend {url}"
        )
        for name, payloads in bodies.items():
            i = 0
            refused: dict[str, int] = {}

            def call(payloads: list[bytes] = payloads, refused: dict[str, int] = refused) -> None:
                nonlocal i
                body = payloads[i % len(payloads)]
                i += 1
                conn.request("POST", "/score", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                data = response.read()
                if response.status != 200:  # counted (e.g. 503 past --backend-deadline)
                    code = json.loads(data).get("error", str(response.status))
                    refused[code] = refused.get(code, 0) + 1

            before = _score_seconds(conn)
            samples = timed(call, args.requests)
            inside = (_score_seconds(conn) - before) / (args.requests + 20) * 1000
            print(f"  {name:<30} {percentiles(samples)}   in handler {inside:5.3f} ms")
            if refused:
                print(f"  {'':<30} answers other than 200: {refused}")
    finally:
        server.stop()


def _score_seconds(conn: http.client.HTTPConnection) -> float:
    """Total time the server spent answering /score (its kvindex_score_seconds_sum)."""
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    for line in text.splitlines():
        if line.startswith("kvindex_score_seconds_sum"):
            return float(line.split()[-1])
    return 0.0


def bench_target(args: argparse.Namespace, url: str, prefix: str, tokens: list[int]) -> bool:
    """Issue 13's Redis figure: /score req/s with 16 clients, p50 with one; PASS/FAIL."""
    keys = BlockHasher(HashConfig()).keys(tokens)
    bodies = {
        "token_ids": json.dumps({"model": MODEL, "token_ids": tokens}).encode(),
        "block_hashes": json.dumps({"model": MODEL, "block_hashes": keys}).encode(),
    }
    server = ServeProcess(
        "--backend", url, "--redis-prefix", prefix, "--model", MODEL, "--log-level", "warning"
    )  # fmt: skip
    redis_client = redis.Redis.from_url(RedisOptions.from_url(url).url)
    passed = True
    try:
        server.wait_ready()
        print(
            f"/score with the Redis backend (issue 13 target: >= {TARGET_RPS:,} req/s with "
            f"{TARGET_CLIENTS} clients, p50 <= {TARGET_P50_MS} ms with one); load "
            f"generator in its own process; load average before: {load_average()}"
        )
        for name, body in bodies.items():
            _measure(server.port, body, 1, count=100)  # warm up
            one = _measure(server.port, body, 1, count=args.requests)
            redis_client.config_resetstat()
            cpu0, kv0 = redis_cpu_s(redis_client), process_cpu_s(server.process.pid)
            many = _measure(server.port, body, TARGET_CLIENTS, seconds=args.seconds)
            served = max(1, many["served"])
            redis_ms = (redis_cpu_s(redis_client) - cpu0) * 1000 / served
            kv_ms = (process_cpu_s(server.process.pid) - kv0) * 1000 / served
            busy_ms = redis_busy_us(redis_client) / 1000 / served
            refused = {**one["refused"], **many["refused"]}
            ok_rps = many["rps"] >= TARGET_RPS and not refused
            ok_p50 = one["p50_ms"] <= TARGET_P50_MS and not refused
            passed = passed and ok_rps and ok_p50
            print(
                f"  {name:<13} {TARGET_CLIENTS} clients {many['rps']:7,.0f} req/s "
                f"(p50 {many['p50_ms']:6.2f} ms) {'PASS' if ok_rps else 'FAIL'};   1 client "
                f"p50 {one['p50_ms']:6.3f} ms p99 {one['p99_ms']:6.3f} ms "
                f"{'PASS' if ok_p50 else 'FAIL'}"
            )
            if refused:
                print(f"  {'':<13} answers other than 200: {refused}")
            print(
                f"  {'':<13} per request under load: kvindex CPU {kv_ms:.3f} ms; Redis busy "
                f"{busy_ms:.3f} ms, Redis CPU {redis_ms:.3f} ms (its one thread alone caps "
                f"a Redis at ~{1000 / redis_ms if redis_ms else 0:,.0f} lookups/s)"
            )
        print(f"  load average after: {load_average()}")
    finally:
        server.stop()
        redis_client.close()
    return passed


def _measure(port: int, body: bytes, clients: int, *, count: int = 0, seconds: float = 0) -> dict:
    """Latency and rate of POST /score from a load generator in its own process (so it
    costs kvindex's process nothing), ``clients`` keep-alive connections, ``count``
    requests or ``seconds``; answers other than 200 are counted by their error code."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_load, args=(port, body, clients, count, seconds, queue))
    child.start()
    try:
        latencies, elapsed, refused = queue.get(timeout=max(60.0, seconds * 3))
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    latencies.sort()
    n = max(1, len(latencies))
    return {
        "served": len(latencies),
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[n // 2] if latencies else float("inf"),
        "p99_ms": 1000 * latencies[min(n - 1, int(n * 0.99))] if latencies else float("inf"),
        "refused": refused,
    }


def _load(port: int, body: bytes, clients: int, count: int, seconds: float, out) -> None:
    latencies: list[float] = []
    refused: dict[str, int] = {}
    head = (
        "POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body

    async def client(stop_at: float, todo: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while (todo and len(latencies) + sum(refused.values()) < todo) or (
                not todo and time.perf_counter() < stop_at
            ):
                t0 = time.perf_counter()
                writer.write(head)
                headers = await reader.readuntil(b"\r\n\r\n")
                length = int(headers.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                answer = await reader.readexactly(length)
                if headers.startswith(b"HTTP/1.1 200"):
                    latencies.append(time.perf_counter() - t0)
                else:
                    code = json.loads(answer).get("error", headers[9:12].decode())
                    refused[code] = refused.get(code, 0) + 1
        finally:
            writer.close()

    async def run() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(t0 + seconds, count) for _ in range(clients)))
        return time.perf_counter() - t0

    elapsed = asyncio.run(run())
    out.put((latencies, elapsed, refused))

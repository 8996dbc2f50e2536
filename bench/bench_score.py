"""/score over HTTP: an 8,192-token prompt (token_ids) across 64 pods with overlapping prefixes.

Starts a real ``kvindex serve`` (memory backend by default, or ``--backend redis://...``),
fills it over ZMQ from 64 engine publishers (pod i holds the first 8·(i+1) blocks of the
shared 512-block prompt, so every pod matches a different prefix length), then measures:

* one client, sequential requests: p50 / p99 latency;
* 16 concurrent clients (keep-alive connections): requests/s and p50 / p99.

Each is run with the same prompt repeated (the block-hash memo is warm: a gateway
re-scoring a conversation) and with a fresh prompt per request sharing the first
half (only the new half is hashed). The load generator is a separate process with a
minimal asyncio HTTP/1.1 client so it costs the server as little CPU as possible on a
2-core machine. Prints figures; asserts nothing.

    python bench/bench_score.py [--requests 2000] [--seconds 10] [--backend memory]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import time
import urllib.request

from kvindex.api.testing import ServeProcess, free_port

BLOCK = 16
PROMPT_TOKENS = 8192
PODS = 64
MODEL = "bench/model"


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _fill(zmq_endpoint: str, url: str, prompt: list[int]) -> None:
    from kvindex.events.endpoints import from_source
    from kvindex.events.publisher import EnginePublisher
    from kvindex.events.wire import BlockStored
    from kvindex.indexer.keys import BlockHasher, HashConfig

    keys = BlockHasher(HashConfig(block_size=BLOCK)).keys(prompt)
    publishers = []
    for i in range(PODS):
        host = f"127.0.{1 + i // 250}.{1 + i % 250}"
        pod = f"{host}:8000"
        # Each pod sends from its own loopback address: bind mode checks the sender.
        source = from_source(zmq_endpoint, host)
        pub = EnginePublisher(source, topic=f"kv@{pod}@{MODEL}", bind=False)
        if not pub.wait_for_subscribers(1, 10.0):
            raise SystemExit("publisher could not reach kvindex")
        n = min(len(keys), 8 * (i + 1))
        pub.publish([BlockStored(keys[:n], None, prompt[: n * BLOCK], BLOCK)])
        publishers.append(pub)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pods = _get(f"{url}/index/pods")["pods"]
        if sum(p["blocks"]["gpu"] for p in pods) == sum(min(512, 8 * (i + 1)) for i in range(PODS)):
            break
        time.sleep(0.1)
    else:
        raise SystemExit("index did not fill")
    for pub in publishers:
        pub.close()


async def _client(
    port: int, bodies: list[bytes], stop_at: float | None, count: int | None, latencies: list[float]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        "POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Content-Length: {}\r\n\r\n"
    )
    sent = 0
    try:
        while True:
            if count is not None and sent >= count:
                break
            if stop_at is not None and time.perf_counter() >= stop_at:
                break
            body = bodies[sent % len(bodies)]
            started = time.perf_counter()
            writer.write(head.format(len(body)).encode() + body)
            await writer.drain()
            headers = await reader.readuntil(b"\r\n\r\n")
            if not headers.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(headers.decode(errors="replace"))
            length = int(headers.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - started)
            sent += 1
    finally:
        writer.close()


def _load(
    port: int, bodies: list[bytes], clients: int, seconds: float | None, count: int | None, out
) -> None:
    async def run() -> tuple[list[float], float]:
        latencies: list[float] = []
        started = time.perf_counter()
        stop_at = None if seconds is None else started + seconds
        per_client = None if count is None else count // clients
        await asyncio.gather(
            *(_client(port, bodies, stop_at, per_client, latencies) for _ in range(clients))
        )
        return latencies, time.perf_counter() - started

    latencies, elapsed = asyncio.run(run())
    out.put((latencies, elapsed))


def _measure(
    port: int,
    bodies: list[bytes],
    clients: int,
    seconds: float | None = None,
    count: int | None = None,
) -> dict[str, float]:
    queue: multiprocessing.Queue = multiprocessing.Queue()
    proc = multiprocessing.Process(
        target=_load, args=(port, bodies, clients, seconds, count, queue)
    )
    proc.start()
    latencies, elapsed = queue.get(timeout=600)
    proc.join(30)
    latencies.sort()
    return {
        "requests": len(latencies),
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "mean_ms": 1000 * statistics.fmean(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="sequential requests per case")
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="duration of each concurrent run"
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--backend", default="memory")
    args = parser.parse_args()

    zport = free_port()
    server = ServeProcess(
        "--zmq-bind", f"tcp://127.0.0.1:{zport}",
        "--backend", args.backend,
        "--log-level", "warning",
        env={**os.environ, "KVINDEX_REDIS_PREFIX": f"bench-score-{os.getpid()}"},
    )  # fmt: skip
    http, url = server.port, server.url
    try:
        server.wait_ready()
        rng = random.Random(11)
        prompt = [rng.randrange(1, 150_000) for _ in range(PROMPT_TOKENS)]
        _fill(f"tcp://127.0.0.1:{zport}", url, prompt)
        half = PROMPT_TOKENS // 2
        repeated = [json.dumps({"model": MODEL, "token_ids": prompt}).encode()]
        fresh = [
            json.dumps(
                {
                    "model": MODEL,
                    "token_ids": prompt[:half] + [rng.randrange(1, 150_000) for _ in range(half)],
                }
            ).encode()
            for _ in range(max(args.requests, 4000))
        ]
        print(
            f"/score over HTTP, {args.backend} backend: {PROMPT_TOKENS}-token prompt "
            f"(token_ids), {PODS} pods holding 8..512-block prefixes"
        )
        for name, bodies in (("same prompt repeated", repeated), ("new 2nd half each time", fresh)):
            _measure(http, bodies, 1, count=200)  # warm up
            one = _measure(http, bodies, 1, count=args.requests)
            many = _measure(http, bodies, args.clients, seconds=args.seconds)
            print(f"  {name}:")
            print(
                f"    1 client : p50 {one['p50_ms']:.2f} ms  p99 {one['p99_ms']:.2f} ms  "
                f"({one['rps']:.0f} req/s, {one['requests']} requests)"
            )
            print(
                f"    {args.clients} clients: {many['rps']:.0f} req/s  "
                f"p50 {many['p50_ms']:.2f} ms  p99 {many['p99_ms']:.2f} ms  "
                f"({many['requests']} requests)"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    main()

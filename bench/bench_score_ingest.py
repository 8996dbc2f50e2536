"""``/score`` latency while kvindex ingests: paced requests by block hashes against a
``kvindex serve`` that applies fresh-key batches at a fixed rate meanwhile.

A request's latency on a loaded service is mostly waiting: for the GIL while the
receiver and applier threads run, for a collection, for a step that holds the GIL long
(a table rebuild). This shows it: 64 loopback publishers (``bench/peers/feed.py``, kvindex
connected to each, every pod's vLLM ``/metrics`` page served and scraped) fill the
8,192-token prompt's prefixes, then one process sends fresh-key batches of 8 events
(32 blocks each) at ``--rate`` blocks/s while another sends ``/score`` every
``--interval`` seconds on one keep-alive connection. Prints p50/p90/p99/p99.9/max and
the rate the index really applied (``kvindex_blocks_stored_total``); ``--rate 0`` is the
same without ingest.

    python bench/bench_score_ingest.py [--rate 300000] [--seconds 10] [--runs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import time

import httpx
import zmq

try:  # run as a script: bench/ is sys.path[0]
    from bench_score import PROMPT_TOKENS, _hosts, _MetricsPages
    from peers.feed import BLOCK, MODEL, Publishers, fresh_batches, prefix_fill
except ModuleNotFoundError:
    from bench.bench_score import PROMPT_TOKENS
    from bench.peers.feed import BLOCK, MODEL, Publishers, fresh_batches, prefix_fill

from kvindex.api.testing import ServeProcess
from kvindex.indexer.keys import BlockHasher, HashConfig

PODS = 64
PER_MESSAGE = 8  # events per batch, 32 blocks each


def _prompt() -> list[int]:
    rng = random.Random(11)  # bench_score.py's prompt
    return [rng.randrange(1, 150_000) for _ in range(PROMPT_TOKENS)]


def _feeder(endpoints, ready, go, rate: float, seconds: float) -> None:
    """The engines: fill the prefixes, encode the fresh batches, then send them paced
    while ``go`` is set."""
    ctx = zmq.Context()
    pubs = Publishers(ctx, PODS)
    endpoints.put(pubs.endpoints)
    pubs.wait_subscribed(60)
    pubs.send(prefix_fill(_prompt(), PODS))
    batches = fresh_batches(int(rate * seconds * 1.1), PER_MESSAGE, PODS, seed=5)
    ready.set()
    go.wait()
    per_s = rate / (PER_MESSAGE * 32) if rate else 0
    started = time.perf_counter()
    for i, payload in enumerate(batches.payloads if rate else ()):
        if not go.is_set():
            break
        wait = started + i / per_s - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        pubs.send([payload])
    go.clear()
    pubs.close()
    ctx.term()


async def _paced(port: int, body: bytes, seconds: float, interval: float) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    latencies, started = [], time.perf_counter()
    while (now := time.perf_counter()) - started < seconds:
        due = started + len(latencies) * interval
        if due > now:
            await asyncio.sleep(due - now)
        sent = time.perf_counter()
        writer.write(head + body)
        await writer.drain()
        answer = await reader.readuntil(b"\r\n\r\n")
        length = int(answer.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        latencies.append(time.perf_counter() - sent)
    writer.close()
    return latencies


def _client(port: int, body: bytes, seconds: float, interval: float, out) -> None:
    out.put(asyncio.run(_paced(port, body, seconds, interval)))


def _stored(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^kvindex_blocks_stored_total (\S+)", text, re.M).group(1))


def run(args: argparse.Namespace, body: bytes) -> None:
    endpoints, ready, go = multiprocessing.Queue(), multiprocessing.Event(), multiprocessing.Event()
    feeder = multiprocessing.Process(
        target=_feeder, args=(endpoints, ready, go, args.rate, args.seconds)
    )
    feeder.start()
    flags = ["--log-level", "warning"]
    for endpoint in endpoints.get(timeout=60):
        flags += ["--zmq-connect", endpoint]
    with ServeProcess(*flags) as server:
        server.wait_ready(60)
        if not ready.wait(600):
            raise SystemExit("the feeder did not get ready")
        time.sleep(2)  # the prefixes applied, the first scrapes done
        out: multiprocessing.Queue = multiprocessing.Queue()
        before, started = _stored(server.url), time.perf_counter()
        go.set()
        client = multiprocessing.Process(
            target=_client, args=(server.port, body, args.seconds, args.interval, out)
        )
        client.start()
        latencies = sorted(out.get(timeout=600))
        client.join(30)
        go.clear()
        applied = (_stored(server.url) - before) / (time.perf_counter() - started)
    feeder.join(30)
    n = len(latencies)

    def ms(p: float) -> float:
        return 1000 * latencies[min(n - 1, int(n * p))]

    print(
        f"  load {os.getloadavg()[0]:5.2f}: {n} requests, p50 {ms(0.5):.3f} p90 {ms(0.9):.3f} "
        f"p99 {ms(0.99):.2f} p99.9 {ms(0.999):.2f} max {1000 * latencies[-1]:.1f} ms; "
        f"index applied {applied:,.0f} blocks/s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=300_000, help="fresh blocks/s sent")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=0.002, help="seconds between requests")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    keys = BlockHasher(HashConfig(block_size=BLOCK)).keys(_prompt())
    body = json.dumps({"model": MODEL, "block_hashes": keys}).encode()
    print(
        f"/score by block hashes every {args.interval * 1000:g} ms, {PODS} pods, while "
        f"{args.rate:,.0f} fresh blocks/s are sent ({PER_MESSAGE} events per batch)"
    )
    pages = _MetricsPages(_hosts())  # every pod's /metrics, scraped as in a cluster
    try:
        for _ in range(args.runs):
            run(args, body)
    finally:
        pages.close()


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    main()

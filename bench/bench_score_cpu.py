"""CPU time per ``/score`` and ``/route`` request, in-process, through the service's ASGI app.

The HTTP figures of ``bench_score.py`` move by tens of percent with whatever else runs on
the machine; the CPU time the request's own thread spends (``time.thread_time``) moves
much less, so this is the figure to compare code changes by. The setup is
``bench_score.py``'s: an 8,192-token prompt, 64 pods holding its first 8, 16, ..., 512
blocks, every pod's captured vLLM 0.33 ``/metrics`` page served on its loopback address
and scraped once (so /route costs known loads). The index is filled through the backend
directly rather than over ZMQ, and no server runs: requests are ASGI calls made on one
event loop, body in one message, as uvicorn makes them. Uvicorn's own HTTP parsing and
socket writes are not included.

    python bench/bench_score_cpu.py [--requests 2000]

Prints, per case, the median and the best of the CPU time per request over batches of
50 (the cases interleaved batch by batch), and ``/route`` minus ``/score`` for each
prompt form (issue 11: ``/route`` adds at most 0.2 ms over HTTP; this is the part of
that spent in kvindex's own code).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from typing import Any

try:  # run as a script: bench/ is sys.path[0]
    from bench_score import BLOCK, MODEL, PODS, PROMPT_TOKENS, _hosts, _MetricsPages
except ModuleNotFoundError:  # imported as bench.bench_score_cpu
    from bench.bench_score import BLOCK, MODEL, PODS, PROMPT_TOKENS, _hosts, _MetricsPages

from kvindex.api.app import create_app
from kvindex.api.service import Service
from kvindex.api.settings_load import from_flags
from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.compiled import implementation
from kvindex.indexer.keys import BlockHasher, HashConfig

BATCH = 50


def _scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
    }


async def _call(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """One request through the ASGI app; its status and body."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(_scope(path), receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def _service(prompt: list[int]) -> tuple[Service, list[int]]:
    keys = BlockHasher(HashConfig(block_size=BLOCK)).keys(prompt)
    service = Service(from_flags(model=MODEL, block_size=BLOCK, log_level="warning"))
    pods = [f"{host}:8000" for host in _hosts()]
    for i, pod in enumerate(pods):
        n = min(len(keys), 8 * (i + 1))
        service.backend.apply([Change(Op.STORE, pod, MODEL, Tier.GPU, keys[:n])])
    pages = _MetricsPages(_hosts())
    try:
        service.load.set_pods(pods)
        service.load.stale_after_s = 1e9  # one scrape, known for the whole run
        service.load.scrape_once()
    finally:
        pages.close()
    return service, keys


async def _measure(app: Any, cases: dict[str, tuple[str, bytes]], requests: int):
    for path, body in cases.values():  # warm up, and check every case answers
        for _ in range(100):
            status, answer = await _call(app, path, body)
        if status != 200:
            raise SystemExit(f"{path} answered {status}: {answer[:200]!r}")
    per_batch: dict[str, list[float]] = {name: [] for name in cases}
    clock = time.thread_time_ns
    for _ in range(max(1, requests // BATCH)):
        for name, (path, body) in cases.items():
            started = clock()
            for _ in range(BATCH):
                await _call(app, path, body)
            per_batch[name].append((clock() - started) / BATCH / 1000)
    return per_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per case")
    args = parser.parse_args()
    rng = random.Random(11)  # bench_score.py's prompt
    prompt = [rng.randrange(1, 150_000) for _ in range(PROMPT_TOKENS)]
    service, keys = _service(prompt)
    try:
        app = create_app(service)
        hashes = {"model": MODEL, "block_hashes": keys}
        tokens = {"model": MODEL, "token_ids": prompt}
        cases = {
            "/score block_hashes": ("/score", json.dumps(hashes).encode()),
            "/route block_hashes": ("/route", json.dumps({**hashes, "request_id": "b"}).encode()),
            "/score token_ids": ("/score", json.dumps(tokens).encode()),
            "/route token_ids": ("/route", json.dumps({**tokens, "request_id": "b"}).encode()),
        }
        load = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
        print(
            f"in-process CPU per request, {PROMPT_TOKENS} tokens = {len(keys)} blocks, "
            f"{PODS} pods, {implementation()} lookup, load average {load}"
        )
        per_batch = asyncio.run(_measure(app, cases, args.requests))
    finally:
        service.stop()
    median = {name: statistics.median(t) for name, t in per_batch.items()}
    for name, times in per_batch.items():
        print(f"  {name:<22} median {median[name]:7.1f} us   best {min(times):7.1f} us")
    for form in ("block_hashes", "token_ids"):
        added = median[f"/route {form}"] - median[f"/score {form}"]
        print(f"  /route - /score, {form:<12} {added:7.1f} us (medians)")


if __name__ == "__main__":
    main()

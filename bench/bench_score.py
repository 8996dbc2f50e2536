"""/score over HTTP: an 8,192-token prompt (token_ids) across 64 pods with overlapping prefixes.

Starts a real ``kvindex serve`` (memory backend by default, or ``--backend redis://...``),
fills it over ZMQ from 64 engine publishers (pod i holds the first 8·(i+1) blocks of the
shared 512-block prompt, so every pod matches a different prefix length), serves each
pod's vLLM ``/metrics`` page on its address (kvindex scrapes them every second, as in a
cluster), then measures:

* one client, sequential requests: p50 / p99 latency;
* 16 concurrent clients (keep-alive connections): requests/s and p50 / p99.

Each is run with the same prompt repeated (the block-hash memo is warm: a gateway
re-scoring a conversation) and with a fresh prompt per request sharing the first
half (only the new half is hashed). The load generator is a separate process with a
minimal asyncio HTTP/1.1 client so it costs the server as little CPU as possible on a
2-core machine. Then ``/route`` against ``/score`` with the same prompt, side by side,
one client alternating them request by request: the issue-11 target is that ``/route``
adds at most 0.2 ms at p50; the verdict is printed (PASS / FAIL) and is the exit status.

    python bench/bench_score.py [--requests 2000] [--seconds 10] [--backend memory]
    python bench/bench_score.py --route-only        # only /route vs /score
    python bench/bench_score.py --forms-only        # only the prompt forms (issue 13)
    python bench/bench_score.py --forms-only --generator wrk   # the forms, wrk's load
    python bench/bench_score.py --forms-only --processes 2    # with a serving worker

``--forms-only`` (and every full run) scores the repeated prompt in each of /score's
forms: JSON ``token_ids``, JSON ``block_hashes`` (ints, and hex strings), and a binary
body of little-endian uint32 token ids; it first checks that all four give the same
answer, then prints each form's figures with PASS/FAIL against issue 13's targets
(``bench/bench_score_forms.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

try:  # run as a script: bench/ is sys.path[0]
    from bench_score_forms import measure_forms
    from peers import wrk
    from peers.servers import cpu_seconds
except ModuleNotFoundError:  # imported as bench.bench_score (bench/compare_peers.py)
    from bench.bench_score_forms import measure_forms
    from bench.peers import wrk
    from bench.peers.servers import cpu_seconds

from kvindex.api.testing import ServeProcess, free_port

BLOCK = 16
PROMPT_TOKENS = 8192
PODS = 64
MODEL = "bench/model"
JSON = "application/json"


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


_PAGE = Path(__file__).parent.parent / "tests/fixtures/metrics/vllm-0.33-dp1-idle.txt"


class _MetricsPages:
    """Every pod's vLLM ``/metrics`` (the captured vLLM 0.33 page) served on its own
    loopback address, so that kvindex's load scraping does the work it does in a real
    cluster (64 pages a second) while /score and /route are measured."""

    def __init__(self, hosts: list[str], port: int = 8000) -> None:
        body = _PAGE.read_bytes()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                # kvindex's scrape timed out on a busy machine and hung up
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.servers: list[ThreadingHTTPServer] = []
        self.missing: list[str] = []
        for host in hosts:
            try:
                server = ThreadingHTTPServer((host, port), Handler)
            except OSError:
                self.missing.append(host)
                continue
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self.servers.append(server)

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


def _hosts() -> list[str]:
    return [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(PODS)]


def _fill(zmq_endpoint: str, url: str, prompt: list[int]) -> None:
    from kvindex.events.wire.endpoints import from_source
    from kvindex.events.wire.publisher import EnginePublisher
    from kvindex.events.wire.vllm import BlockStored
    from kvindex.indexer.keys import BlockHasher, HashConfig

    keys = BlockHasher(HashConfig(block_size=BLOCK)).keys(prompt)
    publishers = []
    for host in _hosts():
        pod = f"{host}:8000"
        # Each pod sends from its own loopback address: bind mode checks the sender.
        source = from_source(zmq_endpoint, host)
        pub = EnginePublisher(source, topic=f"kv@{pod}@{MODEL}", bind=False)
        if not pub.wait_for_subscribers(1, 10.0):
            raise SystemExit("publisher could not reach kvindex")
        n = min(len(keys), 8 * (len(publishers) + 1))
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
    port: int,
    bodies: list[bytes],
    stop_at: float | None,
    count: int | None,
    latencies: list[float],
    path: str = "/score",
    content_type: str = JSON,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
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
    port: int,
    bodies: list[bytes],
    clients: int,
    seconds: float | None,
    count: int | None,
    out,
    path: str = "/score",
    content_type: str = JSON,
) -> None:
    async def run() -> tuple[list[float], float]:
        latencies: list[float] = []
        started = time.perf_counter()
        stop_at = None if seconds is None else started + seconds
        per_client = None if count is None else count // clients
        await asyncio.gather(
            *(
                _client(port, bodies, stop_at, per_client, latencies, path, content_type)
                for _ in range(clients)
            )
        )
        return latencies, time.perf_counter() - started

    cpu = time.process_time()
    latencies, elapsed = asyncio.run(run())
    out.put((latencies, elapsed, time.process_time() - cpu))


def _measure(
    port: int,
    bodies: list[bytes],
    clients: int,
    seconds: float | None = None,
    count: int | None = None,
    path: str = "/score",
    content_type: str = JSON,
    server_pid: int | None = None,
) -> dict[str, float]:
    """The figures of one run; ``generator_us`` is the load generator's own CPU time per
    request and, given ``server_pid``, ``server_us`` the server's (every thread, and
    whatever else it does meanwhile: load scrapes, events)."""
    cpu = None if server_pid is None else cpu_seconds(server_pid)
    latencies, elapsed, generator = _run(port, bodies, clients, seconds, count, path, content_type)
    figures = _figures(latencies, elapsed)
    figures["generator_us"] = 1e6 * generator / max(1, len(latencies))
    if cpu is not None:
        figures["server_us"] = 1e6 * (cpu_seconds(server_pid) - cpu) / max(1, len(latencies))
    return figures


def _measure_wrk(
    port: int,
    bodies: list[bytes],
    clients: int,
    seconds: float | None = None,
    count: int | None = None,
    path: str = "/score",
    content_type: str = JSON,
    server_pid: int | None = None,
) -> dict[str, float]:
    """:func:`_measure` with wrk as the generator: it runs for a time, not a count, so a
    ``count`` of requests becomes a run of one second per 2,000 (at least one)."""
    duration = seconds if seconds is not None else max(1.0, (count or 0) / 2000)
    cpu = None if server_pid is None else cpu_seconds(server_pid)
    figures = wrk.measure(port, bodies, clients, duration, path, content_type)
    if cpu is not None:
        figures["server_us"] = 1e6 * (cpu_seconds(server_pid) - cpu) / max(1, figures["requests"])
    return figures


def _run(
    port: int,
    bodies: list[bytes],
    clients: int,
    seconds: float | None,
    count: int | None,
    path: str,
    content_type: str = JSON,
) -> tuple[list[float], float, float]:
    queue: multiprocessing.Queue = multiprocessing.Queue()
    proc = multiprocessing.Process(
        target=_load, args=(port, bodies, clients, seconds, count, queue, path, content_type)
    )
    proc.start()
    latencies, elapsed, generator = queue.get(timeout=600)
    proc.join(30)
    return latencies, elapsed, generator


def _figures(latencies: list[float], elapsed: float) -> dict[str, float]:
    latencies = sorted(latencies)
    return {
        "requests": len(latencies),
        "rps": len(latencies) / elapsed,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "mean_ms": 1000 * statistics.fmean(latencies),
    }


ROUTE_BUDGET_MS = 0.2  # issue 11: /route adds at most this to /score's p50


async def _alternate(port: int, bodies: dict[str, bytes], pairs: int) -> dict[str, list[float]]:
    """One keep-alive connection, /score and /route request by request, in turn: a burst
    of machine noise hits both alike."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    samples: dict[str, list[float]] = {path: [] for path in bodies}
    try:
        for _ in range(pairs):
            for path, body in bodies.items():
                head = (
                    f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                )
                started = time.perf_counter()
                writer.write(head.encode() + body)
                await writer.drain()
                headers = await reader.readuntil(b"\r\n\r\n")
                if not headers.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(headers.decode(errors="replace"))
                length = int(headers.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                samples[path].append(time.perf_counter() - started)
    finally:
        writer.close()
    return samples


def _alternate_in_child(port: int, bodies: dict[str, bytes], pairs: int, out) -> None:
    out.put(asyncio.run(_alternate(port, bodies, pairs)))


def _route_vs_score(port: int, prompt: list[int], pairs: int) -> bool:
    """/score and /route with the same prompt (no pod list: every known pod is a
    candidate), one client alternating request by request. /route's body adds a request
    id, the same each time: routing an open id again moves it, so one request stays in
    flight, as with a gateway that reports each one done."""
    prompt_body = {"model": MODEL, "token_ids": prompt}
    bodies = {
        "/score": json.dumps(prompt_body).encode(),
        "/route": json.dumps({**prompt_body, "request_id": "bench"}).encode(),
    }
    queue: multiprocessing.Queue = multiprocessing.Queue()
    for count in (200, pairs):  # a warm-up, then the measured run
        proc = multiprocessing.Process(
            target=_alternate_in_child, args=(port, bodies, count, queue)
        )
        proc.start()
        samples = queue.get(timeout=600)
        proc.join(30)
    score, route = (_figures(samples[p], 1.0) for p in ("/score", "/route"))
    added = route["p50_ms"] - score["p50_ms"]
    verdict = "PASS" if added <= ROUTE_BUDGET_MS else "FAIL"
    print(f"/route vs /score, same prompt, 1 client alternating them, {pairs} of each:")
    for name, f in (("/score", score), ("/route", route)):
        print(f"    {name:7}: p50 {f['p50_ms']:.3f} ms  p99 {f['p99_ms']:.3f} ms")
    budget = ROUTE_BUDGET_MS * 1000
    print(f"    /route adds {added * 1000:.0f} µs at p50 (target <= {budget:.0f} µs): {verdict}")
    return added <= ROUTE_BUDGET_MS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="sequential requests per case")
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="duration of each concurrent run"
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--backend", default="memory")
    parser.add_argument(
        "--processes", type=int, default=1, help="kvindex serve --processes (memory backend)"
    )
    parser.add_argument(
        "--route-only", action="store_true", help="only the /route vs /score comparison"
    )
    parser.add_argument("--pairs", type=int, default=2000, help="/route vs /score requests")
    parser.add_argument(
        "--forms-only", action="store_true", help="only the prompt forms (issue 13)"
    )
    parser.add_argument(
        "--generator",
        choices=("python", "wrk"),
        default="python",
        help="the prompt forms' load generator: the minimal asyncio client, or wrk "
        "(apt install wrk; about half the client CPU per request, so the one-client "
        "latency holds less of the generator's own time)",
    )
    args = parser.parse_args()
    if args.generator == "wrk" and not wrk.available():
        raise SystemExit("--generator wrk: no wrk on PATH (Debian: apt-get install wrk)")

    zport = free_port()
    server = ServeProcess(
        "--zmq-bind", f"tcp://127.0.0.1:{zport}",
        "--backend", args.backend,
        "--log-level", "warning",
        "--processes", str(args.processes),
        env={**os.environ, "KVINDEX_REDIS_PREFIX": f"bench-score-{os.getpid()}"},
    )  # fmt: skip
    http, url = server.port, server.url
    pages = _MetricsPages(_hosts())
    try:
        server.wait_ready()
        if pages.missing:
            print(f"(no /metrics for {len(pages.missing)} pods: port 8000 taken on their address)")
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
        cases = (("same prompt repeated", repeated), ("new 2nd half each time", fresh))
        forms_passed = True
        if not args.route_only:
            measure = _measure if args.generator == "python" else _measure_wrk
            print(f"(load generator: {args.generator})")
            forms_passed = measure_forms(
                http, MODEL, prompt, BLOCK, args.requests, args.seconds, args.clients, measure,
                server_pid=server.process.pid,
            )  # fmt: skip
        skip = args.route_only or args.forms_only
        for name, bodies in () if skip else cases:
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
        passed = forms_passed and (args.forms_only or _route_vs_score(http, prompt, args.pairs))
    finally:
        server.stop()
        pages.close()
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    main()

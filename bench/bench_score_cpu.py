"""CPU time per ``/score`` and ``/route`` request, in-process: the service's handlers as
``kvindex serve`` runs them, without the sockets.

The HTTP figures of ``bench_score.py`` move by tens of percent with whatever else runs on
the machine; the CPU time the request's own thread spends (``time.thread_time``) moves
much less, so this is the figure to compare code changes by. The setup is
``bench_score.py``'s: an 8,192-token prompt, 64 pods holding its first 8, 16, ..., 512
blocks, every pod's captured vLLM 0.33 ``/metrics`` page served on its loopback address
and scraped once (so /route costs known loads). The index is filled through the backend
directly rather than over ZMQ, and no server runs. Each request is answered three ways,
on uvloop as ``kvindex serve`` runs:

* ``lane``: the request's bytes fed to ``kvindex serve``'s own protocol (uvicorn's
  httptools protocol with the lane of ``api/http/hot_lane.py``) over an in-memory transport:
  what the server's event loop does per request, less the socket calls;
* ``uvicorn+ASGI``: the same bytes to uvicorn's protocol without the lane (as before the
  lane: the hot paths answered by the ASGI app, through an ASGI task);
* ``ASGI app``: the ASGI app called directly, body in one message (no HTTP parsing).

    python bench/bench_score_cpu.py [--requests 2000] [--case "/score token_ids"] [--way lane]

``--case`` and ``--way`` keep one case or way (repeatable), for a profiler or
``valgrind --tool=callgrind``: two runs with different ``--requests``, the difference
divided by the difference in requests, count one request's instructions.

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

import uvicorn
import uvloop
from uvicorn.server import ServerState

from kvindex.api.http.app import Http, create_http
from kvindex.api.http.header_deadline import header_deadline_protocol
from kvindex.api.http.hot_lane import lane_protocol
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.compiled import implementation
from kvindex.indexer.keys import BlockHasher, HashConfig

BATCH = 50
WAYS = ("lane", "uvicorn+ASGI", "ASGI app")
_ADDRESSES = {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 50000)}


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


class _Way:
    """One way of answering a request; :meth:`call` gives the answer's head and body."""

    async def call(self, path: str, body: bytes) -> tuple[bytes, bytes]:
        raise NotImplementedError


class _AsgiApp(_Way):
    """The ASGI app called directly, as an ASGI server calls it (no HTTP parsing)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def call(self, path: str, body: bytes) -> tuple[bytes, bytes]:
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

        await self.app(_scope(path), receive, send)
        return b"%d" % sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


class _Wire(asyncio.Transport):
    """An in-memory transport: what the protocol writes is kept, nothing is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return _ADDRESSES.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Protocol(_Way):
    """One keep-alive connection into an HTTP protocol class over a :class:`_Wire`:
    the request's bytes in, the loop run until the whole answer is written."""

    def __init__(self, protocol: type, app: Any, state: ServerState) -> None:
        config = uvicorn.Config(app, http=protocol, log_config=None, access_log=False)
        config.load()
        self.wire = _Wire()
        self.protocol = protocol(config, state, {}, asyncio.get_running_loop())
        self.protocol.connection_made(self.wire)

    async def call(self, path: str, body: bytes) -> tuple[bytes, bytes]:
        wire = self.wire
        self.protocol.data_received(
            b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body)
        )
        await asyncio.sleep(0)  # the server's loop turns at least once per request
        while (answer := _whole(wire.written)) is None:
            await asyncio.sleep(0)
        wire.written.clear()
        return answer


def _whole(written: bytearray) -> tuple[bytes, bytes] | None:
    """The head and body of the answer in ``written``, once it is all there."""
    end = written.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(written[:end])
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    if len(written) < end + 4 + length:
        return None
    return head, bytes(written[end + 4 : end + 4 + length])


def _ways(http: Http) -> dict[str, _Way]:
    state = ServerState()
    state.default_headers = [
        (b"date", b"Mon, 01 Dec 2025 12:00:00 GMT"),
        (b"server", b"uvicorn"),
    ]  # as uvicorn's tick sets them
    plain = header_deadline_protocol(10.0)
    return {
        "lane": _Protocol(lane_protocol(plain, http.lane), http.app, state),
        "uvicorn+ASGI": _Protocol(plain, http.app, state),
        "ASGI app": _AsgiApp(http.app),
    }


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


async def _measure(
    http: Http, cases: dict[str, tuple[str, bytes]], requests: int, only: list[str] | None
):
    ways = {name: way for name, way in _ways(http).items() if not only or name in only}
    for name, (path, body) in cases.items():  # warm up, and check every way answers alike
        answers = {}
        for way_name, way in ways.items():
            for _ in range(100):
                head, answer = await way.call(path, body)
            if not head.startswith((b"200", b"HTTP/1.1 200")):
                raise SystemExit(f"{way_name} {path} answered {head[:100]!r}: {answer[:200]!r}")
            answers[way_name] = head, answer
        if path == "/score":  # /route's candidates tie at random: only /score is compared
            if len({answer for _, answer in answers.values()}) != 1:
                raise SystemExit(f"{name}: the ways answered different bodies")
            if {"lane", "uvicorn+ASGI"} <= answers.keys() and (
                answers["lane"][0] != answers["uvicorn+ASGI"][0]
            ):
                raise SystemExit(f"{name}: the lane's answer head differs from uvicorn's")
    per_batch: dict[str, list[float]] = {f"{n} [{w}]": [] for n in cases for w in ways}
    clock = time.thread_time_ns
    for _ in range(max(1, requests // BATCH)):
        for name, (path, body) in cases.items():
            for way_name, way in ways.items():
                started = clock()
                for _ in range(BATCH):
                    await way.call(path, body)
                per_batch[f"{name} [{way_name}]"].append((clock() - started) / BATCH / 1000)
    return per_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per case")
    parser.add_argument("--case", action="append", help="only this case (repeatable)")
    parser.add_argument("--way", action="append", choices=WAYS, help="only this way")
    args = parser.parse_args()
    rng = random.Random(11)  # bench_score.py's prompt
    prompt = [rng.randrange(1, 150_000) for _ in range(PROMPT_TOKENS)]
    service, keys = _service(prompt)
    try:
        http = create_http(service)
        hashes = {"model": MODEL, "block_hashes": keys}
        tokens = {"model": MODEL, "token_ids": prompt}
        cases = {
            "/score block_hashes": ("/score", json.dumps(hashes).encode()),
            "/route block_hashes": ("/route", json.dumps({**hashes, "request_id": "b"}).encode()),
            "/score token_ids": ("/score", json.dumps(tokens).encode()),
            "/route token_ids": ("/route", json.dumps({**tokens, "request_id": "b"}).encode()),
        }
        if args.case:
            cases = {name: cases[name] for name in args.case}
        load = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
        print(
            f"in-process CPU per request, {PROMPT_TOKENS} tokens = {len(keys)} blocks, "
            f"{PODS} pods, {implementation()} lookup, uvloop, load average {load}"
        )
        print("  (lane / uvicorn+ASGI: identical /score answer bytes, heads included: checked)")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            per_batch = runner.run(_measure(http, cases, args.requests, args.way))
    finally:
        service.stop()
    median = {name: statistics.median(t) for name, t in per_batch.items()}
    for name, times in per_batch.items():
        print(f"  {name:<38} median {median[name]:7.1f} us   best {min(times):7.1f} us")
    for form in ("block_hashes", "token_ids"):
        if f"/route {form} [lane]" not in median or f"/score {form} [lane]" not in median:
            continue
        added = median[f"/route {form} [lane]"] - median[f"/score {form} [lane]"]
        print(f"  /route - /score, {form:<12} {added:7.1f} us (medians, lane)")


if __name__ == "__main__":
    main()

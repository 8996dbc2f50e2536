"""/score and /route never hold the event loop on the index backend (issue 13).

A Redis that accepts connections and never answers is a real loopback TCP server that
does exactly that; ``kvindex serve`` points its Redis URL at it. While /score calls are
stuck on it, /healthz and /metrics answer; a stuck call gets 503 ``backend_timeout``
at its deadline; past the in-flight cap a call gets 503 ``backend_busy`` without
queueing; /route decides on load alone. A Redis that answers is used as before. No
mocks, every wait bounded, no timing assertions.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import redis
import uvicorn

from kvindex.api.gateway.routes import LocalRoutes
from kvindex.api.http.app import create_app
from kvindex.api.http.offload import BackendBusy, BackendTimeout, IndexWork
from kvindex.api.http.schemas import RouteRequest
from kvindex.api.serve.index_figures import IndexFigures, LatestFigures
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from kvindex.api.testing import free_port
from kvindex.events.ingest.testing import wait_until
from kvindex.indexer.backend import Change, IndexStats, Op, Tier
from kvindex.indexer.redis.backend import RedisBackend
from tests.redis_fixtures import REDIS_URL, delete_prefix, shared_redis

M = "acme/model-7b"
POD = "127.0.0.1:8000"
KEYS = [11, 12, 13, 14]
STUCK = 8


class HungServer:
    """A TCP server on loopback that accepts every connection and never answers: a Redis
    in a brownout. :meth:`close` drops every connection (its clients then fail at once)."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", port), backlog=64)
        self.listener.settimeout(0.1)
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(conn)  # read nothing, answer nothing

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()
        for conn in self.accepted:
            conn.close()


@contextmanager
def serving(**flags: object) -> Iterator[str]:
    """``create_app`` over a Service from ``flags``, served by uvicorn on a loopback port
    in a thread of this process; yields its base URL."""
    service = Service(from_flags(model=M, **flags))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, 10.0), "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)


@contextmanager
def hung_redis(**flags: object) -> Iterator[tuple[str, HungServer]]:
    """A served kvindex whose Redis hangs. It starts while nothing listens on the port
    (a refused connection fails at once, so it starts, unready); then the hung server
    takes the port. Socket timeouts of a minute: a stuck call stays stuck for the test."""
    port = free_port()
    backend = f"redis://127.0.0.1:{port}/0?cluster=no&timeout=60"
    with serving(backend=backend, **flags) as url:
        hung_server = HungServer(port)
        try:
            yield url, hung_server
        finally:
            hung_server.close()  # the stuck calls fail now, so the server stops at once


def _score(client: httpx.Client, **extra: object) -> httpx.Response:
    return client.post("/score", json={"model": M, "block_hashes": KEYS, **extra})


def test_a_stuck_lookup_answers_503_at_its_deadline_and_the_cap_refuses_at_once() -> None:
    known = [f"{POD}=both"]  # configured: /route takes only pods it knows
    with (
        hung_redis(backend_deadline=0.3, backend_max_in_flight=2, pod_role=known) as (url, _),
        httpx.Client(base_url=url, timeout=20) as client,
    ):
        # Two lookups reach the hung Redis and stay stuck there past their deadline...
        for _ in range(2):
            answer = _score(client)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"] == "backend_timeout", answer.text
        # ...so the cap of two is full: the next is refused without being queued.
        answer = _score(client)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"] == "backend_busy", answer.text
        # /route degrades to a decision on load alone instead of failing.
        routed = client.post("/route", json={"model": M, "block_hashes": KEYS, "pods": [POD]})
        assert routed.status_code == 200, routed.text
        assert routed.json()["pod"] == POD
        assert routed.json()["reason"] == "fallback_backend_down", routed.text
        assert _gauge(client, "kvindex_backend_work_in_flight") == 2


def test_healthz_and_metrics_answer_while_eight_lookups_are_stuck() -> None:
    with hung_redis(backend_deadline=60.0) as (url, hung_server):
        answers = asyncio.run(_while_stuck(url, hung_server))
    # The stuck calls ended when the hung server dropped their connections.
    assert [a[0] for a in answers] == [503] * STUCK, answers
    assert {a[1] for a in answers} == {"backend_unavailable"}, answers


async def _while_stuck(url: str, hung_server: HungServer) -> list[tuple[int, str]]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def score() -> tuple[int, str]:
            answer = await client.post("/score", json={"model": M, "block_hashes": KEYS})
            return answer.status_code, answer.json()["error"]

        calls = [asyncio.create_task(score()) for _ in range(STUCK)]
        deadline = time.monotonic() + 20
        while await _async_gauge(client, "kvindex_backend_work_in_flight") < STUCK:
            assert time.monotonic() < deadline, "the /score calls never reached the backend"
            await asyncio.sleep(0.05)
        health = await client.get("/healthz")
        metrics = await client.get("/metrics")
        assert not any(c.done() for c in calls), "a /score call ended while Redis hangs"
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert metrics.status_code == 200 and "kvindex_events_total" in metrics.text
        hung_server.close()
        return list(await asyncio.wait_for(asyncio.gather(*calls), 20))


def test_a_redis_that_answers_is_used_through_the_threads() -> None:
    client = shared_redis()
    prefix = f"kvtest-{uuid.uuid4().hex[:12]}"
    backend = RedisBackend.from_url(REDIS_URL, prefix=prefix)
    try:
        backend.apply([Change(Op.STORE, POD, M, Tier.GPU, KEYS[:3])])
        with serving(backend=REDIS_URL, redis_prefix=prefix) as url:
            answers = asyncio.run(_concurrent_scores(url, STUCK))
    finally:
        backend.close()
        delete_prefix(client, prefix)
        client.close()
    for status, body in answers:
        assert status == 200, body
        assert [(p["pod"], p["matched_blocks"]) for p in body["pods"]] == [(POD, 3)], body


async def _concurrent_scores(url: str, n: int) -> list[tuple[int, dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=20) as client:

        async def score() -> tuple[int, dict]:
            answer = await client.post("/score", json={"model": M, "block_hashes": KEYS})
            return answer.status_code, answer.json()

        return list(await asyncio.wait_for(asyncio.gather(*(score() for _ in range(n))), 30))


def _gauge(client: httpx.Client, name: str) -> float:
    return _parse_gauge(client.get("/metrics").text, name)


async def _async_gauge(client: httpx.AsyncClient, name: str) -> float:
    return _parse_gauge((await client.get("/metrics")).text, name)


def _parse_gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {name} in /metrics")


# -- the parts, in-process -------------------------------------------------------------------


def test_index_work_deadline_cap_and_release() -> None:
    release = threading.Event()
    work = IndexWork(inline=False, deadline_s=0.05, max_in_flight=2, threads=2)

    async def scenario() -> None:
        assert await work.run(lambda x: x + 1, 1) == 2
        for _ in range(2):
            with pytest.raises(BackendTimeout):
                await work.run(release.wait, 30)
        with pytest.raises(BackendBusy):
            await work.run(lambda: None)

    try:
        asyncio.run(scenario())
        assert work.in_flight == 2  # abandoned, still running: still counted
        release.set()
        deadline = time.monotonic() + 10
        while work.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert work.in_flight == 0
        assert asyncio.run(work.run(lambda: "again")) == "again"
    finally:
        release.set()
        work.close()


def test_index_work_inline_runs_on_the_caller_and_passes_errors() -> None:
    work = IndexWork(inline=True, deadline_s=1, max_in_flight=1)
    caller = threading.get_ident()
    assert asyncio.run(work.run(threading.get_ident)) == caller
    with pytest.raises(redis.ConnectionError):
        asyncio.run(work.run(_raise))


def _raise() -> None:
    raise redis.ConnectionError("refused")


def test_latest_figures_never_wait_long_for_a_hung_read() -> None:
    release = threading.Event()
    reads = []
    figures = IndexFigures(IndexStats(members=1, blocks={Tier.GPU: 3}, keys=3))

    def read() -> IndexFigures:
        reads.append(1)
        release.wait(30)
        return figures

    latest = LatestFigures(read, inline=False, wait_s=0.01)
    try:
        assert latest.get() is None  # the read hangs: no figures yet
        assert latest.get() is None and len(reads) == 1  # one read in flight, not two
        release.set()
        deadline = time.monotonic() + 10
        while latest.get() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert latest.get() == figures
    finally:
        release.set()


def test_the_in_process_gateway_routes_off_the_event_loop() -> None:
    """``kvindex serve --gateway`` asks the index in-process: the same deadline and
    load-only fallback as /route, and the loop stays free while Redis hangs."""
    port = free_port()
    hung_server = HungServer(port)
    service = Service(
        from_flags(
            model=M, backend=f"redis://127.0.0.1:{port}/0?cluster=no&timeout=5",
            backend_deadline=0.3, pod_role=[f"{POD}=both"],  # known without the index
        )
    )  # fmt: skip
    request = RouteRequest(model=M, block_hashes=KEYS, pods=[POD])

    async def route_while_ticking() -> tuple[str, int]:
        ticks = 0
        routing = asyncio.create_task(LocalRoutes(service).route(request))
        while not routing.done():
            await asyncio.sleep(0.01)
            ticks += 1
        return (await routing).reason, ticks

    try:
        reason, ticks = asyncio.run(route_while_ticking())
    finally:
        hung_server.close()
        service.stop()
    assert reason == "fallback_backend_down"
    assert ticks > 1  # other coroutines ran while the lookup was stuck

"""``kvindex.api.client`` against a real ``kvindex serve`` on loopback (events over real
ZMQ), and its retry rules against a real HTTP server that fails on purpose."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest

from kvindex.api.client import (
    ApiError,
    AsyncClient,
    Client,
    NoCapacity,
    Retries,
    Unreachable,
)
from kvindex.api.http.schemas import RouteRequest, RouteResponse
from kvindex.api.testing import ServeProcess, free_port
from kvindex.events.ingest.testing import wait_until
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig

MODEL = "acme/client-7b"
TOKENS = list(range(2000, 2000 + 16 * 8))
POD_A, POD_B = "127.0.0.1:18001", "127.0.0.1:18002"  # never dialled: no /metrics needed


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    bind = free_port()
    server = ServeProcess(
        "--zmq-bind", f"tcp://127.0.0.1:{bind}", "--model", MODEL, "--load-timeout", "0.2",
        env={**os.environ},
    )  # fmt: skip
    try:
        server.wait_ready(20.0)
        with EnginePublisher(f"tcp://127.0.0.1:{bind}", topic=f"kv@{POD_A}@{MODEL}") as pub:
            assert pub.wait_for_subscribers(1, 10.0)
            keys = BlockHasher(HashConfig()).keys(TOKENS)
            pub.publish([BlockStored(keys[:4], None, TOKENS[:64], 16)])
            with Client(server.url) as client:
                assert wait_until(
                    lambda: any(p.pod == POD_A for p in client.pods()), timeout_s=10.0, poll_s=0.05
                ), "pod A never indexed"
            yield server.url
    finally:
        server.stop()


def test_sync_client_scores_routes_and_releases(served: str) -> None:
    with Client(served, timeout=5.0) as client:
        score = client.score(model=MODEL, token_ids=TOKENS, pods=[POD_A, POD_B])
        assert [(p.pod, p.matched_blocks) for p in score.pods] == [(POD_A, 4), (POD_B, 0)]
        route = client.route(RouteRequest(model=MODEL, token_ids=TOKENS, pods=[POD_A, POD_B]))
        assert isinstance(route, RouteResponse)
        assert (route.pod, route.reason, route.prompt_blocks) == (POD_A, "prefix", 8)
        assert route.route_id  # the client named it before sending
        released = client.done(route.route_id)
        assert released is not None and released.pod == POD_A
        assert client.done(route.route_id) is None  # not open any more
        assert POD_A in [p.pod for p in client.pods()]
        with pytest.raises(ApiError) as refused:
            client.score(model=MODEL, token_ids=TOKENS, prompt="both")
        assert (refused.value.status, refused.value.code) == (400, "invalid_request")


def test_async_client_does_the_same(served: str) -> None:
    async def run() -> tuple[str, str, bool, int]:
        async with AsyncClient(served) as client:
            score = await client.score(model=MODEL, token_ids=TOKENS, pods=[POD_A])
            route = await client.route(
                model=MODEL, token_ids=TOKENS, pods=[POD_A, POD_B], request_id="async-1"
            )
            done = await client.done("async-1")
            return route.pod, route.route_id, done is not None, score.pods[0].matched_blocks

    assert asyncio.run(run()) == (POD_A, "async-1", True, 4)


class Scripted:
    """A real HTTP server answering each POST with the next scripted (status, headers,
    body), recording the bodies it got."""

    def __init__(self, answers: list[tuple[int, dict[str, str], bytes]]) -> None:
        self.answers, self.bodies = list(answers), []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                owner.bodies.append(self.rfile.read(length))
                status, headers, body = owner.answers.pop(0)
                self.send_response(status)
                for name, value in {"content-type": "application/json", **headers}.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # polled every 50 ms (the default 0.5 s is what each close() would wait)
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _error(code: str) -> bytes:
    return json.dumps({"error": code, "detail": "scripted"}).encode()


ROUTED = msgspec.json.encode(
    RouteResponse("r", POD_A, "prefix", MODEL, 16, 128, 8, [], [])
)  # the route_id is checked from the bodies sent, not from this answer

QUICK = Retries(attempts=3, backoff_s=0.001, max_backoff_s=0.01)


def test_route_is_retried_on_503_with_the_same_request_id() -> None:
    server = Scripted(
        [(503, {}, _error("backend_unavailable")), (502, {}, b"bad gateway"), (200, {}, ROUTED)]
    )
    try:
        with Client(server.url, retries=QUICK) as client:
            assert client.route(model=MODEL, token_ids=[1, 2]).pod == POD_A
    finally:
        server.close()
    ids = {json.loads(body)["request_id"] for body in server.bodies}
    assert len(server.bodies) == 3 and len(ids) == 1


def test_no_capacity_and_client_errors_are_not_retried() -> None:
    server = Scripted(
        [(429, {"retry-after": "2"}, _error("no_capacity")), (400, {}, _error("invalid_request"))]
    )
    try:
        with Client(server.url, retries=QUICK) as client:
            with pytest.raises(NoCapacity) as full:
                client.route(model=MODEL, token_ids=[1])
            assert full.value.retry_after == 2.0 and full.value.status == 429
            with pytest.raises(ApiError) as bad:
                client.score(model=MODEL, token_ids=[1])
            assert bad.value.code == "invalid_request"
    finally:
        server.close()
    assert len(server.bodies) == 2


def test_a_dead_server_is_unreachable_after_every_attempt() -> None:
    client = Client(f"http://127.0.0.1:{free_port()}", timeout=1.0, retries=QUICK)
    with client, pytest.raises(Unreachable, match="ConnectError"):
        client.pods()


def test_retries_are_validated() -> None:
    with pytest.raises(ValueError, match="attempts"):
        Retries(attempts=0)


def test_the_cli_scores_through_the_client(served: str) -> None:
    tokens = ",".join(map(str, TOKENS))
    argv = [
        sys.executable,
        "-m",
        "kvindex.api.serve.cli",
        "score",
        "--url",
        served,
        "--model",
        MODEL,
    ]
    shown = subprocess.run(
        [*argv, "--tokens", tokens, "--pod", POD_A, "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["pods"][0]["matched_blocks"] == 4
    refused = subprocess.run(
        [*argv, "--tokens", tokens, "--pod", "not a pod"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "HTTP 400 invalid_request" in refused.stderr

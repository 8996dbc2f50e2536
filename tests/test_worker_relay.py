"""A serving worker's relay (``api/serve/primary_relay.py``) against a real server on a Unix
socket: streamed answers pass chunk by chunk, headers and status as sent, and a client
that leaves mid-stream closes the relay's own connection, so the server sees it leave
(the gateway's signal to stop the pod's request)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from kvindex.api.serve.primary_relay import Relay


class StreamingUpstream:
    """An ASGI app that streams numbered chunks until its client leaves, and says so."""

    def __init__(self) -> None:
        self.left = threading.Event()
        self.seen: list[tuple[str, str, bytes, bytes]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = dict(scope["headers"])
        self.seen.append((scope["method"], scope["path"], scope["query_string"], body))
        await send(
            {
                "type": "http.response.start",
                "status": 207,
                "headers": [(b"content-type", b"text/event-stream"), (b"x-kvindex-pod", b"p1")]
                + ([(b"x-echo", headers[b"x-echo"])] if b"x-echo" in headers else []),
            }
        )
        gone = asyncio.ensure_future(receive())
        for n in range(200):
            if gone.done():
                self.left.set()
                return
            await send({"type": "http.response.body", "body": b"chunk %d\n" % n, "more_body": True})
            await asyncio.sleep(0.02)
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[tuple[StreamingUpstream, str]]:
    app = StreamingUpstream()
    path = str(tmp_path / "primary.sock")
    server = uvicorn.Server(uvicorn.Config(app, uds=path, log_config=None, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the upstream server did not start"
        time.sleep(0.02)
    try:
        yield app, path
    finally:
        server.should_exit = True
        thread.join(10)


def _scope(path: str, query: bytes = b"") -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": query,
        "headers": [(b"host", b"kvindex"), (b"x-echo", b"yes"), (b"connection", b"keep-alive")],
    }


def test_a_streamed_answer_is_relayed_chunk_by_chunk_with_its_status_and_headers(
    upstream: tuple[StreamingUpstream, str],
) -> None:
    app, path = upstream
    sent: list[dict[str, Any]] = []

    async def main() -> None:
        relay = Relay(path)
        inbox = [{"type": "http.request", "body": b'{"a": 1}', "more_body": False}]

        async def receive() -> dict[str, Any]:
            if inbox:
                return inbox.pop()
            await asyncio.sleep(3600)  # the client stays
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await asyncio.wait_for(relay(_scope("/v1/completions", b"x=1"), receive, send), 30)
        relay.primary.close()

    asyncio.run(main())
    assert app.seen == [("POST", "/v1/completions", b"x=1", b'{"a": 1}')]
    start = sent[0]
    assert start["status"] == 207
    headers = dict(start["headers"])
    assert headers[b"x-kvindex-pod"] == b"p1" and headers[b"x-echo"] == b"yes"
    chunks = [m["body"] for m in sent[1:] if m["body"]]
    assert len(chunks) > 10  # as they came, not gathered
    assert b"".join(chunks) == b"".join(b"chunk %d\n" % n for n in range(200))
    assert sent[-1] == {"type": "http.response.body", "body": b""}


def test_a_client_that_leaves_mid_stream_makes_the_relay_leave_too(
    upstream: tuple[StreamingUpstream, str],
) -> None:
    app, path = upstream
    bodies = 0

    async def main() -> None:
        relay = Relay(path)
        gone = asyncio.Event()
        inbox = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict[str, Any]:
            if inbox:
                return inbox.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal bodies
            if message["type"] == "http.response.body" and message["body"]:
                bodies += 1
                if bodies == 3:
                    gone.set()  # the client stops reading and closes

        await asyncio.wait_for(relay(_scope("/v1/completions"), receive, send), 30)
        relay.primary.close()

    asyncio.run(main())
    assert app.left.wait(10), "the upstream never saw the relay's connection close"
    assert bodies < 50


def test_an_unreachable_primary_is_a_503_in_kvindex_shape(tmp_path: Path) -> None:
    sent: list[dict[str, Any]] = []

    async def main() -> None:
        relay = Relay(str(tmp_path / "nobody.sock"))
        inbox = [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive() -> dict[str, Any]:
            return inbox.pop() if inbox else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await relay(_scope("/index/pods"), receive, send)
        relay.primary.close()

    asyncio.run(main())
    assert sent[0]["status"] == 503
    assert b'"error":"primary_unavailable"' in sent[1]["body"]

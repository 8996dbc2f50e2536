"""The ASGI hot path for /score and /route (api/http/hot_path.py): what FastAPI's routes did
for these paths still holds, and what a raw ASGI app must do itself (bodies in several
chunks, a client gone mid-body) is done.

Driven over the app's own ASGI interface: the messages are the contract with any server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvindex.api.http.app import create_app
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags


@pytest.fixture
def service() -> Iterator[Service]:
    service = Service(from_flags(model="m", max_body_bytes=4096))
    try:
        yield service
    finally:
        service.stop()


def metric(service: Service, name: str, labels: dict[str, str]) -> float:
    return service.registry.get_sample_value(name, labels) or 0.0


def call(
    app: Any, path: str, chunks: list[bytes], *, disconnect: bool = False, method: str = "POST"
) -> list[dict[str, Any]]:
    """One request through the ASGI app, its body in ``chunks`` (then a disconnect
    instead of the last chunk when ``disconnect``); the messages the app sent."""
    messages: list[dict[str, Any]] = [
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    ]
    if disconnect:
        messages[-1] = {"type": "http.disconnect"}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
    }
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    return sent


def answer(sent: list[dict[str, Any]]) -> tuple[int, dict[str, str], dict[str, Any]]:
    start, body = sent
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, json.loads(body["body"])


def test_a_body_in_several_chunks_is_read_whole(service: Service) -> None:
    app = create_app(service, manage_lifecycle=False)
    body = json.dumps({"model": "m", "token_ids": list(range(64))}).encode()
    status, headers, scores = answer(call(app, "/score", [body[:10], body[10:40], body[40:]]))
    assert status == 200, scores
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) > 0
    assert scores["prompt_tokens"] == 64 and scores["prompt_blocks"] == 4


def test_a_client_gone_mid_body_gets_no_answer_and_no_error_count(service: Service) -> None:
    app = create_app(service, manage_lifecycle=False)
    before = metric(service, "kvindex_score_requests_total", {"outcome": "internal_error"})
    sent = call(app, "/score", [b'{"model": "m", ', b""], disconnect=True)
    assert sent == []
    after = metric(service, "kvindex_score_requests_total", {"outcome": "internal_error"})
    assert after == before


def test_a_body_over_the_limit_in_chunks_is_a_413_counted_for_score(service: Service) -> None:
    app = create_app(service, manage_lifecycle=False)
    status, _, body = answer(call(app, "/score", [b" " * 3000, b" " * 3000, b"{}"]))
    assert status == 413 and body["error"] == "too_large"
    assert metric(service, "kvindex_score_requests_total", {"outcome": "too_large"}) == 1


def test_another_method_is_a_405_with_allow_and_counted(service: Service) -> None:
    app = create_app(service, manage_lifecycle=False)
    for path in ("/score", "/route", "/route/abc/done"):
        status, headers, body = answer(call(app, path, [b""], method="GET"))
        assert status == 405 and headers["allow"] == "POST"
        assert body == {"error": "method_not_allowed", "detail": f"GET is not allowed on {path}"}
    assert metric(service, "kvindex_score_requests_total", {"outcome": "method_not_allowed"}) == 1
    assert metric(service, "kvindex_http_refused_total", {"code": "method_not_allowed"}) == 2


def test_paths_near_the_hot_ones_still_reach_fastapi(service: Service) -> None:
    with TestClient(create_app(service, manage_lifecycle=False)) as client:
        for path in ("/route/done", "/route//done", "/scores", "/route/a/b/done"):
            got = client.post(path, content=b"{}")
            assert got.status_code == 404, path
            assert got.json()["error"] == "not_found"
        assert client.get("/healthz").json() == {"status": "ok"}


def test_a_trailing_slash_is_served_like_the_path(service: Service) -> None:
    with TestClient(create_app(service, manage_lifecycle=False)) as client:
        got = client.post("/route/nope/done/", follow_redirects=False)
        assert got.status_code == 404 and got.json()["error"] == "unknown_route"
        got = client.post("/route/nope/first-token", follow_redirects=False)
        assert got.status_code == 404 and got.json()["error"] == "unknown_route"
        got = client.post(
            "/score/", json={"model": "m", "token_ids": [1, 2]}, follow_redirects=False
        )
        assert got.status_code == 200 and got.json()["prompt_tokens"] == 2


def test_the_openapi_document_keeps_the_hot_operations(service: Service) -> None:
    with TestClient(create_app(service, manage_lifecycle=False)) as client:
        paths = client.get("/openapi.json").json()["paths"]
    operations = {
        path: item["post"]["operationId"] for path, item in paths.items() if "post" in item
    }
    assert operations == {
        "/score": "score_score_post",
        "/route": "route_route_post",
        "/route/{route_id}/first-token": "route_first_token_route__route_id__first_token_post",
        "/route/{route_id}/done": "route_done_route__route_id__done_post",
    }
    assert set(paths["/score"]["post"]["responses"]) == {
        "200", "400", "404", "408", "413", "415", "429", "503",
    }  # fmt: skip

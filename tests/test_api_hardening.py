"""Hostile and careless clients: the admin switch, limits, one error shape, OpenAPI, /docs.

In-process (ASGI) where the app alone decides; a real ``kvindex serve`` on loopback with
raw sockets where the server's own limits (slow headers, streamed bodies) are the subject.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvindex.api.http.app import create_app
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_derived import ConfigError, admin_token
from kvindex.api.serve.settings_sources import from_flags
from kvindex.api.testing import ServeProcess
from kvindex.events.wire.identity import IdentityError, normalize_pod


@contextmanager
def client_for(**settings: object) -> Iterator[TestClient]:
    """An app over a service that is never started, and stopped (its ZMQ context closed)."""
    service = Service(from_flags(**settings))
    try:
        with TestClient(create_app(service, manage_lifecycle=False)) as client:
            yield client
    finally:
        service.stop()


@pytest.fixture
def client() -> Iterator[TestClient]:
    with client_for(model="m", max_pods=8, max_body_bytes=4096) as c:
        yield c


# --- the admin switch -------------------------------------------------------------


def test_purge_is_refused_unless_an_admin_token_is_configured(client: TestClient) -> None:
    answer = client.delete("/index/pods/127.0.0.1:8000")
    assert answer.status_code == 403
    body = answer.json()
    assert body["error"] == "admin_token_unset"
    assert "KVINDEX_ADMIN_TOKEN" in body["detail"] and "--admin-token-file" in body["detail"]


def test_a_non_ascii_bearer_token_is_a_401_not_a_crash() -> None:
    with client_for(admin_token="s3cret") as c:
        for given in ("Bearer pässwörd".encode(), "Bearer s3crét".encode("latin-1")):
            answer = c.delete("/index/pods/127.0.0.1:8000", headers={"authorization": given})
            assert answer.status_code == 401, answer.text
            assert answer.json()["error"] == "unauthorized"
        ok = c.delete("/index/pods/127.0.0.1:8000", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 404 and ok.json()["error"] == "unknown_pod"


def test_a_non_ascii_admin_token_matches_its_utf8_bytes() -> None:
    with client_for(admin_token="pässwörd") as c:
        answer = c.delete(
            "/index/pods/127.0.0.1:8000", headers={"authorization": "Bearer pässwörd".encode()}
        )
    assert answer.status_code == 404  # authorised; the pod is unknown


def test_admin_token_from_a_file(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-file\n")
    assert admin_token(from_flags(admin_token_file=str(secret))) == "from-file"
    with client_for(admin_token_file=str(secret)) as c:
        denied = c.delete("/index/pods/127.0.0.1:8000", headers={"authorization": "Bearer x"})
        allowed = c.delete(
            "/index/pods/127.0.0.1:8000", headers={"authorization": "Bearer from-file"}
        )
    assert (denied.status_code, allowed.status_code) == (401, 404)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        admin_token(from_flags(admin_token_file=str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match="cannot read"):
        admin_token(from_flags(admin_token_file=str(tmp_path / "missing")))


def test_the_default_listen_address_is_loopback() -> None:
    assert from_flags().http.listen.startswith("127.0.0.1:")


# --- input that used to crash -----------------------------------------------------


@pytest.mark.parametrize(
    "port", ["\u00b2", "\u0668\u0660\u0660\u0660", "8000\u00b2", "\U0001d7ea\U0001d7e2"]
)
def test_non_ascii_digit_ports_are_refused(client: TestClient, port: str) -> None:
    with pytest.raises(IdentityError, match="ASCII"):
        normalize_pod(f"127.0.0.1:{port}")
    answer = client.get(f"/index/pods/127.0.0.1:{port}")
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "invalid_request"
    assert "ASCII" in answer.json()["detail"]


def test_deeply_nested_messages_are_a_400(client: TestClient) -> None:
    for depth, needle in ((100, "nested more than"), (1500, "nested too deeply")):
        content = "[" * depth + "]" * depth
        body = '{"model":"m","messages":[{"role":"user","content":' + content + "}]}"
        answer = client.post("/score", content=body, headers={"content-type": "application/json"})
        assert answer.status_code == 400, answer.text
        assert needle in answer.json()["detail"]


def test_pods_list_is_capped(client: TestClient) -> None:
    pods = [f"127.0.0.{i}:8000" for i in range(1, 10)]
    answer = client.post("/score", json={"model": "m", "token_ids": [1] * 16, "pods": pods})
    assert answer.status_code == 413
    assert answer.json()["error"] == "too_large" and "--max-pods" in answer.json()["detail"]
    fine = client.post("/score", json={"model": "m", "token_ids": [1] * 16, "pods": pods[:8]})
    assert fine.status_code == 200 and len(fine.json()["pods"]) == 8


def test_blocks_limit_is_capped(client: TestClient) -> None:
    answer = client.get("/index/pods/127.0.0.1:8000/blocks", params={"model": "m", "limit": 10**9})
    assert answer.status_code == 400 and "limit must be" in answer.json()["detail"]


def test_a_declared_oversized_body_is_refused_unread(client: TestClient) -> None:
    answer = client.post(
        "/score", content=b"x" * 5000, headers={"content-type": "application/json"}
    )
    assert answer.status_code == 413
    assert answer.json()["error"] == "too_large" and "--max-body-bytes" in answer.json()["detail"]


def test_non_json_content_type_is_a_415(client: TestClient) -> None:
    """Issue 30: a 415 says how to fix it; curl's ``-d`` default (form-urlencoded) is
    read as the JSON the user typed, as is a body with no Content-Type."""
    body = json.dumps({"model": "m", "token_ids": [1]})
    for media in ("text/plain", "multipart/form-data"):
        answer = client.post("/score", content=body, headers={"content-type": media})
        assert answer.status_code == 415, media
        assert answer.json()["error"] == "unsupported_media_type"
        assert "-H 'content-type: application/json'" in answer.json()["detail"]
    for media in (
        "application/json; charset=utf-8",
        "application/vnd.api+json",
        "application/x-www-form-urlencoded",
    ):
        answer = client.post("/score", content=body, headers={"content-type": media})
        assert answer.status_code == 200, media
    assert client.post("/score", content=body).status_code == 200


# --- one error shape -----------------------------------------------------------------


def test_framework_errors_use_kvindexs_shape(client: TestClient) -> None:
    cases = [
        (client.get("/nope"), 404, "not_found", "/nope"),
        (client.post("/healthz"), 405, "method_not_allowed", "POST"),
        (client.get("/index/pods/127.0.0.1:8000/blocks"), 400, "invalid_request", "model"),
        (
            client.get("/index/pods/127.0.0.1:8000/blocks", params={"model": "m", "limit": "x"}),
            400,
            "invalid_request",
            "limit",
        ),
    ]
    for answer, status, code, needle in cases:
        assert answer.status_code == status, answer.text
        assert set(answer.json()) == {"error", "detail"}, answer.text
        assert answer.json()["error"] == code and needle in answer.json()["detail"]
    metrics = client.get("/metrics").text
    assert 'kvindex_http_refused_total{code="not_found"} 1.0' in metrics
    assert 'kvindex_http_refused_total{code="invalid_request"} 2.0' in metrics


def test_openapi_lists_the_errors_that_occur_and_no_422(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    text = json.dumps(spec)
    assert '"422"' not in text and "HTTPValidationError" not in text
    score = spec["paths"]["/score"]["post"]["responses"]
    assert {"200", "400", "404", "408", "413", "415", "429", "503"} <= set(score)
    purge = spec["paths"]["/index/pods/{pod}"]["delete"]["responses"]
    assert {"401", "403", "404"} <= set(purge)
    error = score["404"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorBody"}
    assert "``" not in text, "raw reST in the OpenAPI descriptions"
    request = spec["components"]["schemas"]["ScoreRequest"]["properties"]
    assert all(field.get("description") for field in request.values()), request
    blocks = spec["paths"]["/index/pods/{pod}/blocks"]["get"]["parameters"]
    assert all(p.get("description") for p in blocks if p["name"] != "pod")


def test_docs_are_served_without_a_cdn(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    assert "cdn" not in page.text.lower() and "https://" not in page.text
    for asset in ("/docs/assets/swagger-ui-bundle.js", "/docs/assets/swagger-ui.css"):
        answer = client.get(asset)
        assert answer.status_code == 200 and len(answer.content) > 10_000, asset


# --- a real server, real slow sockets -------------------------------------------------


def _read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection; bounded."""
    sock.settimeout(timeout_s)
    chunks = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not data:
            return b"".join(chunks)
        chunks.append(data)
    raise AssertionError(f"connection still open after {timeout_s}s: {b''.join(chunks)!r}")


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    with ServeProcess(
        "--model", "m",
        "--zmq-bind", "tcp://127.0.0.1:0",
        "--max-body-bytes", "2000",
        "--header-timeout", "1",
        "--body-timeout", "1",
    ) as proc:  # fmt: skip
        proc.wait_ready(30.0)
        yield proc


@pytest.mark.slow
def test_slow_headers_are_cut_off(server: ServeProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        assert _read_until_closed(sock, 15.0) == b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        pass  # connects and says nothing: closed too (checked by the next request working)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        assert _read_until_closed(sock, 15.0) == b""
    assert server.answers("/healthz")


@pytest.mark.slow
def test_a_trickled_body_gets_408(server: ServeProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(
            b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"model"'
        )
        answer = _read_until_closed(sock, 15.0)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"error":"request_timeout"' in answer and b"--body-timeout" in answer


@pytest.mark.slow
def test_a_streamed_body_is_refused_past_the_limit(server: ServeProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(
            b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 1000
        sent, answer = 0, b""
        for _ in range(10_000):  # 10 MB if nothing stopped us; bounded
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
            sock.setblocking(False)
            try:
                answer = sock.recv(65536)
            except BlockingIOError:
                pass
            finally:
                sock.setblocking(True)
            if answer:
                break
        if not answer:
            answer = _read_until_closed(sock, 15.0)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    # Refused while streaming: the answer came long before the 10 MB were sent (what was
    # sent past the 2,000-byte limit sat in the loopback sockets' buffers).
    assert sent < 5_000_000


@pytest.mark.slow
def test_requests_past_max_in_flight_get_429() -> None:
    flags = ("--max-in-flight", "2", "--body-timeout", "20", "--zmq-bind", "tcp://127.0.0.1:0")
    with ServeProcess(*flags) as server:
        server.wait_ready(30.0)
        held = []
        try:
            for _ in range(2):  # two requests waiting for their bodies fill --max-in-flight
                sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                sock.sendall(
                    b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{"
                )
                held.append(sock)
            answer = b""
            for _ in range(50):  # until the server has taken both in; bounded
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
                    sock.sendall(
                        b"GET /index/pods HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                    )
                    answer = _read_until_closed(sock, 15.0)
                if not answer.startswith(b"HTTP/1.1 200"):
                    break
                time.sleep(0.1)
            assert answer.startswith(b"HTTP/1.1 429"), answer
            assert b"--max-in-flight" in answer
            assert server.answers("/healthz")  # probes are exempt
        finally:
            for sock in held:
                sock.close()

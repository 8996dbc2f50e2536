"""What the gateway does with a pod's answer, and with a client that leaves it, through a
running ``kvindex serve --gateway`` (one process, and a primary with a serving worker)
in front of a scripted pod: a raw HTTP/1.1 server on loopback that answers each request
as its ``x-scenario`` header says and records when the gateway closes the connection
(issue 26, item 8; and what ``kvindex_gateway_added_seconds`` measures, item 11).

- A client that disconnects before the pod answered, mid-stream, or during a sized
  answer that arrives slowly makes the gateway close its pod connection at once (vLLM
  aborts a request whose connection closes); before, only a stream was watched, and the
  pod connection was held until the read timeout (600 s).
- Only allowlisted pod headers reach the client; hop-by-hop ones never do.
- A pod's error reaches the client in OpenAI's error shape under the pod's status, not
  as the pod's raw body.
- ``kvindex_gateway_added_seconds`` leaves out the pod's time to answer.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port
from tests.support.lazy import LazyModule
from tests.test_load import DP1_IDLE

openai = LazyModule("openai", reason="the gateway tests need the test extra (openai)")

pytestmark = pytest.mark.slow

MODEL = "acme/scripted"
# The bound: the pod sees its client leave within this of the client leaving.
PROPAGATION_S = 1.0
# How long the slow pod takes before answering (the time the metric must leave out).
POD_WAIT_S = 1.0
_POLL_S = 0.05
_LIMIT_S = 30.0  # no scripted exchange outlives this


class Exchange:
    """One request the pod received, and what became of its connection."""

    def __init__(self) -> None:
        self.received = threading.Event()
        self.progressed = threading.Event()  # the first part of the answer was sent
        self.closed = threading.Event()  # the gateway closed the connection


class ScriptedPod:
    """A pod on ``127.0.0.1:<port>`` answering ``POST`` requests by their ``x-scenario``
    header (see :meth:`_answer`), ``GET /metrics`` with vLLM 0.33's idle page. Each
    request's :class:`Exchange` is found by its ``x-exchange`` header."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self.pod = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._exchanges: dict[str, Exchange] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def exchange(self, key: str) -> Exchange:
        with self._lock:
            return self._exchanges.setdefault(key, Exchange())

    def close(self) -> None:
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(_POLL_S)
        pending = b""
        with conn:
            while not self._stopping.is_set():
                request, pending = self._read_request(conn, pending)
                if request is None:
                    return
                method, path, headers, _body = request
                if method == "GET" and path == "/metrics":
                    page = DP1_IDLE.encode()
                    conn.sendall(_head(200, "text/plain; version=0.0.4", len(page)) + page)
                    continue
                exchange = self.exchange(headers.get("x-exchange", ""))
                exchange.received.set()
                if not self._answer(conn, headers.get("x-scenario", ""), exchange):
                    return

    def _read_request(
        self, conn: socket.socket, pending: bytes
    ) -> tuple[tuple[str, str, dict[str, str], bytes] | None, bytes]:
        deadline = time.monotonic() + _LIMIT_S
        while b"\r\n\r\n" not in pending or len(pending) < _request_length(pending):
            if self._stopping.is_set() or time.monotonic() > deadline:
                return None, b""
            try:
                data = conn.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return None, b""
            if not data:
                return None, b""
            pending += data
        length = _request_length(pending)
        head, body = pending[:length].split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return (method, path, headers, body), pending[length:]

    def _answer(self, conn: socket.socket, scenario: str, exchange: Exchange) -> bool:
        """Answer one request as ``scenario`` says; False when the connection is done."""
        if scenario == "hold":  # no answer: waits for the gateway to give up
            self._watch_close(conn, exchange)
            return False
        if scenario == "stream":  # events every 50 ms until the gateway closes
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            deadline = time.monotonic() + _LIMIT_S
            while time.monotonic() < deadline and not self._stopping.is_set():
                event = b'data: {"choices": [{"text": "w "}]}\n\n'
                try:
                    conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                except OSError:
                    exchange.closed.set()
                    return False
                exchange.progressed.set()
                if self._watch_close(conn, exchange, _POLL_S):
                    return False
            return False
        if scenario == "slow-sized":  # the head and a first part of a sized body
            conn.sendall(_head(200, "application/json", 100) + b'{"id": "x"')
            exchange.progressed.set()
            self._watch_close(conn, exchange)
            return False
        if scenario == "slow-whole":  # the whole answer, after the "generation"
            self._stopping.wait(POD_WAIT_S)  # the pod's time, injected
            conn.sendall(_head(200, "application/json", 2) + b"{}")
            return True
        if scenario == "headers":
            body = b'{"id": "cmpl-1", "choices": []}'
            conn.sendall(
                b"HTTP/1.1 200 OK\r\n"
                b"content-type: application/json\r\n"
                b"content-length: %d\r\n"
                b"connection: keep-alive, x-foo\r\n"
                b"keep-alive: timeout=5\r\n"
                b"x-foo: hop-by-hop by the connection header\r\n"
                b"x-pod-secret: s3cr3t\r\n"
                b"server: pod-internal/1.0\r\n"
                b"x-kvindex-pod: 127.0.0.99:8000\r\n"
                b"x-request-id: req-42\r\n"
                b"openai-processing-ms: 17\r\n"
                b"x-ratelimit-remaining-requests: 99\r\n"
                b"\r\n%s" % (len(body), body)
            )
            return True
        if scenario == "error-500":
            body = b'Traceback (most recent call last):\n  File "/srv/internal/secret.py"\n'
            conn.sendall(_head(500, "text/plain", len(body)) + body)
            return True
        if scenario == "error-400":  # vLLM's own error shape
            body = json.dumps(
                {
                    "error": {
                        "message": "max_tokens is too large: this model's context is 4096",
                        "type": "BadRequestError",
                        "param": "max_tokens",
                        "code": 400,
                    },
                    "internal": "/srv/internal/secret.py",
                }
            ).encode()
            conn.sendall(_head(400, "application/json", len(body)) + body)
            return True
        body = b'{"id": "cmpl-ok", "choices": []}'
        conn.sendall(_head(200, "application/json", len(body)) + body)
        return True

    def _watch_close(
        self, conn: socket.socket, exchange: Exchange, for_s: float = _LIMIT_S
    ) -> bool:
        """Wait up to ``for_s`` for the peer to close; True (and ``closed`` set) if it did."""
        deadline = time.monotonic() + for_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            try:
                if conn.recv(65536) == b"":
                    exchange.closed.set()
                    return True
            except TimeoutError:
                continue
            except OSError:
                exchange.closed.set()
                return True
        return False


def _head(status: int, content_type: str, length: int) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 500: "Internal Server Error"}[status]
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


def _request_length(pending: bytes) -> int:
    """The length of the request at the start of ``pending`` (head, body), once its head
    is in."""
    head, sep, _ = pending.partition(b"\r\n\r\n")
    if not sep:
        return 1 << 62
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return len(head) + 4 + length


class Gateway:
    def __init__(self, server: ServeProcess, pod: ScriptedPod) -> None:
        self.server, self.pod = server, pod

    def body(self, **extra: object) -> dict[str, object]:
        return {"model": MODEL, "prompt": list(range(1, 40)), "max_tokens": 4, **extra}

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.server.url}/v1", api_key="none", max_retries=0, timeout=30
        )

    def metric(self, line: str) -> float:
        for sample in httpx.get(f"{self.server.url}/metrics", timeout=5).text.splitlines():
            if sample.startswith(line + " "):
                return float(sample.rsplit(" ", 1)[1])
        return 0.0

    def leave(self, scenario: str, when: Callable[[Exchange], threading.Event]) -> Exchange:
        """Send a request with ``scenario`` over a raw socket and close it as soon as the
        pod's ``when(exchange)`` event is set; the exchange."""
        key = uuid.uuid4().hex
        exchange = self.pod.exchange(key)
        body = json.dumps(self.body(stream=scenario == "stream")).encode()
        host, port = self.server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nhost: kvindex\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n"
                b"x-scenario: %s\r\nx-exchange: %s\r\n\r\n%s"
                % (len(body), scenario.encode(), key.encode(), body)
            )
            assert when(exchange).wait(10), f"the pod never got to {scenario!r}"
        return exchange


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "with-worker"])
def gateway(request: pytest.FixtureRequest) -> Iterator[Gateway]:
    pod = ScriptedPod()
    server = ServeProcess(
        "--gateway", "--zmq-bind", f"tcp://127.0.0.1:{free_port()}",
        "--pod-role", f"{pod.pod}=both", "--processes", request.param,
        env={**os.environ},
    )  # fmt: skip
    try:
        server.wait_ready(30.0)
        gateway = Gateway(server, pod)

        def answered() -> bool:
            answer = httpx.post(f"{server.url}/v1/completions", json=gateway.body(), timeout=5)
            return answer.status_code == 200 and answer.headers["x-kvindex-pod"] == pod.pod

        eventually(answered, "the scripted pod answering through the gateway")
        yield gateway
    finally:
        server.stop()
        pod.close()


@pytest.mark.parametrize(
    ("scenario", "when"),
    [
        # before the pod's headers: a non-streamed answer comes whole, after generation
        ("hold", lambda exchange: exchange.received),
        ("stream", lambda exchange: exchange.progressed),
        ("slow-sized", lambda exchange: exchange.progressed),
    ],
    ids=["before-headers", "mid-stream", "mid-sized-answer"],
)
def test_a_client_that_leaves_closes_the_pod_connection_at_once(
    gateway: Gateway, scenario: str, when: Callable[[Exchange], threading.Event]
) -> None:
    left = gateway.metric('kvindex_gateway_requests_total{outcome="client_left"}')
    exchange = gateway.leave(scenario, when)
    assert exchange.closed.wait(PROPAGATION_S), "the pod connection outlived the client"
    eventually(
        lambda: gateway.metric('kvindex_gateway_requests_total{outcome="client_left"}') == left + 1,
        "the request counted as client_left",
    )


def test_only_allowlisted_pod_headers_reach_the_client(gateway: Gateway) -> None:
    answer = httpx.post(
        f"{gateway.server.url}/v1/completions",
        json=gateway.body(),
        headers={"x-scenario": "headers"},
        timeout=10,
    )
    assert answer.status_code == 200
    assert answer.json()["id"] == "cmpl-1"
    headers = answer.headers
    for dropped in ("x-pod-secret", "x-foo", "keep-alive"):
        assert dropped not in headers, dropped
    assert "pod-internal" not in headers.get("server", "")
    assert headers.get_list("x-kvindex-pod") == [gateway.pod.pod]  # not the pod's claim
    assert headers["x-request-id"] == "req-42"
    assert headers["openai-processing-ms"] == "17"
    assert headers["x-ratelimit-remaining-requests"] == "99"
    assert headers["content-type"] == "application/json"


def test_a_pod_error_reaches_the_client_in_openai_shape_without_its_body(
    gateway: Gateway,
) -> None:
    answer = httpx.post(
        f"{gateway.server.url}/v1/completions",
        json=gateway.body(),
        headers={"x-scenario": "error-500"},
        timeout=10,
    )
    assert answer.status_code == 500
    assert b"secret" not in answer.content and b"Traceback" not in answer.content
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 500 and error["type"] == "pod_error"
    client = gateway.openai()
    with pytest.raises(openai.InternalServerError) as failed:
        client.completions.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=2, extra_headers={"x-scenario": "error-500"}
        )
    assert f"the pod {gateway.pod.pod} failed the request (HTTP 500)" in str(failed.value)
    # A 4xx in vLLM's shape keeps what it tells the client about its request.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model=MODEL, prompt=[1, 2, 3], max_tokens=2, extra_headers={"x-scenario": "error-400"}
        )
    assert "max_tokens is too large" in str(refused.value)
    assert refused.value.body == {
        "message": "max_tokens is too large: this model's context is 4096",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }


def test_added_seconds_leaves_out_the_pods_time(gateway: Gateway) -> None:
    count = gateway.metric("kvindex_gateway_added_seconds_count")
    total = gateway.metric("kvindex_gateway_added_seconds_sum")
    answer = httpx.post(
        f"{gateway.server.url}/v1/completions",
        json=gateway.body(),
        headers={"x-scenario": "slow-whole"},
        timeout=30,
    )
    assert answer.status_code == 200
    eventually(
        lambda: gateway.metric("kvindex_gateway_added_seconds_count") == count + 1,
        "the request's added time observed",
    )
    added = gateway.metric("kvindex_gateway_added_seconds_sum") - total
    assert 0 < added < POD_WAIT_S / 2, added

"""SIGTERM to a running ``kvindex serve``: a bounded drain, readiness that fails as it
starts, the snapshot written before it, leases released within it.

Real processes, real HTTP, real ZMQ, a real redis-server. The pods are loopback TCP
servers: one that accepts and never answers (a hung pod: the gateway waits for it up to
``--gateway-read-timeout``, 600 s), one that answers when the test lets it. Every wait
is bounded; the bound on the process's exit is what the tests assert.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.memory.snapshot_file import read_snapshot
from tests.redis_fixtures import RedisServer
from tests.test_api import make_tokenizer
from tests.test_redis_event_loop import HungServer

pytestmark = pytest.mark.slow

MODEL = "acme/shutdown-7b"
KEYS = list(range(7_000, 7_008))
DRAIN_S = 3
#: How long past the drain a process may take to stop ingest, write the final snapshot,
#: release its leases and stop its serving workers.
MARGIN_S = 10


def complete(url: str) -> httpx.Response:
    """One non-streamed completion through the gateway (token ids: no tokenizer needed)."""
    body = {"model": MODEL, "prompt": list(range(1, 33)), "max_tokens": 1}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def posted_to(hung: HungServer) -> bool:
    """Whether a completion request has reached the hung pod (it reads nothing: peek)."""
    for conn in list(hung.accepted):
        try:
            if b"POST /v1/completions" in conn.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return True
        except OSError:
            continue
    return False


def log_lines(server: ServeProcess) -> list[str]:
    return server.log_path.read_text(errors="replace").splitlines()


def first_index(lines: list[str], text: str) -> int:
    return next(i for i, line in enumerate(lines) if text in line)


def blocks_of(url: str, pod: str) -> list[int] | None:
    answer = httpx.get(f"{url}/index/pods/{pod}/blocks", params={"model": MODEL}, timeout=5)
    return answer.json()["blocks"].get(pod) if answer.status_code == 200 else None


@pytest.fixture(autouse=True)
def model_tokenizer(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    """MODEL's tokenizer, for every kvindex here (KVINDEX_MODEL_CONFIG is inherited): a
    gateway without its model's tokenizer is not ready."""
    directory = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(directory)
    config = directory / "kvindex.json"
    config.write_text(json.dumps({"models": {MODEL: {"tokenizer": str(directory)}}}))
    monkeypatch.setenv("KVINDEX_MODEL_CONFIG", str(config))


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


@pytest.fixture
def hung() -> Iterator[HungServer]:
    server = HungServer(free_port())
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def engine() -> Iterator[EnginePublisher]:
    publisher = EnginePublisher(f"tcp://127.0.0.1:{free_port()}", bind=True)
    try:
        yield publisher
    finally:
        publisher.close()


def hung_pod_flags(hung: HungServer, engine: EnginePublisher) -> list[str]:
    """The gateway, with the hung server as the one pod it knows, whose events come
    from ``engine``."""
    pod = f"127.0.0.1:{hung.listener.getsockname()[1]}"
    return [
        "--gateway", "--model", MODEL,
        "--zmq-connect", f"{pod}@{MODEL}={engine.endpoint}",
        "--drain-timeout", str(DRAIN_S), "--log-format", "json",
    ]  # fmt: skip


def index_and_hang(
    server: ServeProcess,
    hung: HungServer,
    engine: EnginePublisher,
    pool: ThreadPoolExecutor,
    subscribers: int = 1,
) -> Future[httpx.Response]:
    """The pod's blocks indexed, then a gateway request stuck on the hung pod."""
    pod = f"127.0.0.1:{hung.listener.getsockname()[1]}"
    server.wait_ready(30.0)
    assert engine.wait_for_subscribers(subscribers, 10.0)
    engine.publish([BlockStored(KEYS, None, [], 16)])
    eventually(lambda: blocks_of(server.url, pod) == KEYS, "the pod's blocks indexed")
    stuck = pool.submit(complete, server.url)
    eventually(lambda: posted_to(hung), "the completion request at the hung pod")
    return stuck


@pytest.mark.parametrize("processes", ["1", "2"], ids=["one-process", "with-worker"])
def test_a_request_on_a_hung_pod_is_cut_at_the_drain_timeout_after_the_snapshot(
    tmp_path: Path,
    hung: HungServer,
    engine: EnginePublisher,
    pool: ThreadPoolExecutor,
    processes: str,
) -> None:
    """Before: uvicorn's graceful shutdown waited for the request without limit (the
    pod's read timeout, 600 s) and the final snapshot came after it, so SIGKILL at the
    end of Kubernetes' grace period lost it. Now the snapshot is written as the drain
    starts, and the request is cut when the drain timeout ends."""
    snapshot = tmp_path / "kvindex.snap"
    flags = hung_pod_flags(hung, engine)
    flags += ["--snapshot", str(snapshot), "--snapshot-interval", "0"]  # only at shutdown
    with ServeProcess(*flags, "--processes", processes, log_path=tmp_path / "serve.log") as server:
        stuck = index_and_hang(server, hung, engine, pool)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=DRAIN_S + MARGIN_S) == 0, server.log_tail()
        answer = stuck.result(timeout=MARGIN_S)  # cut: an error answer, not a hang
        assert answer.status_code >= 500
        lines = log_lines(server)
        # The snapshot was written when the drain began, before the request was cut.
        assert first_index(lines, "wrote snapshot") < first_index(lines, "still in flight")
        cut = json.loads(lines[first_index(lines, "still in flight")])
        assert "cutting 1 request(s) still in flight" in cut["msg"], cut

    pod = f"127.0.0.1:{hung.listener.getsockname()[1]}"
    assert [s["pod"] for s in read_snapshot(snapshot)["streams"]] == [pod]
    with ServeProcess(*flags, log_path=tmp_path / "restarted.log") as restarted:
        restarted.wait_ready(30.0)
        assert blocks_of(restarted.url, pod) == KEYS  # restored from the file


class HeldPod:
    """A pod on loopback that answers ``/metrics`` at once and a completion when
    :attr:`release` is set (``asked`` tells the request arrived). With ``stall_mid_stream``
    it answers at once with a stream's headers and first event, then stalls."""

    ANSWER = json.dumps(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": "late but whole", "finish_reason": "length"}],
        }
    ).encode()

    FIRST_EVENT = b'data: {"choices": [{"index": 0, "text": "first"}]}\n\n'

    def __init__(self, *, stall_mid_stream: bool = False) -> None:
        self.stall_mid_stream = stall_mid_stream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.pod = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.asked = threading.Event()
        self.release = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            thread = threading.Thread(target=self._answer, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                if head.startswith(b"POST") and self.stall_mid_stream:
                    event = self.FIRST_EVENT
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event)
                    )
                    self.asked.set()
                    self.release.wait(30)
                    return
                if head.startswith(b"POST"):
                    self.asked.set()
                    if not self.release.wait(30) or self._stop.is_set():
                        return
                    body = self.ANSWER
                else:  # /metrics: an empty page (load unknown)
                    body = b""
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
                )
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self.release.set()
        self.listener.close()
        for thread in self._threads:
            thread.join(timeout=5)


@pytest.mark.parametrize("processes", ["1", "2"], ids=["one-process", "with-worker"])
def test_readiness_fails_at_sigterm_while_a_slow_request_finishes(
    tmp_path: Path, pool: ThreadPoolExecutor, processes: str
) -> None:
    """Before: SIGTERM closed the listener at once, so no probe could see a failing
    readiness, and nothing said the process was going away. Now /readyz answers 503 as
    the drain starts, /healthz stays 200, and the request in flight completes."""
    pod = HeldPod()
    try:
        with ServeProcess(
            "--gateway", "--model", MODEL, "--pod-role", f"{pod.pod}=both",
            "--zmq-bind", f"tcp://127.0.0.1:{free_port()}",
            "--drain-timeout", "60", "--processes", processes,
            log_path=tmp_path / "serve.log",
        ) as server:  # fmt: skip
            server.wait_ready(30.0)
            slow = pool.submit(complete, server.url)
            eventually(pod.asked.is_set, "the completion request at the pod")
            server.process.send_signal(signal.SIGTERM)

            def unready() -> bool:
                answer = httpx.get(f"{server.url}/readyz", timeout=5)
                return answer.status_code == 503 and "shutting down" in answer.text

            eventually(unready, "/readyz to fail while draining")
            assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
            assert not slow.done()
            pod.release.set()
            answer = slow.result(timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == "late but whole"
            assert server.process.wait(timeout=MARGIN_S) == 0, server.log_tail()
            assert "still in flight" not in server.log_tail(100_000)  # nothing was cut
    finally:
        pod.close()


def first_event_then_the_end(url: str) -> tuple[bytes, str]:
    """A streamed completion: the first event, then how the stream ended."""
    body = {"model": MODEL, "prompt": list(range(1, 33)), "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as answer:
        chunks = answer.iter_raw()
        first = next(chunks)
        try:
            for _ in chunks:
                pass
        except httpx.HTTPError as exc:
            return first, type(exc).__name__
        return first, "closed"


def test_a_stream_stalled_mid_answer_is_cut_at_the_drain_timeout(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """The pod sent the stream's first event, then nothing: before, the drain waited
    for the rest (up to the 600 s read timeout); now the stream is cut at the bound."""
    pod = HeldPod(stall_mid_stream=True)
    try:
        with ServeProcess(
            "--gateway", "--model", MODEL, "--pod-role", f"{pod.pod}=both",
            "--zmq-bind", f"tcp://127.0.0.1:{free_port()}",
            "--drain-timeout", str(DRAIN_S), log_path=tmp_path / "serve.log",
        ) as server:  # fmt: skip
            server.wait_ready(30.0)
            streaming = pool.submit(first_event_then_the_end, server.url)
            eventually(pod.asked.is_set, "the stream's first event sent")
            server.process.send_signal(signal.SIGTERM)
            assert server.process.wait(timeout=DRAIN_S + MARGIN_S) == 0, server.log_tail()
            first, ended = streaming.result(timeout=MARGIN_S)
            assert HeldPod.FIRST_EVENT in first
            assert ended == "RemoteProtocolError"  # cut: visibly incomplete, not a clean end
            assert "cutting 1 request(s) still in flight" in server.log_tail(100_000)
    finally:
        pod.close()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", appendonly=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_redis_leases_are_released_within_the_drain_timeout(
    tmp_path: Path,
    redis: RedisServer,
    hung: HungServer,
    engine: EnginePublisher,
    pool: ThreadPoolExecutor,
) -> None:
    """docs/redis.md: "A replica shutting down cleanly writes its final positions and releases
    its leases". Before, a request on a hung pod held the shutdown past any grace
    period, so the lease only expired; now it is released once the drain is cut."""
    pod = f"127.0.0.1:{hung.listener.getsockname()[1]}"
    lease = f"kvtest-shutdown:stream:{{{pod}}}:lease"
    position = f"kvtest-shutdown:stream:{{{pod}}}:pos"
    client = redis.client()
    with ServeProcess(
        *hung_pod_flags(hung, engine),
        "--backend", redis.url, "--redis-prefix", "kvtest-shutdown", "--replica-id", "replica-a",
        log_path=tmp_path / "serve.log",
    ) as server:  # fmt: skip
        stuck = index_and_hang(server, hung, engine, pool)
        assert client.get(lease) == b"replica-a"
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=DRAIN_S + MARGIN_S) == 0, server.log_tail()
        assert stuck.result(timeout=MARGIN_S).status_code >= 500
    assert client.get(lease) is None  # released, not left to expire
    assert client.get(position) == b"0"  # the final position: the one batch, seq 0

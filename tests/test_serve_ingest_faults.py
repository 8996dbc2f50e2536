"""Hostile event input and dead ingest threads, through a running ``kvindex serve``.

One message's error is that message's (counted by reason; the next valid batch applies),
never the ingest thread's; a seq no engine reaches is a restart, not 1.8e19 missed
batches; and an ingest thread that dies anyway is loud: /healthz fails with the reason,
every /score warns, and the process exits non-zero (kvindex.api.serve.cli's
INGEST_STOPPED_EXIT) for the orchestrator to restart it.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvindex.api.serve.cli import EXIT_AFTER_INGEST_STOPPED_S, INGEST_STOPPED_EXIT
from kvindex.api.testing import ServeProcess, eventually, free_port
from kvindex.events.wire.endpoints import from_source
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored

pytestmark = pytest.mark.slow

MODEL = "acme/chat-7b"
POD = "127.0.0.1:8000"
#: The reproducer of issue 26: a BlockStored nested 1,000 arrays deep (1,025 bytes), on
#: which msgspec raised RecursionError and the receiver thread died.
NESTED_1000_DEEP = (
    b"\x92\xcb\x41\xd0" + bytes(6) + b"\x91\x92\xabBlockStored" + b"\x91" * 1000 + b"\x01"
)
#: The model whose batches the fault-injecting serve (below) fails on.
FAULT_MODEL = "fault/injected"


def chain(seed: int, n: int = 8) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(63) for _ in range(n)]


#: How long kvindex may take to subscribe after its health probe answers: a build without
#: the C modules, with two serving processes on a busy machine, once took over 10 s (the
#: wait ends as soon as it subscribes).
SUBSCRIBED_S = 30.0


def matched(url: str, hashes: list[int]) -> int:
    with httpx.Client(base_url=url, timeout=10) as client:  # a fresh connection each time
        reply = client.post("/score", json={"model": MODEL, "block_hashes": hashes})
    assert reply.status_code == 200, reply.text
    pods = {p["pod"]: p["matched_blocks"] for p in reply.json()["pods"]}
    return pods.get(POD, 0)


def metric(url: str, name: str, labels: str = "") -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    return 0.0


def stream_of(url: str) -> dict:
    report = httpx.get(f"{url}/index/pods/{POD}", timeout=10).json()
    (stream,) = report["streams"]
    return stream


class Engine:
    """One engine's PUB socket, in bind mode (kvindex binds; the engine connects from its
    own address and names itself in the topic) or connect mode (the engine binds)."""

    def __init__(self, mode: str, model: str = MODEL) -> None:
        self.mode = mode
        if mode == "bind":
            self.kvindex_endpoint = f"tcp://127.0.0.1:{free_port()}"
            self.flags = ["--zmq-bind", self.kvindex_endpoint, "--model", MODEL]
            self.pub = EnginePublisher(
                from_source(self.kvindex_endpoint, "127.0.0.1"), topic=f"kv@{POD}@{model}"
            )
        else:
            self.pub = EnginePublisher(f"tcp://127.0.0.1:{free_port()}", bind=True)
            self.flags = ["--zmq-connect", f"{POD}@{model}={self.pub.endpoint}", "--model", MODEL]

    def store(self, hashes: list[int]) -> None:
        self.pub.publish([BlockStored(hashes, None, [], 16)])

    def close(self) -> None:
        self.pub.close()


@pytest.fixture(params=["bind", "connect"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    engine = Engine(request.param)
    yield engine
    engine.close()


def serve(tmp_path: Path, *flags: str, command: list[str] | None = None) -> ServeProcess:
    server = ServeProcess(*flags, command=command, log_path=tmp_path / "serve.log")
    try:
        server.wait_ready(30.0, path="/healthz")
    except BaseException:
        server.stop()
        raise
    return server


@pytest.mark.parametrize("processes", [1, 2])
def test_a_deeply_nested_batch_is_counted_and_the_next_one_applied(
    tmp_path: Path, engine: Engine, processes: int
) -> None:
    before, after = chain(1), chain(2)
    with serve(tmp_path, *engine.flags, "--processes", str(processes)) as server:
        assert engine.pub.wait_for_subscribers(1, timeout_s=SUBSCRIBED_S)
        engine.store(before)
        eventually(lambda: matched(server.url, before) == len(before), "the first batch")
        engine.pub.publish_payload(NESTED_1000_DEEP)
        engine.store(after)
        eventually(lambda: matched(server.url, after) == len(after), "the batch after it")
        errors = "kvindex_event_errors_total"
        assert metric(server.url, errors, '{reason="too_deeply_nested"}') == 1
        assert httpx.get(server.url + "/healthz", timeout=10).json() == {"status": "ok"}
        stream = stream_of(server.url)
        if engine.mode == "connect":  # one socket, one engine: consumed, in sequence
            assert stream["state"] == "live" and stream["decode_errors"] == 1
        else:  # bind mode: dropped before its stream is known; a gap (no replay here)
            assert stream["state"] == "gapped" and stream["missed_batches"] == 1
        assert "thread failed" not in server.log_tail(100_000)


def test_seq_2_to_the_64_is_a_restart_not_missed_batches(tmp_path: Path, engine: Engine) -> None:
    before, hostile, after = chain(1), chain(3), chain(2)
    with serve(tmp_path, *engine.flags) as server:
        assert engine.pub.wait_for_subscribers(1, timeout_s=SUBSCRIBED_S)
        engine.store(before)
        eventually(lambda: matched(server.url, before) == len(before), "the first batch")
        topic = engine.pub.topic.encode()
        payload = engine.pub.encode([BlockStored(hostile, None, [], 16)])
        engine.pub.send_frames([topic, (2**64 - 1).to_bytes(8, "big"), payload])
        engine.store(after)  # seq 1: the engine goes on as if nothing happened
        eventually(lambda: matched(server.url, after) == len(after), "the batch after it")
        stream = stream_of(server.url)
        assert stream["missed_batches"] == 0
        assert metric(server.url, "kvindex_missed_batches_total") == 0
        # 2**64 - 1 read as a new engine (its entries cleared), then seq 1 as another:
        # what kvindex held before is gone, and the stream says its history is missing.
        assert stream["restarts"] == 2
        assert matched(server.url, before) == 0 and matched(server.url, hostile) == 0
        assert stream["state"] == "incomplete"


# -- a dead ingest thread --------------------------------------------------------------

#: ``kvindex serve`` with one fault injected at an ingest thread's top level (below every
#: per-message guard, where no input reaches any more): a batch of FAULT_MODEL makes the
#: receiver's hand-off to the applier raise, or the applier's loop raise after it.
FAULTY_SERVE = f"""
import sys
from kvindex.api.serve.cli import main
from kvindex.events.ingest.applier import Applier
from kvindex.events.ingest.inbox import Inbox

target = sys.argv.pop(1)
armed = []
put_arrivals, evict_idle = Inbox.put_arrivals, Applier._evict_idle

def faulty_put_arrivals(self, arrivals):
    if any(a.model == {FAULT_MODEL!r} for a in arrivals):
        if target == "receiver":
            raise RuntimeError("injected fault in the receiver")
        armed.append(True)
    return put_arrivals(self, arrivals)

def faulty_evict_idle(self):
    if armed:
        raise RuntimeError("injected fault in the applier")
    return evict_idle(self)

Inbox.put_arrivals, Applier._evict_idle = faulty_put_arrivals, faulty_evict_idle
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    ("thread", "processes"), [("receiver", 1), ("applier", 1), ("receiver", 2)]
)
def test_a_dead_ingest_thread_fails_healthz_warns_and_exits(
    tmp_path: Path, thread: str, processes: int
) -> None:
    engine = Engine("connect")
    faulty = EnginePublisher(f"tcp://127.0.0.2:{free_port()}", bind=True)  # another pod
    flags = [
        *engine.flags,
        "--zmq-connect", f"127.0.0.2:8000@{FAULT_MODEL}={faulty.endpoint}",
        "--processes", str(processes),
    ]  # fmt: skip
    command = [sys.executable, "-c", FAULTY_SERVE, thread, "serve"]
    before = chain(1)
    server = serve(tmp_path, *flags, command=command)
    try:
        assert engine.pub.wait_for_subscribers(1, timeout_s=SUBSCRIBED_S)
        assert faulty.wait_for_subscribers(1, timeout_s=SUBSCRIBED_S)
        engine.store(before)
        eventually(lambda: matched(server.url, before) == len(before), "the first batch")
        faulty.publish([BlockStored(chain(9), None, [], 16)])

        def healthz_fails() -> bool:
            answer = httpx.get(server.url + "/healthz", timeout=10)
            return answer.status_code == 503

        eventually(healthz_fails, "/healthz to fail")
        health = httpx.get(server.url + "/healthz", timeout=10).json()
        assert health["status"] == "failed"
        assert f"{thread} thread failed" in health["problems"][0]
        assert "injected fault" in health["problems"][0]

        def every_score_warns(requests: int = 8) -> bool:  # fresh connections: any process
            for _ in range(requests):
                with httpx.Client(base_url=server.url, timeout=10) as client:
                    body = {"model": MODEL, "block_hashes": before}
                    warnings = client.post("/score", json=body).json()["warnings"]
                if not any("ingestion stopped" in w for w in warnings):
                    return False
            return True

        eventually(every_score_warns, "every /score to warn")
        # Once the warning has reached every process it stays: no answer goes without it.
        assert every_score_warns(16)
        assert stream_of(server.url)["state"] == "stopped"
        exit_code = server.process.wait(timeout=EXIT_AFTER_INGEST_STOPPED_S + 30)
        assert exit_code == INGEST_STOPPED_EXIT
        log = server.log_tail(100_000)
        assert "KV-event ingestion stopped" in log and f"status {INGEST_STOPPED_EXIT}" in log
    finally:
        server.stop()
        engine.close()
        faulty.close()
        print(server.log_tail())  # shown when the test fails

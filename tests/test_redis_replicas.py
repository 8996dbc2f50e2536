"""Several `kvindex serve` processes sharing one Redis: real processes, real ZMQ, a real
redis-server of the test's own (so it can be killed and restarted).

* events flow to one replica, ``/score`` on another answers the same;
* the replica that owns a pod's stream is killed (SIGKILL): the other takes the stream
  over when the lease expires and replays what it missed from the pod's replay buffer;
* Redis restarts mid-ingest: 503s and unready while it is down, then recovery without
  restarting kvindex and without losing the batches published meanwhile.

Every wait has a deadline; nothing asserts on timing.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig
from tests.redis_fixtures import RedisServer

pytestmark = pytest.mark.slow

MODEL = "acme/chat-7b"
POD = "127.0.0.2:8000"
TOKENS = list(range(100, 100 + 16 * 40))
KEYS = BlockHasher(HashConfig()).keys(TOKENS)
LEASE_TTL_S = 2


class Replica(ServeProcess):
    """One `kvindex serve` replica on the shared Redis."""

    def __init__(self, name: str, redis_url: str, log_dir: Path, args: list[str]) -> None:
        self.name = name
        super().__init__(
            "--backend", redis_url,
            "--redis-prefix", "kvtest-replicas",
            "--replica-id", name,
            "--lease-ttl", str(LEASE_TTL_S),
            "--log-format", "json",
            *args,
            log_path=log_dir / f"{name}.log",
        )  # fmt: skip

    def ready(self) -> bool:
        return self.answers("/readyz")

    def score(self) -> httpx.Response:
        return httpx.post(
            f"{self.url}/score", json={"model": MODEL, "token_ids": TOKENS}, timeout=5.0
        )

    def matched(self) -> dict[str, int]:
        answer = self.score()
        if answer.status_code != 200:
            return {}
        return {p["pod"]: p["matched_blocks"] for p in answer.json()["pods"]}

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5.0).text

    def pod(self) -> dict:
        return httpx.get(f"{self.url}/index/pods/{POD}", timeout=5.0).json()

    def log(self) -> str:
        return self.log_tail()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", appendonly=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def pod_publisher() -> Iterator[EnginePublisher]:
    """Pod 127.0.0.2 binds its PUB and replay sockets, as a vLLM pod with tcp://*:5557."""
    publisher = EnginePublisher(
        f"tcp://127.0.0.2:{free_port()}",
        replay_endpoint=f"tcp://127.0.0.2:{free_port()}",
        bind=True,
    )
    try:
        yield publisher
    finally:
        publisher.close()


@pytest.fixture
def start_replica(redis: RedisServer, pod_publisher: EnginePublisher, tmp_path: Path):
    replicas: list[Replica] = []
    replay_port = pod_publisher.replay_endpoint.rsplit(":", 1)[1]  # type: ignore[union-attr]

    def start(name: str, *, subscribe: bool = True) -> Replica:
        args = ["--replay-port", replay_port]
        if subscribe:
            args += ["--zmq-connect", f"{POD}@{MODEL}={pod_publisher.endpoint}"]
        replica = Replica(name, redis.url, tmp_path, args)
        replicas.append(replica)
        eventually(replica.ready, f"replica {name} ready:\n{replica.log()}", 30.0)
        return replica

    yield start
    for replica in replicas:
        replica.stop()


def stored(start: int, end: int) -> BlockStored:
    parent = KEYS[start - 1] if start else None
    return BlockStored(KEYS[start:end], parent, TOKENS[start * 16 : end * 16], 16)


def test_events_to_one_replica_scores_from_another(
    start_replica: Callable[..., Replica], pod_publisher: EnginePublisher
) -> None:
    a = start_replica("replica-a")
    b = start_replica("replica-b", subscribe=False)
    assert pod_publisher.wait_for_subscribers(1, 10.0)
    pod_publisher.publish([stored(0, 24)])
    eventually(lambda: a.matched() == {POD: 24}, "replica A indexed the pod", 15.0)
    eventually(lambda: b.matched() == {POD: 24}, "replica B answers from shared state", 10.0)
    assert a.score().json()["pods"] == b.score().json()["pods"]

    report = b.pod()
    assert report["blocks"]["gpu"] == 24
    assert report["owners"] == {POD: "replica-a"}
    assert a.pod()["streams"][0]["state"] == "live"


def test_owner_killed_another_replica_takes_over_and_replays(
    start_replica: Callable[..., Replica], pod_publisher: EnginePublisher, redis: RedisServer
) -> None:
    a = start_replica("replica-a")
    b = start_replica("replica-b")
    assert pod_publisher.wait_for_subscribers(2, 10.0)
    pod_publisher.publish([stored(0, 8)])
    eventually(lambda: b.matched() == {POD: 8}, "the first batch indexed", 15.0)
    eventually(lambda: POD in a.pod().get("owners", {}), "an owner in /index/pods", 10.0)
    owner_name = a.pod()["owners"][POD]
    owner, survivor = (a, b) if owner_name == "replica-a" else (b, a)
    # The survivor stands by once its gate knows the lease is another's (until then a
    # batch it received reads ``resync``: who owns the stream is not known yet).
    eventually(
        lambda: survivor.pod()["streams"][0]["state"] == "standby",
        f"{survivor.name} to stand by:\n{survivor.log()}",
        10.0,
    )
    client = redis.client()
    position = f"kvtest-replicas:stream:{{{POD}}}:pos"
    eventually(lambda: client.get(position) == b"0", "the owner to store its position", 10.0)

    owner.stop(signal.SIGKILL)
    # Published while the dead replica's lease has not expired: nobody applies these;
    # the survivor sees them live, drops them, and must replay them after takeover.
    pod_publisher.publish([stored(8, 16)])
    pod_publisher.publish([stored(16, 24)])
    pod_publisher.publish([stored(24, 40)])

    eventually(
        lambda: survivor.pod().get("owners") == {POD: survivor.name},
        f"{survivor.name} to take the stream over:\n{survivor.log()}",
        10.0 + LEASE_TTL_S,
    )
    eventually(
        lambda: survivor.matched() == {POD: 40},
        f"the missed batches replayed:\n{survivor.log()}",
        10.0,
    )
    stream = survivor.pod()["streams"][0]
    assert stream["state"] == "live"
    assert stream["first_seq"] == 1  # resumed after the dead owner's position, seq 0
    assert stream["replays_ok"] >= 1
    assert stream["missed_batches"] == 0
    assert stream["not_owner"] >= 1
    assert survivor.pod()["blocks"]["gpu"] == 40


def test_redis_restart_mid_ingest_recovers_without_losing_blocks(
    start_replica: Callable[..., Replica], pod_publisher: EnginePublisher, redis: RedisServer
) -> None:
    a = start_replica("replica-a")
    assert pod_publisher.wait_for_subscribers(1, 10.0)
    pod_publisher.publish([stored(0, 8)])
    eventually(lambda: a.matched() == {POD: 8}, "the first batch indexed", 15.0)

    redis.stop()
    refused = a.score()
    assert refused.status_code == 503
    assert refused.json()["error"] == "backend_unavailable"
    assert "Redis" in refused.json()["detail"]
    unready = httpx.get(f"{a.url}/readyz", timeout=5.0)
    assert unready.status_code == 503
    assert "index backend unavailable" in unready.json()["problems"][0]
    assert httpx.get(f"{a.url}/metrics", timeout=5.0).status_code == 200

    pod_publisher.publish([stored(8, 16)])  # while Redis is down
    pod_publisher.publish([stored(16, 24)])
    waiting = f'kvindex_pod_stream_state{{pod="{POD}",state="resync"}} 1.0'
    eventually(lambda: waiting in a.metrics(), "the stream to wait for Redis", 10.0)
    # Down long enough for the lease to lapse: the replica stops counting itself the
    # owner (it keeps the batches queued) and must win the stream back afterwards.
    fenced = f'kvindex_stream_owned{{pod="{POD}"}} 0.0'
    eventually(lambda: fenced in a.metrics(), "the lapsed lease to show", 10.0)
    redis.start()

    eventually(a.ready, "replica ready again", 15.0)
    eventually(lambda: a.matched() == {POD: 24}, f"no lost blocks:\n{a.log()}", 20.0)
    pod_publisher.publish([stored(24, 40)])
    eventually(lambda: a.matched() == {POD: 40}, "live ingest again", 10.0)
    stream = a.pod()["streams"][0]
    assert stream["state"] == "live"
    assert stream["missed_batches"] == 0
    metrics = a.metrics()
    assert "kvindex_redis_errors_total" in metrics
    assert f'kvindex_stream_owned{{pod="{POD}"}} 1.0' in metrics

"""Redis loses the index: a redis-server of the test's own, without persistence, killed
and started again empty under two `kvindex serve` replicas (real processes, real ZMQ).

* with the pod's replay endpoint, every answer of either replica either shows the
  pod's blocks or warns, until the owner has rebuilt them by replay; then both show
  them exactly, without a warning;
* without one, the stream is ``incomplete`` and both replicas warn: never a silent 0.

Every wait has a deadline; nothing asserts on timing.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvindex.api.testing import eventually
from kvindex.events.wire.publisher import EnginePublisher
from tests.redis_fixtures import RedisServer
from tests.test_redis_replicas import MODEL, POD, Replica, pod_publisher, stored  # noqa: F401

pytestmark = pytest.mark.slow

BLOCKS = 24


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", appendonly=False)  # no persistence
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def start_replica(redis: RedisServer, pod_publisher: EnginePublisher, tmp_path: Path):  # noqa: F811
    replicas: list[Replica] = []
    replay_port = pod_publisher.replay_endpoint.rsplit(":", 1)[1]  # type: ignore[union-attr]

    def start(name: str, *, replay: bool) -> Replica:
        args = ["--zmq-connect", f"{POD}@{MODEL}={pod_publisher.endpoint}"]
        if replay:
            args += ["--replay-port", replay_port]
        replica = Replica(name, redis.url, tmp_path, args)
        replicas.append(replica)
        eventually(replica.ready, f"replica {name} ready:\n{replica.log()}", 30.0)
        return replica

    yield start
    for replica in replicas:
        replica.stop()


def kill_and_restart_empty(redis: RedisServer) -> None:
    """SIGKILL, then a fresh redis-server on the same port: nothing comes back."""
    assert redis.process is not None
    redis.process.send_signal(signal.SIGKILL)
    redis.process.wait(timeout=10)
    redis.process = None
    assert list(redis.directory.iterdir()) == []  # no RDB, no AOF: nothing to load
    redis.start()


class Answers:
    """Every /score answer of the replicas while the index is rebuilt; an answer that
    shows fewer blocks than the pod holds without a warning is silently wrong."""

    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.silent: list[tuple[str, dict]] = []
        self.warned = 0

    def read(self) -> dict[str, tuple[int, list[str]]]:
        """Per replica: the pod's matched blocks and the warnings (unanswered: absent)."""
        seen = {}
        for replica in self.replicas:
            answer = replica.score()
            if answer.status_code != 200:  # 503 while Redis is away: loud, fine
                continue
            body = answer.json()
            matched = {p["pod"]: p["matched_blocks"] for p in body["pods"]}.get(POD, 0)
            warnings = body.get("warnings", [])
            if matched != BLOCKS and not warnings:
                self.silent.append((replica.name, body))
            self.warned += bool(warnings)
            seen[replica.name] = (matched, warnings)
        return seen

    def all_show(self, predicate: Callable[[int, list[str]], bool]) -> bool:
        seen = self.read()
        return len(seen) == len(self.replicas) and all(predicate(*v) for v in seen.values())


def stream_state(replica: Replica) -> str:
    return replica.pod()["stream_state"]


def test_redis_restarted_empty_is_rebuilt_by_replay_and_warned_about_until_then(
    start_replica: Callable[..., Replica],
    pod_publisher: EnginePublisher,  # noqa: F811
    redis: RedisServer,
) -> None:
    a = start_replica("replica-a", replay=True)
    b = start_replica("replica-b", replay=True)
    assert pod_publisher.wait_for_subscribers(2, 10.0)
    pod_publisher.publish([stored(0, 8)])
    pod_publisher.publish([stored(8, BLOCKS)])
    for replica in (a, b):
        eventually(lambda r=replica: r.matched() == {POD: BLOCKS}, f"{replica.name} indexed", 15.0)
    replays_before = sum(r.pod()["replays"]["ok"] for r in (a, b))

    kill_and_restart_empty(redis)
    answers = Answers([a, b])
    eventually(
        lambda: answers.all_show(lambda matched, warnings: matched == BLOCKS and not warnings),
        f"the blocks rebuilt on both replicas:\n{a.log()}\n{b.log()}",
        30.0,
    )
    assert answers.silent == [], f"answers without the blocks, without a warning: {answers.silent}"
    for replica in (a, b):
        assert "kvindex_redis_index_losses_total 1.0" in replica.metrics(), replica.name
        eventually(replica.ready, f"{replica.name} ready again:\n{replica.log()}", 10.0)
        report = replica.pod()
        assert report["blocks"]["gpu"] == BLOCKS
        assert report["stream_state"] in ("live", "standby")
    # Rebuilt by replay, by whichever replica won the stream's lease back.
    assert sum(r.pod()["replays"]["ok"] for r in (a, b)) > replays_before
    assert sorted(stream_state(r) for r in (a, b)) == ["live", "standby"]

    pod_publisher.publish([stored(BLOCKS, 40)])  # and ingest goes on
    for replica in (a, b):
        eventually(lambda r=replica: r.matched() == {POD: 40}, f"{replica.name} live again", 10.0)


def test_redis_restarted_empty_without_replay_is_incomplete_never_silent(
    start_replica: Callable[..., Replica],
    pod_publisher: EnginePublisher,  # noqa: F811
    redis: RedisServer,
) -> None:
    a = start_replica("replica-a", replay=False)
    b = start_replica("replica-b", replay=False)
    assert pod_publisher.wait_for_subscribers(2, 10.0)
    pod_publisher.publish([stored(0, BLOCKS)])
    for replica in (a, b):
        eventually(lambda r=replica: r.matched() == {POD: BLOCKS}, f"{replica.name} indexed", 15.0)

    kill_and_restart_empty(redis)
    answers = Answers([a, b])
    eventually(
        lambda: all(stream_state(r) == "incomplete" for r in (a, b)),
        f"the stream incomplete on both replicas:\n{a.log()}\n{b.log()}",
        30.0,
    )
    eventually(
        lambda: answers.all_show(lambda matched, warnings: matched == 0 and bool(warnings)),
        "both replicas warn",
        10.0,
    )
    assert answers.silent == [], f"answers without the blocks, without a warning: {answers.silent}"
    for replica in (a, b):
        eventually(replica.ready, f"{replica.name} ready again:\n{replica.log()}", 10.0)
        warnings = replica.score().json()["warnings"]
        assert any(POD in w and "incomplete" in w for w in warnings), warnings
        stream = next(s for s in replica.pod()["streams"] if s["member"] == POD)
        assert stream["state"] == "incomplete" and "lost the index" in stream["state_reason"]

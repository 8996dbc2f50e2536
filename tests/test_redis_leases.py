"""Stream leases in Redis (indexer/redis/leases.py), with the lease rounds driven by the test
(``tick``) instead of the background thread, so every step is deterministic."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from kvindex.events.ingest.gate import Ownership
from kvindex.events.wire.identity import StreamId
from kvindex.indexer.redis.backend import RedisBackend
from kvindex.indexer.redis.leases import RedisLeases
from tests.redis_fixtures import REDIS_URL, delete_prefix, shared_redis

STREAM = StreamId("127.10.0.1:8000")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_leases() -> Iterator:
    client = shared_redis()
    prefix = f"kvtest-leases-{uuid.uuid4().hex[:8]}"
    made: list[RedisLeases] = []

    def make(name: str, ttl_s: float = 5.0, clock=time.monotonic) -> RedisLeases:
        backend = RedisBackend.from_url(REDIS_URL, prefix=prefix)
        leases = RedisLeases(backend, name, ttl_s=ttl_s, clock=clock)
        made.append(leases)
        return leases

    yield make
    for leases in made:
        leases.backend.close()
    delete_prefix(client, prefix)


def test_one_replica_applies_a_stream_the_other_stands_by(make_leases) -> None:
    a, b = make_leases("replica-a"), make_leases("replica-b")
    assert a.claim(STREAM).ownership is Ownership.UNKNOWN  # not tried yet: hold, not drop
    a.tick()
    claim = a.claim(STREAM)
    assert (claim.ownership, claim.resume_after) == (Ownership.OWNED, None)
    b.claim(STREAM)
    b.tick()
    assert b.claim(STREAM).ownership is Ownership.NOT_OWNED
    assert a.owners() == b.owners() == {STREAM.member: "replica-a"}
    assert a.owned() == {STREAM.member: True} and b.owned() == {STREAM.member: False}
    a.tick()  # renewal: same epoch
    assert a.claim(STREAM).epoch == claim.epoch


def test_a_released_stream_is_resumed_after_the_stored_position(make_leases) -> None:
    a, b = make_leases("replica-a"), make_leases("replica-b")
    a.claim(STREAM)
    a.tick()
    b.claim(STREAM)
    b.tick()
    a.committed(STREAM, 41)
    a.tick()  # the renewal writes the position
    a.committed(STREAM, 42)
    a.close()  # graceful: final position, lease released
    b.tick()
    claim = b.claim(STREAM)
    assert (claim.ownership, claim.resume_after) == (Ownership.OWNED, 42)


def test_the_stored_position_carries_the_batch_digest(make_leases) -> None:
    a, b = make_leases("replica-a"), make_leases("replica-b")
    a.claim(STREAM)
    a.tick()
    b.claim(STREAM)
    b.tick()
    a.committed(STREAM, 7, bytes(range(16)))
    a.tick()
    a.committed(STREAM, 8)  # digest unknown (an undecodable batch): position only
    a.tick()
    a.committed(STREAM, 9, b"\xff" * 16)
    a.close()
    b.tick()
    claim = b.claim(STREAM)
    assert (claim.ownership, claim.resume_after, claim.resume_digest) == (
        Ownership.OWNED,
        9,
        b"\xff" * 16,
    )


def test_a_dead_owners_lease_expires_and_is_taken_over(make_leases) -> None:
    a, b = make_leases("replica-a", ttl_s=0.3), make_leases("replica-b", ttl_s=0.3)
    a.claim(STREAM)
    a.tick()
    a.committed(STREAM, 7)
    a.tick()
    b.claim(STREAM)
    deadline = time.monotonic() + 10
    while b.claim(STREAM).ownership is not Ownership.OWNED and time.monotonic() < deadline:
        b.tick()  # replica-a stopped renewing: it "died"
        time.sleep(0.05)
    claim = b.claim(STREAM)
    assert (claim.ownership, claim.resume_after) == (Ownership.OWNED, 7)
    a.committed(STREAM, 9)
    a.tick()  # the old owner comes back: it has lost the stream, its position is refused
    assert a.claim(STREAM).ownership is Ownership.NOT_OWNED
    assert a.owners() == {STREAM.member: "replica-b"}
    b.close()
    a.tick()
    assert a.claim(STREAM).resume_after == 7


def test_an_owner_that_cannot_renew_stops_applying_before_the_lease_can_expire(
    make_leases,
) -> None:
    clock = FakeClock()
    a = make_leases("replica-a", ttl_s=5.0, clock=clock)
    a.claim(STREAM)
    a.tick()
    first = a.claim(STREAM)
    clock.now += 3.9
    assert a.claim(STREAM).ownership is Ownership.OWNED
    clock.now += 0.2  # 4.1 s > 0.8 x TTL since the last renewal was sent
    assert a.claim(STREAM).ownership is Ownership.UNKNOWN
    assert a.owned() == {STREAM.member: False}
    a.tick()  # renewed (the key was still ours): the same epoch, nothing to resync
    claim = a.claim(STREAM)
    assert (claim.ownership, claim.epoch) == (Ownership.OWNED, first.epoch)


def test_unreachable_redis_keeps_the_gate_answering(make_leases) -> None:
    backend = RedisBackend.from_url("redis://127.0.0.1:1/0?cluster=no", prefix="kvtest-down")
    leases = RedisLeases(backend, "replica-a")
    leases.claim(STREAM)
    leases.tick()  # fails quietly, counted
    assert leases.errors == 1
    assert leases.claim(STREAM).ownership is Ownership.UNKNOWN
    leases.close()


def test_leases_on_redis_cluster(redis_cluster) -> None:
    prefix = f"kvtest-leases-{uuid.uuid4().hex[:8]}"
    streams = [StreamId(f"127.10.0.{i}:8000") for i in range(6)]  # spread over the slots
    a = RedisLeases(RedisBackend.from_url(redis_cluster.url, prefix=prefix), "replica-a")
    b = RedisLeases(RedisBackend.from_url(redis_cluster.url, prefix=prefix), "replica-b")
    try:
        for stream in streams:
            a.claim(stream)
            b.claim(stream)
        a.tick()
        b.tick()
        assert all(a.claim(s).ownership is Ownership.OWNED for s in streams)
        assert all(b.claim(s).ownership is Ownership.NOT_OWNED for s in streams)
        for n, stream in enumerate(streams):
            a.committed(stream, n)
        a.close()
        b.tick()
        assert [b.claim(s).resume_after for s in streams] == list(range(6))
    finally:
        b.close()
        for leases in (a, b):
            leases.backend.close()
        delete_prefix(redis_cluster.client, prefix)


def test_a_lost_index_is_rebuilt_and_every_replica_marks_it_until_it_is(make_leases) -> None:
    """Redis forgot the index (here: every key of the prefix deleted, as an empty restart
    leaves it): the owner re-acquires its stream as a rebuild owing the whole history,
    and both replicas mark the stream until the owner says it is live again."""
    a, b = make_leases("replica-a"), make_leases("replica-b")
    a.claim(STREAM)
    a.tick()
    before = a.claim(STREAM)
    b.claim(STREAM)
    b.tick()
    a.committed(STREAM, 5, b"\x01" * 16)
    a.tick()
    assert not before.rebuild and a.marks() == b.marks() == {}

    delete_prefix(shared_redis(), a.backend.prefix)
    a.tick()
    claim = a.claim(STREAM)
    assert (claim.ownership, claim.rebuild, claim.resume_after) == (Ownership.OWNED, True, None)
    assert claim.epoch != before.epoch
    b.tick()
    assert b.claim(STREAM).ownership is Ownership.NOT_OWNED
    for leases in (a, b):
        mark = leases.marks()[STREAM.member]
        assert (mark.state, mark.model) == ("resync", "")  # every model, until reported
        assert leases.incarnation.losses == 1

    a.settled(STREAM, claim.epoch, "m", "incomplete")
    a.tick()
    b.tick()
    mark = b.marks()[STREAM.member]
    assert (mark.state, mark.model) == ("incomplete", "m")
    a.settled(STREAM, claim.epoch, "m", "live")  # its engine cleared: nothing owed
    a.tick()
    b.tick()
    assert a.marks() == b.marks() == {}
    a.tick()
    assert a.claim(STREAM).epoch == claim.epoch  # one rebuild per loss
    assert a.incarnation.losses == b.incarnation.losses == 1


def test_a_replica_that_notices_late_does_not_undo_a_finished_rebuild(make_leases) -> None:
    a, b = make_leases("replica-a"), make_leases("replica-b")
    a.claim(STREAM)
    a.tick()
    b.claim(STREAM)
    b.tick()
    delete_prefix(shared_redis(), a.backend.prefix)
    a.tick()
    claim = a.claim(STREAM)
    a.settled(STREAM, claim.epoch, "m", "live")
    a.tick()
    b.tick()  # b learns of the loss only now
    assert b.incarnation.losses == 1
    assert a.marks() == b.marks() == {}


def test_a_redis_restarted_with_its_data_is_no_loss(redis_server) -> None:
    leases = RedisLeases(RedisBackend.from_url(redis_server.url, prefix="kvtest"), "replica-a")
    try:
        leases.claim(STREAM)
        leases.tick()
        first = leases.claim(STREAM)
        redis_server.restart()  # append-only file: everything comes back
        leases.tick()
        claim = leases.claim(STREAM)
        assert (claim.epoch, claim.rebuild, leases.incarnation.losses) == (first.epoch, False, 0)
    finally:
        leases.close()
        leases.backend.close()


def test_a_lost_index_on_redis_cluster(redis_cluster) -> None:
    prefix = f"kvtest-leases-{uuid.uuid4().hex[:8]}"
    streams = [StreamId(f"127.10.0.{i}:8000") for i in range(6)]  # spread over the slots
    a = RedisLeases(RedisBackend.from_url(redis_cluster.url, prefix=prefix), "replica-a")
    try:
        for stream in streams:
            a.claim(stream)
        a.tick()
        delete_prefix(redis_cluster.client, prefix)
        a.tick()
        assert all(a.claim(s).rebuild for s in streams)
        assert sorted(a.marks()) == sorted(s.member for s in streams)
    finally:
        a.close()
        a.backend.close()
        delete_prefix(redis_cluster.client, prefix)

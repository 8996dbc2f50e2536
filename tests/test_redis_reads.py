"""The Redis read path (indexer/redis/read.py): what a replica caches between lookups is
checked against Redis by every lookup, so another replica's writes never make it answer
wrongly. Two backends on one prefix are two replicas. Real Redis; no mocks."""

from __future__ import annotations

import pytest

from kvindex.indexer.backend import Change, MemberMatch, Op, Tier
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.redis.backend import RedisBackend
from kvindex.indexer.redis.connection import RedisConnection, RedisOptions
from kvindex.indexer.redis.read import IndexLost
from tests.redis_fixtures import RedisServer

M = "acme/model-7b"
A, B, C = "127.10.0.1:8000", "127.10.0.2:8000", "127.10.0.3:8000"
KEYS = [11, 12, 13, 14]


def store(member: str, keys: list[int], tier: Tier = Tier.GPU) -> Change:
    return Change(Op.STORE, member, M, tier, keys)


@pytest.fixture
def replicas(redis_server: RedisServer):
    made = [RedisBackend.from_url(redis_server.url, prefix="kvt") for _ in range(2)]
    yield made
    for backend in made:
        backend.close()


def test_a_member_id_reused_by_another_replica_is_named_right(replicas) -> None:
    reader, writer = replicas
    writer.apply([store(A, KEYS), store(B, KEYS[:1])])
    assert [m.member for m in reader.lookup(M, KEYS)] == [A, B]  # reader caches the names
    writer.clear_member(A)  # A's id is free ...
    writer.apply([store(C, KEYS[:3])])  # ... and C gets it
    assert reader.lookup(M, KEYS) == [MemberMatch(C, 3, (3, 0, 0)), MemberMatch(B, 1, (1, 0, 0))]
    assert reader.lookup(M, KEYS, [A]) == []
    assert [p.member for p in reader.presence(M, KEYS)] == [B, C]


def test_a_model_that_gains_cpu_entries_is_read_in_every_tier(replicas) -> None:
    reader, writer = replicas
    writer.apply([store(A, KEYS), store(B, [99])])  # B has its id: no epoch change below
    assert reader.lookup(M, KEYS) == [MemberMatch(A, 4, (4, 0, 0))]  # GPU fields only
    writer.apply([store(B, KEYS, Tier.CPU), store(A, KEYS[2:], Tier.STORAGE)])
    assert reader.lookup(M, KEYS) == [
        MemberMatch(A, 4, (4, 0, 0)),
        MemberMatch(B, 4, (0, 4, 0)),
    ]
    writer.apply([Change(Op.REMOVE, A, M, Tier.GPU, KEYS[2:])])
    assert reader.lookup(M, KEYS)[0] == MemberMatch(A, 4, (2, 0, 2))


def test_a_model_deleted_under_a_reader_means_a_lost_index(
    replicas, redis_server: RedisServer
) -> None:
    """Nothing kvindex does deletes a model's meta: one gone under a reader means Redis
    lost the index. The reader says so rather than answer that nobody holds anything,
    until the loss is taken in (the lease round that notices it); then it reads empty."""
    reader, writer = replicas
    writer.apply([store(A, KEYS)])
    assert reader.lookup(M, KEYS)
    writer.clear_member(A)
    redis_server.client().delete(writer.keys.model(M).meta)
    with pytest.raises(IndexLost):
        reader.lookup(M, KEYS)
    with pytest.raises(IndexLost):
        reader.presence(M, KEYS)
    reader.index_lost()
    assert reader.lookup(M, KEYS) == []
    assert reader.presence(M, KEYS) == []


def test_writers_configured_with_other_bucket_counts_agree(redis_server: RedisServer) -> None:
    first = RedisBackend.from_url(f"{redis_server.url}?buckets=4", prefix="kvt")
    later = RedisBackend.from_url(f"{redis_server.url}?buckets=16", prefix="kvt")
    try:
        first.apply([store(A, list(range(100)))])
        later.apply([store(B, list(range(50)))])  # its script call is refused, then redone
        later.apply([Change(Op.REMOVE, B, M, Tier.GPU, [7])])
        assert redis_server.client().hget(first.meta_key(M), "buckets") == b"4"
        for backend in (first, later):
            got = {m.member: m.matched_blocks for m in backend.lookup(M, list(range(100)))}
            assert got == {A: 100, B: 7}
        assert later.member_keys(B, M) == [k for k in range(50) if k != 7]
        assert later.clear_member(B) == 49
    finally:
        first.close()
        later.close()


@pytest.mark.parametrize("use_hiredis", [True, False], ids=["hiredis", "pure-python"])
def test_both_reply_readers_answer_alike(redis_server: RedisServer, use_hiredis: bool) -> None:
    """With hiredis the lookup reads replies with its reader; without it (or not
    installed), with redis-py's pure-Python one: the same answers either way."""
    connection = RedisConnection(RedisOptions.from_url(redis_server.url), use_hiredis=use_hiredis)
    backend = RedisBackend(connection, prefix="kvt")
    reference = MemoryBackend()
    chain = [(i * 2654435761) % 2**64 for i in range(1, 300)]
    changes = [
        store(A, chain),
        store(B, chain[:200], Tier.CPU),
        store(C, chain[:50]),
        Change(Op.REMOVE, C, M, Tier.GPU, [chain[20]]),
        store(C, chain[100:], Tier.STORAGE),
    ]
    try:
        backend.apply(changes)
        reference.apply(changes)
        for probe in (chain, chain[:30], [chain[0], 5, *chain[1:]]):
            assert backend.lookup(M, probe) == reference.lookup(M, probe)
            assert backend.lookup(M, probe, [B, C]) == reference.lookup(M, probe, [B, C])
            assert backend.presence(M, probe) == reference.presence(M, probe)
        assert backend.member_keys(C, M) == reference.member_keys(C, M)
    finally:
        backend.close()

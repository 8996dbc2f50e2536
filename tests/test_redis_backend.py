"""What the Redis backend promises beyond the shared contract: its key layout, no
keyspace scans, bounded work per call, failures as BackendUnavailable, recovery after
a Redis restart, Cluster detection. Real Redis servers; no mocks."""

from __future__ import annotations

import random

import pytest

from kvindex.api.testing import free_port
from kvindex.indexer.backend import BackendUnavailable, Change, MemberMatch, Op, Tier
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.redis.backend import CLEAR_CHUNK, RedisBackend
from kvindex.indexer.redis.keys import model_tag
from tests.redis_fixtures import RedisClusterProcess, RedisServer, delete_prefix

M = "acme/model-7b"
A, B = "127.10.0.1:8000", "127.10.0.2:8000"


def store(member: str, keys: list[int], tier: Tier = Tier.GPU, model: str = M) -> Change:
    return Change(Op.STORE, member, model, tier, keys)


def remove(member: str, keys: list[int], tier: Tier = Tier.GPU, model: str = M) -> Change:
    return Change(Op.REMOVE, member, model, tier, keys)


@pytest.fixture
def backend(redis_server: RedisServer) -> RedisBackend:
    made = RedisBackend.from_url(redis_server.url, prefix="kvt")
    yield made
    made.close()


def test_every_key_is_under_the_prefix_and_nothing_scans(
    backend: RedisBackend, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    client.config_resetstat()
    backend.apply([store(A, list(range(100))), store(B, list(range(50)), Tier.CPU)])
    backend.apply([store(A, [7], model="other"), remove(A, [3]), Change(Op.CLEAR, B, "", Tier.CPU)])
    backend.lookup(M, list(range(100)))
    backend.lookup(M, list(range(100)), [A, B])
    backend.stats()
    backend.members()
    backend.member_stats(A)
    backend.member_keys(A, M)
    backend.clear_member(A)
    commands = client.info("commandstats")
    assert not [c for c in commands if c in ("cmdstat_keys", "cmdstat_scan")], commands
    backend.apply([store(A, [1, 2]), store(B, [3], model="other")])
    keys = [k.decode() for k in client.scan_iter(count=1000)]  # the test looks; kvindex never does
    assert keys and all(k.startswith("kvt:") for k in keys), keys
    model_keys = [k for k in keys if k not in (backend.keys.models, backend.keys.layout)]
    assert all(f"{{{M}}}" in k or "{other}" in k for k in model_keys), model_keys


def test_model_names_that_cannot_be_hash_tags_are_digested() -> None:
    assert model_tag("Qwen/Qwen3-32B") == "Qwen/Qwen3-32B"
    assert model_tag("").startswith("#") and model_tag("a{b}").startswith("#")
    assert model_tag("a{b}") != model_tag("a{c}")


def test_unreachable_redis_raises_backend_unavailable_fast() -> None:
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{free_port()}/0?cluster=no")
    for call in (
        backend.ping,
        lambda: backend.lookup(M, [1, 2]),
        lambda: backend.apply([store(A, [1])]),
        backend.stats,
        lambda: backend.clear_member(A),
    ):
        with pytest.raises(BackendUnavailable, match="unreachable"):
            call()
    assert sum(backend.error_counts().values()) == 5


def test_a_restarted_redis_is_used_again_without_a_new_backend(
    backend: RedisBackend, redis_server: RedisServer
) -> None:
    backend.apply([store(A, [1, 2, 3])])
    redis_server.stop()
    with pytest.raises(BackendUnavailable):
        backend.lookup(M, [1, 2, 3])
    redis_server.start()  # append-only file: the index is still there
    assert backend.lookup(M, [1, 2, 3]) == [MemberMatch(A, 3, (3, 0, 0))]
    redis_server.client().script_flush()  # scripts are reloaded on NOSCRIPT
    backend.apply([store(A, [4])])
    assert backend.lookup(M, [1, 2, 3, 4]) == [MemberMatch(A, 4, (4, 0, 0))]


def test_clearing_a_large_member_runs_in_bounded_chunks(backend: RedisBackend) -> None:
    keys = list(range(1, 3 * CLEAR_CHUNK + 100))
    backend.apply(
        [store(A, keys), store(A, keys[: CLEAR_CHUNK + 5], Tier.CPU), store(B, keys[:10])]
    )
    backend.apply([Change(Op.CLEAR, A, "", Tier.CPU)])  # one tier: the record is rewritten
    assert backend.member_stats(A).blocks == {M: {Tier.GPU: len(keys)}}  # type: ignore[union-attr]
    assert backend.member_keys(A, M) == keys
    assert backend.clear_member(A) == len(keys)
    assert backend.members() == [B]
    assert backend.stats().keys == 10


def test_the_reverse_record_stays_bounded_under_churn(
    backend: RedisBackend, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    for round_no in range(20):
        keys = list(range(round_no * 500, round_no * 500 + 500))
        backend.apply([store(A, keys), store(A, [10**9])])
        backend.apply([remove(A, keys)])
    log_keys = [k for k in client.scan_iter(match="kvt:*:log:*")]
    assert len(log_keys) == 1
    # Compacted whenever it passes twice the blocks held (501 at most here) plus slack,
    # instead of growing with every block ever stored (10,020 entries).
    assert client.strlen(log_keys[0]) <= 8 * (2 * 501 + 64)
    assert backend.member_keys(A, M) == [10**9]


def test_member_ids_are_reused_so_bitmaps_stay_short(
    backend: RedisBackend, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    ids = backend.keys.model(M).ids
    backend.apply([store(A, [1])])
    assert client.hget(ids, A) == b"0"
    backend.apply([remove(A, [1])])  # A leaves: id 0 is free again
    backend.apply([store(B, [1])])
    assert client.hget(ids, B) == b"0" and client.hget(ids, A) is None


def test_the_first_writer_fixes_the_bucket_count(redis_server: RedisServer) -> None:
    small = RedisBackend.from_url(f"{redis_server.url}?buckets=16", prefix="kvt")
    default = RedisBackend.from_url(redis_server.url, prefix="kvt")
    small.apply([store(A, list(range(1000)))])
    default.apply([store(B, list(range(500)))])
    assert redis_server.client().hget(small.meta_key(M), "buckets") == b"16"
    assert {m.member: m.matched_blocks for m in default.lookup(M, list(range(1000)))} == {
        A: 1000,
        B: 500,
    }


def test_redis_cluster_is_detected_without_being_told(redis_cluster: RedisClusterProcess) -> None:
    port = redis_cluster.ports[1]
    backend = RedisBackend.from_url(f"redis://127.0.0.1:{port}/0", prefix="kvt-detect")
    try:
        backend.apply([store(A, [1, 2, 3]), store(B, [1], model="m2")])
        assert backend.connection.is_cluster is True
        assert backend.lookup(M, [1, 2, 3]) == [MemberMatch(A, 3, (3, 0, 0))]
        assert backend.members() == [A, B]
        slots = {redis_cluster.client.keyslot(k) for k in (backend.meta_key(M),)}
        assert len(slots) == 1
    finally:
        backend.close()
        delete_prefix(redis_cluster.client, "kvt-detect")


@pytest.mark.parametrize("bad", ["redis://h/0?buckets=0", "redis://h/0?cluster=maybe"])
def test_bad_url_options_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        RedisBackend.from_url(bad)


@pytest.mark.parametrize("buckets", [1, 3, 65536])
def test_every_bucket_layout_answers_like_the_memory_backend(
    redis_server: RedisServer, buckets: int
) -> None:
    """The contract suite runs with the default bucket count; the lookup walk reads
    differently with one huge bucket, a few, or many small (listpack) ones."""
    rng = random.Random(buckets)
    # One bucket of 70 pods x 600 blocks is a slow walk: on a loaded 2-core box it can pass
    # the default 1 s read timeout, which is not what this test is about.
    url = f"{redis_server.url}?buckets={buckets}&timeout=10"
    redis_backend = RedisBackend.from_url(url, prefix="kvt")
    reference = MemoryBackend()
    members = [f"127.10.0.{i}:8000" for i in range(70)]
    chain = [rng.getrandbits(64) for _ in range(600)]
    for round_no in range(3):
        changes = []
        for member in members:
            n = rng.randrange(len(chain))
            tier = rng.choice([Tier.GPU, Tier.GPU, Tier.CPU]) if round_no else Tier.GPU
            changes.append(store(member, chain[:n], tier))
            if rng.random() < 0.3:
                changes.append(remove(member, rng.sample(chain, 3), tier))
        redis_backend.apply(changes)
        reference.apply(changes)
        for probe in (chain, chain[:40], chain[5:], [*chain[:300], 1, *chain[301:]]):
            assert redis_backend.lookup(M, probe) == reference.lookup(M, probe)
            some = members[::7]
            assert redis_backend.lookup(M, probe, some) == reference.lookup(M, probe, some)
            assert redis_backend.presence(M, probe) == reference.presence(M, probe)
    redis_backend.close()

"""The KeySpace names every key the Redis backend and the stream leases write, and the
index scripts get the model's fixed keys in KEYS. Real Redis; no mocks."""

from __future__ import annotations

import re

import pytest

from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.leases import RedisLeases
from kvindex.indexer.redis_backend import RedisBackend
from kvindex.indexer.redis_keys import KeySpace
from kvindex.indexer.redis_scripts import SCRIPTS
from tests.redis_fixtures import RedisServer

M, OTHER = "acme/model-7b", "a{b}"
A, B = "127.10.0.1:8000", "127.10.0.2:8000"


def _named(keyspace: KeySpace, models: list[str], buckets: int, members: list[str]) -> set[str]:
    """Every key the KeySpace can name for these models, buckets and member ids."""
    names = {keyspace.models}
    for model in models:
        keys = keyspace.model(model)
        names.update(keys.script_keys())
        names.update(keys.bucket(n) for n in range(buckets))
        for member_id in range(8):
            names.update((keys.log(member_id), keys.log_tmp(member_id)))
    for member in members:
        stream = keyspace.stream(member)
        names.update((stream.lease, stream.position, stream.digest))
    return names


def test_every_key_written_is_one_the_keyspace_names(redis_server: RedisServer) -> None:
    backend = RedisBackend.from_url(f"{redis_server.url}?buckets=4", prefix="kvt")
    leases = RedisLeases(backend, "replica-1", 5.0)
    try:
        backend.apply(
            [
                Change(Op.STORE, A, M, Tier.GPU, list(range(40))),
                Change(Op.STORE, A, M, Tier.GPU, [3, 4]),  # second copies
                Change(Op.STORE, B, M, Tier.CPU, list(range(20))),
                Change(Op.STORE, B, OTHER, Tier.GPU, [9]),
                Change(Op.REMOVE, A, M, Tier.GPU, [5]),
            ]
        )
        backend.clear_member(B)
        backend.apply([Change(Op.STORE, B, M, Tier.GPU, [1])])  # B's id is reused
        backend.lookup(M, list(range(40)), [A, B])
        for member in (A, B):
            backend.connection.pipeline(
                "lease", [SCRIPTS["lease"].args(leases.keys(member), ["replica-1", 5000, 7, "ab"])]
            )
        written = {k.decode() for k in redis_server.client().scan_iter(count=1000)}
        assert written, "nothing was written"
        assert written <= _named(backend.keys, [M, OTHER], 4, [A, B]), sorted(
            written - _named(backend.keys, [M, OTHER], 4, [A, B])
        )
    finally:
        leases.close()
        backend.close()


def test_index_scripts_get_the_models_fixed_keys_in_keys() -> None:
    keys = KeySpace("kvt").model(M)
    command = SCRIPTS["lookup"].args(keys.script_keys(), [b"x"])
    assert command[:3] == ("EVALSHA", SCRIPTS["lookup"].sha, 6)
    assert command[3:9] == (keys.meta, keys.stats, keys.ids, keys.names, keys.free, keys.copies)
    # One hash tag for all of them (one Redis Cluster slot), the model's.
    assert {re.search(r"\{(.*)\}", k).group(1) for k in command[3:9]} == {M}


@pytest.mark.parametrize("bad", ["", "a{b", "x}"])
def test_a_prefix_that_cannot_be_one_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        KeySpace(bad)

"""Redis data of another layout is refused, clearly, and never read or written over.

The layout-1 data here is written by hand the way the old scripts left it (a ``meta``
with ``buckets`` and no ``layout``, a ``models`` set, no ``<prefix>:layout`` key): what
an operator who upgrades in place without a new ``--redis-prefix`` has in Redis.
Real Redis; no mocks.
"""

from __future__ import annotations

import pytest

from kvindex.indexer.backend import BackendUnavailable, Change, Op, Tier
from kvindex.indexer.redis.backend import RedisBackend
from kvindex.indexer.redis.keys import LAYOUT, KeySpace, RedisLayoutError
from tests.redis_fixtures import RedisServer

M = "acme/model-7b"
A = "127.10.0.1:8000"


def _old_layout(server: RedisServer, prefix: str) -> None:
    client = server.client()
    keys = KeySpace(prefix).model(M)
    client.sadd(KeySpace(prefix).models, M)
    client.hset(keys.meta, mapping={"buckets": 16, "next_id": 1})
    client.hset(keys.ids, A, 0)
    client.hset(keys.names, 0, A)
    client.hset(keys.bucket(1), (1).to_bytes(8, "big"), b"\x01")
    client.set(f"{keys.base}log:0", (1).to_bytes(8, "big"))


def test_old_layout_data_is_refused_with_what_to_do(redis_server: RedisServer) -> None:
    _old_layout(redis_server, "kvt")
    backend = RedisBackend.from_url(redis_server.url, prefix="kvt")
    before = {k: redis_server.client().dump(k) for k in redis_server.client().scan_iter()}
    try:
        with pytest.raises(RedisLayoutError) as refused:
            backend.ping()  # what /readyz and the startup line say
        message = str(refused.value)
        assert "layout 1" in message and f"layout {LAYOUT}" in message
        assert "--redis-prefix" in message and "'kvt:'" in message
        assert refused.value.code == "redis_layout_mismatch"
        assert isinstance(refused.value, BackendUnavailable)  # /score answers 503
        with pytest.raises(RedisLayoutError, match="model 'acme/model-7b'"):
            backend.lookup(M, [1])
        with pytest.raises(RedisLayoutError):
            backend.presence(M, [1])
        with pytest.raises(RedisLayoutError):
            backend.apply([Change(Op.STORE, A, M, Tier.GPU, [2])])
    finally:
        backend.close()
    after = {k: redis_server.client().dump(k) for k in redis_server.client().scan_iter()}
    assert after == before, "the old data was changed"


def test_a_script_refuses_a_model_of_another_layout(redis_server: RedisServer) -> None:
    """The scripts check too: a replica that passed the prefix check before the old
    data arrived (an old replica still writing) changes nothing in that model."""
    backend = RedisBackend.from_url(redis_server.url, prefix="kvt")
    try:
        backend.apply([Change(Op.STORE, A, "fresh", Tier.GPU, [5])])  # checks and claims
        _old_layout(redis_server, "kvt")
        with pytest.raises(RedisLayoutError, match="layout 1"):
            backend.apply([Change(Op.STORE, A, M, Tier.GPU, [2])])
        assert redis_server.client().hlen(backend.keys.model(M).bucket(2)) == 0
    finally:
        backend.close()


def test_a_new_prefix_starts_in_this_layout(redis_server: RedisServer) -> None:
    _old_layout(redis_server, "kvt")
    backend = RedisBackend.from_url(redis_server.url, prefix="kvt2")
    try:
        backend.ping()
        backend.apply([Change(Op.STORE, A, M, Tier.GPU, [1, 2])])
        client = redis_server.client()
        assert client.get(backend.keys.layout) == str(LAYOUT).encode()
        assert client.hget(backend.keys.model(M).meta, "layout") == str(LAYOUT).encode()
        assert [m.matched_blocks for m in backend.lookup(M, [1, 2])] == [2]
    finally:
        backend.close()

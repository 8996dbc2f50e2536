"""The compiled Redis lookup (indexer/redis/_redis_lookup.c) against the pure path it replaces.

Each kernel is held to its pure counterpart on the same input: ``pack_reads`` to
redis_wire.pack_reads (the same bytes), ``frame``/``decode`` to hiredis's reader,
``parse_lookup`` to hiredis + redis_read.rows_of (the same matrix), ``prefix_walk`` and
``held_positions`` to redis_walk's numpy walks (the same answers), ``exchange`` to what
a socket does (timeouts, a closed connection, a big answer). End to end, the three read
paths (compiled, hiredis + numpy, redis-py's reader + numpy) answer every lookup and
presence query like the memory backend. Real Redis; no mocks.
"""

from __future__ import annotations

import random
import socket
import threading

import hiredis
import numpy as np
import pytest

from kvindex.indexer.backend import (
    BackendError,
    BackendUnavailable,
    Change,
    MemberMatch,
    Op,
    Tier,
)
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.redis.backend import RedisBackend
from kvindex.indexer.redis.compiled import kernels
from kvindex.indexer.redis.connection import RedisConnection, RedisOptions
from kvindex.indexer.redis.read import Blocks, ModelView, rows_of
from kvindex.indexer.redis.walk import held_positions, prefix_matches
from kvindex.indexer.redis.wire import EXEC, MULTI, ReadBuffer, pack_reads, read_answer
from tests.redis_fixtures import RedisServer

pytestmark = pytest.mark.skipif(
    kernels is None, reason="indexer/redis/_redis_lookup.c is not built"
)

M = "acme/model-7b"
PATHS = {
    "compiled": {"compiled": True},
    "hiredis+numpy": {"compiled": False},
    "redis-py+numpy": {"use_hiredis": False},
}


def members(n: int) -> list[str]:
    return [f"127.20.{i // 250}.{i % 250 + 1}:8000" for i in range(n)]


def backend_for(url: str, path: str, prefix: str = "kvc") -> RedisBackend:
    return RedisBackend(RedisConnection(RedisOptions.from_url(url), **PATHS[path]), prefix)


# -- packing --------------------------------------------------------------------------------


@pytest.mark.parametrize("buckets", [1, 3, 16, 4096, 4097, 65536])
@pytest.mark.parametrize("tiers", [False, True])
def test_pack_reads_writes_the_numpy_paths_bytes(buckets: int, tiers: bool) -> None:
    rng = random.Random(buckets)
    keys = [rng.getrandbits(64) for _ in range(700)] + [0, 2**64 - 1, 5, 5]
    expected = pack_reads(np.array(keys, np.uint64), buckets, b"p:{m}:b:", tiers)
    assert kernels.pack_reads(keys, buckets, b"p:{m}:b:", tiers) == expected
    assert kernels.pack_reads(np.array(keys, np.uint64), buckets, b"p:{m}:b:", tiers) == expected


@pytest.mark.parametrize("bad", [[-1], [2**64], [1, 2**70], [1, "2"], [1.0]])
def test_pack_reads_refuses_keys_out_of_range(bad: list) -> None:
    with pytest.raises(ValueError):
        kernels.pack_reads(bad, 16, b"p:", False)


# -- reading replies ------------------------------------------------------------------------

SAMPLES = [
    b"+OK\r\n",
    b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
    b":42\r\n",
    b":-7\r\n",
    b"$5\r\nhe\r\nx\r\n",
    b"$0\r\n\r\n",
    b"$-1\r\n",
    b"*-1\r\n",
    b"*0\r\n",
    b"*3\r\n$1\r\n\x01\r\n$-1\r\n_\r\n",
    b"%2\r\n$1\r\n3\r\n$1\r\na\r\n$1\r\n7\r\n$1\r\nb\r\n",
    b"*2\r\n*2\r\n:1\r\n#t\r\n~1\r\n#f\r\n",
    b"*2\r\n-ERR inside\r\n+QUEUED\r\n",
]


def _hiredis(data: bytes, count: int) -> list:
    reader = hiredis.Reader(replyError=lambda message: ("error", message))
    reader.feed(data)
    out = [reader.gets() for _ in range(count)]
    assert reader.gets() is False
    return out


def test_decode_reads_what_hiredis_reads() -> None:
    data = b"".join(SAMPLES)
    buffer = bytearray(data)
    assert kernels.frame(buffer, len(data), len(SAMPLES)) == len(data)
    got = kernels.decode(buffer, len(data), len(SAMPLES), lambda message: ("error", message))
    assert got == _hiredis(data, len(SAMPLES))


def test_frame_waits_for_whole_replies_and_refuses_what_is_not_resp() -> None:
    data = b"".join(SAMPLES)
    for end in range(len(data)):
        assert kernels.frame(bytearray(data), end, len(SAMPLES)) == -1, end
    assert kernels.frame(bytearray(data), len(data), 3) == sum(map(len, SAMPLES[:3]))
    for garbage in (b"?what\r\n", b"$x\r\n", b"*2\r\n:1\r\nhello\r\n", b"$2\r\nabcd\r\n"):
        with pytest.raises(ValueError):
            kernels.frame(bytearray(garbage), len(garbage), 1)


# -- the walk -------------------------------------------------------------------------------


def _random_blocks(rng: random.Random) -> tuple[Blocks, list[int] | None]:
    width = rng.choice([1, 2, 7, 8, 9, 17])
    per_key = rng.choice([1, 3])
    n = rng.randint(1, 80)
    rows = bytearray()
    row = bytes(per_key * width)
    for _ in range(n):
        if rng.random() < 0.35:  # a new row; otherwise a run of the same holders
            row = bytes(rng.getrandbits(8) & rng.getrandbits(8) for _ in range(per_key * width))
            if rng.random() < 0.05:
                row = bytes(per_key * width)  # nobody holds this block
        rows += row
    ids = [mid for mid in range(8 * width + 3) if rng.random() < 0.9]  # some ids unnamed
    names = {mid: f"pod-{rng.getrandbits(20):06d}-{mid}" for mid in ids}
    view = ModelView.of(16, b"1", names, per_key == 3)
    allowed = None if rng.random() < 0.5 else rng.sample(range(8 * width + 5), rng.randint(0, 9))
    return Blocks(bytes(rows), per_key, width, view), allowed


def test_the_compiled_walk_answers_like_the_numpy_walk() -> None:
    rng = random.Random(13)
    for _ in range(400):
        blocks, allowed = _random_blocks(rng)
        expected = prefix_matches(blocks, allowed)
        assert prefix_matches(blocks, allowed, compiled=True) == expected
        presence = held_positions(blocks, allowed)
        assert held_positions(blocks, allowed, compiled=True) == presence


# -- against Redis --------------------------------------------------------------------------


def _workload(rng: random.Random, pods: list[str], chain: list[int]) -> list[Change]:
    changes = []
    for pod in pods:
        n = rng.randint(0, len(chain))
        tier = rng.choice([Tier.GPU, Tier.GPU, Tier.CPU, Tier.STORAGE])
        changes.append(Change(Op.STORE, pod, M, tier, chain[:n]))
        if n and rng.random() < 0.3:
            hole = rng.randrange(n)
            changes.append(Change(Op.REMOVE, pod, M, tier, [chain[hole]]))
        if n and rng.random() < 0.3:
            changes.append(Change(Op.STORE, pod, M, Tier.GPU, chain[: rng.randint(0, n)]))
    return changes


@pytest.mark.parametrize("buckets", [16, 65536])
def test_every_read_path_answers_like_the_memory_backend(
    redis_server: RedisServer, buckets: int
) -> None:
    """130 pods (bitmaps of 17 bytes: three 64-bit words), every tier, holes."""
    rng = random.Random(buckets)
    pods = members(130)
    chain = [rng.getrandbits(64) for _ in range(200)]
    url = f"{redis_server.url}?buckets={buckets}"
    made = {path: backend_for(url, path) for path in PATHS}
    reference = MemoryBackend()
    try:
        changes = _workload(rng, pods, chain)
        made["compiled"].apply(changes)
        reference.apply(changes)
        other = [rng.getrandbits(64) for _ in range(5)]
        probes = [chain, chain[:1], chain[:37], [other[0], *chain], [*chain[:50], *other]]
        candidates = rng.sample(pods, 9)
        for probe in probes:
            expected = reference.lookup(M, probe)
            expected_some = reference.lookup(M, probe, candidates)
            presence = reference.presence(M, probe)
            for path, backend in made.items():
                assert backend.lookup(M, probe) == expected, path
                assert backend.lookup(M, np.array(probe, np.uint64)) == expected, path
                assert backend.lookup(M, probe, candidates) == expected_some, path
                assert backend.presence(M, probe) == presence, path
    finally:
        for backend in made.values():
            backend.close()


@pytest.mark.parametrize("protocol", [2, 3])
def test_the_compiled_reader_takes_a_clean_answer_whole(
    redis_server: RedisServer, protocol: int
) -> None:
    """Over RESP2 and RESP3 a clean answer is read by ``parse_lookup`` (not left to the
    decoder), into the matrix hiredis + rows_of make of the same bytes."""
    url = f"{redis_server.url}?protocol={protocol}"
    backend = backend_for(url, "compiled")
    pods = members(20)
    chain = list(range(1000, 1100))
    try:
        backend.apply(_workload(random.Random(protocol), pods, chain))
        assert backend.lookup(M, chain)  # the reader knows the model now
        reader, names = backend._reader, backend.keys.model(M)
        heads = reader._heads(M, names)
        for tiers in (False, True):
            per_key = 3 if tiers else 1
            body, commands, order = kernels.pack_reads(
                chain, 16, names.bucket_prefix().encode(), tiers
            )
            payload = b"".join([MULTI, *heads, body, EXEC])
            count = len(heads) + commands + 2
            # made as kvindex makes its own (get_connection's signature differs by version)
            pool = backend.connection.client().connection_pool
            connection = pool.connection_class(**pool.connection_kwargs)
            try:
                buffer = ReadBuffer(64)  # smaller than the answer: the buffer grows
                end = read_answer(connection, payload, count, buffer)
            finally:
                connection.disconnect()
            parsed = kernels.parse_lookup(buffer.data, end, len(heads), commands, order, per_key)
            assert parsed is not None
            replies = _hiredis(bytes(buffer.data[:end]), count)[-1]
            values = [v for reply in replies[len(heads) :] for v in reply]
            names_reply = replies[2]
            if isinstance(names_reply, dict):
                names_reply = [x for item in names_reply.items() for x in item]
            assert parsed[0] == [replies[0], replies[1], names_reply]
            assert (parsed[1], parsed[2]) == rows_of(values, order, per_key)
    finally:
        backend.close()


@pytest.mark.parametrize("path", sorted(PATHS))
def test_an_error_inside_the_transaction_is_raised(redis_server: RedisServer, path: str) -> None:
    backend = backend_for(redis_server.url, path)
    try:
        backend.apply([Change(Op.STORE, "127.0.0.1:8000", M, Tier.GPU, [1, 2, 3])])
        assert backend.lookup(M, [1, 2, 3]) == [MemberMatch("127.0.0.1:8000", 3, (3, 0, 0))]
        bucket = backend.keys.model(M).bucket(1)
        redis_server.client().delete(bucket)
        redis_server.client().set(bucket, b"not a hash")
        with pytest.raises(BackendError, match="WRONGTYPE"):
            backend.lookup(M, [1, 2, 3])
        assert backend.lookup(M, [2, 3]) == [MemberMatch("127.0.0.1:8000", 2, (2, 0, 0))]
    finally:
        backend.close()


# -- the compiled round trip ----------------------------------------------------------------


def test_the_compiled_round_trip_times_out_and_sees_a_closed_connection() -> None:
    """Against a loopback server that accepts and never answers, then closes: the wait
    ends at the timeout (TimeoutError), the close is a ConnectionError; through the
    backend, both are BackendUnavailable (a 503), never a hang."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    server, _ = listener.accept()
    try:
        with pytest.raises(TimeoutError):
            kernels.exchange(client.fileno(), b"*1\r\n$4\r\nPING\r\n", bytearray(16), 1, 0.05)
        server.sendall(b"+PO")  # half a reply, then the server goes away
        server.close()
        with pytest.raises(ConnectionError):
            kernels.exchange(client.fileno(), b"", bytearray(16), 1, 1.0)
        backend = RedisBackend.from_url(f"redis://127.0.0.1:{port}/0?cluster=no&timeout=0.1")
        accepted = []
        thread = threading.Thread(target=lambda: accepted.append(listener.accept()[0]))
        thread.start()
        try:
            with pytest.raises(BackendUnavailable):
                backend.lookup(M, [1, 2, 3])  # redis-py's handshake times out first
        finally:
            thread.join(5)
            backend.close()
            for conn in accepted:
                conn.close()
    finally:
        client.close()
        listener.close()


def test_the_compiled_round_trip_grows_its_buffer_and_refuses_extra_bytes() -> None:
    left, right = socket.socketpair()
    try:
        big = b"$%d\r\n%s\r\n" % (100_000, b"x" * 100_000)
        right.sendall(big)
        buffer = bytearray(16)
        assert kernels.exchange(left.fileno(), b"", buffer, 1, 5.0) == len(big)
        assert bytes(buffer[: len(big)]) == big
        right.sendall(b"+OK\r\n+OK\r\n")
        with pytest.raises(ValueError, match="more than"):
            kernels.exchange(left.fileno(), b"", bytearray(64), 1, 5.0)
    finally:
        left.close()
        right.close()

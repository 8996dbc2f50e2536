"""The KeySpace names every key the Redis backend and the stream leases write, and every
key a script touches came to it in KEYS (Redis Cluster's rule).

Redis does not enforce the KEYS rule for keys of the same slot, so the test watches:
``MONITOR`` on a private server shows each EVALSHA with its KEYS and then every command
the script ran; ``COMMAND GETKEYS`` (Redis's own key specs) says which arguments of each
command are keys. A control run with a script that breaks the rule shows the check can
fail. Real Redis; no mocks.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from dataclasses import dataclass

import pytest
import redis

from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.redis.backend import CLEAR_CHUNK, RedisBackend
from kvindex.indexer.redis.keys import KeySpace
from kvindex.indexer.redis.leases import RedisLeases
from kvindex.indexer.redis.scripts import SCRIPTS
from tests.redis_fixtures import RedisServer

M, OTHER = "acme/model-7b", "a{b}"
A, B, C = "127.10.0.1:8000", "127.10.0.2:8000", "127.10.0.3:8000"
BUCKETS = 4
_END = "kvtest-monitor-end"
_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}


def _unescape(raw: bytes) -> bytes:
    """One MONITOR argument back to its bytes (Redis writes them as C-style escapes)."""
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i] != 0x5C:
            out.append(raw[i])
            i += 1
        elif raw[i + 1 : i + 2] == b"x":
            out.append(int(raw[i + 2 : i + 4], 16))
            i += 4
        else:
            nxt = raw[i + 1 : i + 2]
            out += _ESCAPES.get(nxt, nxt)
            i += 2
    return bytes(out)


@dataclass
class Seen:
    """One command MONITOR showed: who ran it (a client, or ``lua``) and its arguments."""

    by_script: bool
    args: list[bytes]


class Monitor:
    """MONITOR on a raw socket in a thread, until :meth:`stop` (bounded in time)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(b"MONITOR\r\n")
        self.lines: list[bytes] = []
        self._buffer = b""
        self._read_line()  # +OK
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self.port = port

    def _read_line(self) -> bytes:
        while b"\r\n" not in self._buffer:
            data = self.sock.recv(65536)
            if not data:
                raise AssertionError("MONITOR connection closed")
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\r\n", 1)
        return line

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self._read_line()
            if _END.encode() in line:
                return
            self.lines.append(line)

    def stop(self) -> list[Seen]:
        client = redis.Redis(port=self.port, socket_timeout=5)
        client.echo(_END)
        client.close()
        self._thread.join(timeout=30)
        self.sock.close()
        assert not self._thread.is_alive(), "MONITOR never saw the end marker"
        seen = []
        for line in self.lines:
            head, _, rest = line.partition(b"] ")
            seen.append(Seen(head.endswith(b" lua"), [_unescape(a) for a in _ARG.findall(rest)]))
        return seen


def _keys_of(client: redis.Redis, seen: list[Seen]) -> list[list[bytes]]:
    """The key arguments of each command, by Redis's own key specs."""
    pipe = client.pipeline(transaction=False)
    for command in seen:
        pipe.command_getkeys(*command.args)
    out = []
    for result in pipe.execute(raise_on_error=False):
        if isinstance(result, redis.ResponseError):  # a command without key arguments
            out.append([])
        else:
            out.append([k.encode() if isinstance(k, str) else k for k in result])
    return out


def undeclared(client: redis.Redis, seen: list[Seen]) -> list[tuple[bytes, bytes]]:
    """(command, key) for every key a script touched that its EVAL/EVALSHA did not pass
    in KEYS."""
    keys = _keys_of(client, seen)
    declared: set[bytes] = set()
    out = []
    for command, touched in zip(seen, keys, strict=True):
        name = command.args[0].upper()
        if not command.by_script and name in (b"EVAL", b"EVALSHA"):
            declared = set(command.args[3 : 3 + int(command.args[2])])
        elif command.by_script:
            out += [(name, key) for key in touched if key not in declared]
    return out


def _named(keyspace: KeySpace, models: list[str], members: list[str]) -> set[bytes]:
    """Every key the KeySpace can name for these models and members."""
    names = {keyspace.models, keyspace.layout}
    for model in models:
        keys = keyspace.model(model)
        names.update(keys.script_keys())
        names.update(keys.bucket(n) for n in range(BUCKETS))
        for member in members:
            names.update((keys.log(member), keys.log_tmp(member)))
    for member in members:
        stream = keyspace.stream(member)
        names.update((stream.lease, stream.position, stream.digest))
    return {n.encode() for n in names}


def _every_operation(backend: RedisBackend, leases: RedisLeases) -> None:
    """Every script and read path: new members, copies, tiers, id reuse, compaction, a
    one-tier clear over several chunks, full clears, every read, the lease scripts."""
    backend.apply(
        [
            Change(Op.STORE, A, M, Tier.GPU, list(range(40))),
            Change(Op.STORE, A, M, Tier.GPU, [3, 4]),  # second copies
            Change(Op.ANNOUNCE, A, M, Tier.GPU, [3, 41]),
            Change(Op.STORE, B, M, Tier.CPU, list(range(20))),
            Change(Op.STORE, B, OTHER, Tier.GPU, [9]),
            Change(Op.REMOVE, A, M, Tier.GPU, [3, 5]),
        ]
    )
    for round_no in range(3):  # churn: A's reverse record is compacted
        keys = list(range(1000 + 300 * round_no, 1300 + 300 * round_no))
        backend.apply([Change(Op.STORE, A, M, Tier.GPU, keys)])
        backend.apply([Change(Op.REMOVE, A, M, Tier.GPU, keys)])
    big = list(range(10**6, 10**6 + CLEAR_CHUNK + 10))
    backend.apply([Change(Op.STORE, C, M, Tier.GPU, big), Change(Op.STORE, C, M, Tier.CPU, big)])
    backend.apply([Change(Op.CLEAR, C, "", Tier.CPU)])  # rewrites C's record, two chunks
    backend.clear_member(B)
    backend.apply([Change(Op.STORE, B, M, Tier.GPU, [1])])  # B gets an id again
    backend.lookup(M, list(range(40)))
    backend.lookup(M, list(range(40)), [A, B])
    backend.presence(M, list(range(40)))
    backend.member_keys(A, M)
    backend.member_keys(C, M, Tier.GPU)
    backend.member_stats(A)
    backend.stats()
    backend.members()
    backend.ping()
    backend.clear_member(C)
    for member in (A, B):
        keys = leases.keys(member)
        backend.connection.pipeline(
            "lease", [SCRIPTS["lease"].args(keys, ["replica-1", 5000, 7, "ab"])]
        )
        backend.connection.pipeline(
            "lease", [SCRIPTS["lease_release"].args(keys, ["replica-1", 8, "cd"])]
        )


def test_every_script_touches_only_the_keys_it_was_given(redis_server: RedisServer) -> None:
    backend = RedisBackend.from_url(f"{redis_server.url}?buckets={BUCKETS}", prefix="kvt")
    leases = RedisLeases(backend, "replica-1", 5.0)
    monitor = Monitor(redis_server.port)
    try:
        _every_operation(backend, leases)
    finally:
        seen = monitor.stop()
        leases.close()
        backend.close()
    client = redis_server.client()
    scripts = [c for c in seen if c.args[0].upper() == b"EVALSHA"]
    ran = {c.args[1].decode() for c in scripts}
    assert ran >= {SCRIPTS[n].sha for n in ("apply", "clear", "lease", "lease_release")}
    assert sum(c.by_script for c in seen) > 100, "the scripts' own commands were not seen"
    assert undeclared(client, seen) == []


def test_every_key_touched_is_one_the_keyspace_names(redis_server: RedisServer) -> None:
    backend = RedisBackend.from_url(f"{redis_server.url}?buckets={BUCKETS}", prefix="kvt")
    leases = RedisLeases(backend, "replica-1", 5.0)
    monitor = Monitor(redis_server.port)
    try:
        _every_operation(backend, leases)
    finally:
        seen = monitor.stop()
        leases.close()
        backend.close()
    client = redis_server.client()
    named = _named(backend.keys, [M, OTHER], [A, B, C])
    touched = {key for keys in _keys_of(client, seen) for key in keys}
    assert touched, "no command touched a key"
    assert touched <= named, sorted(touched - named)
    written = set(client.scan_iter(count=1000))  # what is left there, too
    assert written and written <= named, sorted(written - named)


def test_the_check_catches_a_script_that_derives_a_key(redis_server: RedisServer) -> None:
    """The control: a script that builds a bucket key from the one it was given, as the
    layout-1 scripts did, is caught."""
    client = redis_server.client()
    keys = KeySpace("kvt").model(M)
    monitor = Monitor(redis_server.port)
    try:
        client.eval(
            "local base = string.sub(KEYS[1], 1, -5) "
            "redis.call('HSET', KEYS[1], 'buckets', 4) "
            "return redis.call('HGET', base .. 'b:3', 'x')",
            1,
            keys.meta,
        )
    finally:
        seen = monitor.stop()
    assert undeclared(client, seen) == [(b"HGET", keys.bucket(3).encode())]


def test_index_scripts_get_the_models_fixed_keys_first() -> None:
    keys = KeySpace("kvt").model(M)
    command = SCRIPTS["apply"].args(keys.script_keys(), [b"x"])
    assert command[:3] == ("EVALSHA", SCRIPTS["apply"].sha, 6)
    assert command[3:9] == (keys.meta, keys.stats, keys.ids, keys.names, keys.free, keys.copies)
    # One hash tag for all of a model's keys, buckets and records too (one cluster slot).
    every = [*command[3:9], keys.bucket(3), keys.log(A), keys.log_tmp(A)]
    assert {re.search(r"\{(.*?)\}", k).group(1) for k in every} == {M}


@pytest.mark.parametrize("bad", ["", "a{b", "x}"])
def test_a_prefix_that_cannot_be_one_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        KeySpace(bad)

"""The Lua scripts of the Redis backend, and how they are called.

The sources are in ``indexer/lua/``, one ``.lua`` file per script (each says what its
``KEYS`` and ``ARGV`` are and what it returns); every index script runs after
``prelude.lua``, its shared helpers. They ship as package data (``pyproject.toml``).

Why server-side scripts for writes: a store or remove must read a block's member
bitmap, change one bit and write it back, keep per-member counters exact and append to
the member's reverse record. Done from the client that is several round trips per
block; as a script it is one round trip per delivery chunk, and atomic. Reads are not
scripts (:mod:`kvindex.indexer.redis_read`): a lookup is one ``MULTI``/``EXEC`` of plain
``HMGET``s and the walk runs in the client, because Redis runs one script at a time
and a walk in Lua cost Redis ~0.9 ms per 512-block lookup against ~0.06 ms for the
reads alone (``bench/bench_redis.py``).

Every key a script touches comes in ``KEYS`` (Redis Cluster's rule): the model's six
fixed keys first (``meta``, ``stats``, ``ids``, ``names``, ``free``, ``copies``:
:meth:`kvindex.indexer.redis_keys.ModelKeys.script_keys`), then the reverse records
and buckets the call touches, which ARGV points at by position; the scripts never build
a key name. All share the model's hash tag, so in Redis Cluster they live in one slot
(see docs/redis.md). The names are made in one place,
:mod:`kvindex.indexer.redis_keys`. Layout 2 (``redis_keys.LAYOUT``), with ``B`` =
``<prefix>:{<model>}:``:

* ``B meta``   hash: ``buckets`` (fixed when the model is first written), ``layout``,
  ``next_id``, ``epoch`` (bumped when a member id is given or freed).
* ``B b:<n>``  hash, one of ``buckets``: field = block key (8 bytes, big-endian) for
  GPU, key + ``\\1`` for CPU, key + ``\\2`` for STORAGE; value = bitmap of member ids
  (bit ``id % 8`` of byte ``id // 8``), trailing zero bytes trimmed, never empty. The
  bucket is the key's low 16 bits modulo ``buckets``.
* ``B ids`` / ``B names``  hashes: member → id and id → member; ids are per model,
  the smallest free one is reused (``B free``, a sorted set) so bitmaps stay short.
* ``B log:<member>``  string: the reverse record, 8-byte keys the member came to hold,
  in order; entries go stale when it drops a block and are compacted away
  (``B log:<member>:tmp`` holds a rewrite in progress).
* ``B copies``  hash: field = block key + tier byte + member id (decimal), value = the
  entry's copies past the first (vLLM holds one hash in several physical blocks and
  publishes a store and a removal per copy); only entries with two or more copies.
* ``B stats``  hash: ``k`` distinct keys held by anyone, ``t<tier>`` entries per tier,
  ``e<tier>:<id>`` a member's entries per tier, ``h:<id>`` distinct keys it holds,
  ``c`` fields of ``B copies``.
* ``<prefix>:models`` set of the models written, ``<prefix>:layout`` the layout.

A script run on a model written in another layout answers the error ``KVLAYOUT <n>``
and changes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib.resources import files
from typing import Any

_LUA = files("kvindex.indexer").joinpath("lua")


def _source(name: str) -> str:
    return _LUA.joinpath(f"{name}.lua").read_text(encoding="utf-8")


#: Scripts over one model's keys (KEYS[1] is its ``meta`` key): each runs after the
#: prelude. The stream-lease and incarnation scripts stand alone.
INDEX_SCRIPTS = ("apply", "clear", "member_stats", "model_stats")
LEASE_SCRIPTS = ("lease", "lease_release", "incarnation")


class Script:
    """A Lua script called by its SHA1 (EVALSHA), loaded on first NOSCRIPT."""

    __slots__ = ("name", "sha", "source")

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def args(self, key: str | Sequence[str], argv: Sequence[Any]) -> tuple[Any, ...]:
        """The EVALSHA command for one call on ``key`` (or keys of one hash tag)."""
        keys = (key,) if isinstance(key, str) else tuple(key)
        return ("EVALSHA", self.sha, len(keys), *keys, *argv)


def _load() -> dict[str, Script]:
    prelude = _source("prelude")
    scripts = {name: Script(name, prelude + _source(name)) for name in INDEX_SCRIPTS}
    scripts.update((name, Script(name, _source(name))) for name in LEASE_SCRIPTS)
    return scripts


SCRIPTS = _load()

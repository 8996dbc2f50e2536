"""Every Redis key kvindex writes, named in one place (:class:`ModelKeys` describes the
layout they form).

Why one object: the backend, the stream leases, the Lua scripts, the benchmarks and
the tests all need the same names, and a key spelled out in two places is a key that
will one day be spelled two ways. Every key starts with the prefix; every key of one
model carries the model as its hash tag (and every key of one stream the stream's
member), so in Redis Cluster each script's keys live in one slot.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from kvindex.indexer.backend import BackendUnavailable

#: The layout this code reads and writes, kept in every model's ``meta`` (``layout``)
#: and prefix-wide in ``<prefix>:layout``. 1 (no ``layout`` field): reverse records
#: by member id and lookups walked in Lua; 2: reverse records by member name, every key
#: a script touches in ``KEYS``, a ``meta`` epoch for the member names, lookups read with
#: plain HMGETs. A model written in another layout is refused (RedisLayoutError).
LAYOUT = 2


class RedisLayoutError(BackendUnavailable):
    """Redis holds kvindex data of another layout than this code's: refused, never
    mixed (a reader would misread it and a writer corrupt it)."""

    code = "redis_layout_mismatch"

    @classmethod
    def found(cls, prefix: str, model: str | None, layout: bytes | str | None) -> RedisLayoutError:
        found = layout.decode() if isinstance(layout, bytes) else (layout or "1")
        where = f"model {model!r}" if model is not None else "the index"
        return cls(
            f"Redis holds kvindex data of layout {found} under prefix {prefix!r} ({where}); "
            f"this kvindex reads and writes layout {LAYOUT} only. Start it with another "
            f"--redis-prefix, or delete every key starting with '{prefix}:' once no older "
            f"replica writes there; the index then fills from the pods' events (blocks "
            f"they stored before score as cold until stored again)."
        )


def model_tag(model: str) -> str:
    """The model as a Redis Cluster hash tag: its name, unless that could not be one
    (empty, or holding a brace), then a digest of it."""
    if model and "{" not in model and "}" not in model:
        return model
    return "#" + hashlib.sha1(model.encode()).hexdigest()[:16]


def bucket_numbers(keys: np.ndarray, buckets: int) -> np.ndarray:
    """Which bucket each block key (uint64) lives in: its low 16 bits modulo the count."""
    return (keys & np.uint64(0xFFFF)).astype(np.int64) % buckets


@dataclass(frozen=True, slots=True)
class ModelKeys:
    """One model's keys; ``base`` is ``<prefix>:{<model tag>}:``.

    Redis Cluster's rule is that a script names every key it touches in ``KEYS``. The
    scripts never build a key name: the client names every key here and passes it in
    ``KEYS`` - the model's six fixed keys first (``meta``, ``stats``, ``ids``, ``names``,
    ``free``, ``copies``: :meth:`script_keys`), then the reverse records of the members a
    call writes (:meth:`log`, by member name, so the client knows it without asking Redis
    for the member's id) and the buckets its block keys fall in (:func:`bucket_numbers`,
    from the bucket count the model's ``meta`` fixed) - and the script takes each key
    from ``KEYS`` by the position ARGV gives. All share the model's hash tag, so in Redis
    Cluster they live in one slot (see docs/redis.md).

    Layout 2 (:data:`LAYOUT`), with ``B`` = ``<prefix>:{<model>}:``:

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

    base: str

    @property
    def meta(self) -> str:
        """Hash: ``buckets`` (fixed by the model's first write), ``layout``, ``next_id``,
        ``epoch`` (bumped whenever a member id is given or freed, so readers can cache
        the id -> name map)."""
        return self.base + "meta"

    @property
    def stats(self) -> str:
        """Hash: per-model and per-member counters."""
        return self.base + "stats"

    @property
    def ids(self) -> str:
        """Hash: member name -> member id."""
        return self.base + "ids"

    @property
    def names(self) -> str:
        """Hash: member id -> member name."""
        return self.base + "names"

    @property
    def free(self) -> str:
        """Sorted set: member ids free for reuse (smallest first, so bitmaps stay short)."""
        return self.base + "free"

    @property
    def copies(self) -> str:
        """Hash: extra copies of a (block, tier, member) entry past the first."""
        return self.base + "copies"

    def bucket(self, n: int) -> str:
        """Hash ``n`` of the model's buckets: block key (+ tier byte) -> member bitmap."""
        return f"{self.base}b:{n}"

    def bucket_prefix(self) -> str:
        """Every bucket's name before its number (the lookup packs the names itself)."""
        return f"{self.base}b:"

    def log(self, member: str) -> str:
        """String: the member's reverse record (8-byte keys it came to hold)."""
        return f"{self.base}log:{member}"

    def log_tmp(self, member: str) -> str:
        """String: the member's reverse record being rewritten (a one-tier clear)."""
        return f"{self.base}log:{member}:tmp"

    def script_keys(self) -> tuple[str, str, str, str, str, str]:
        """The first six ``KEYS`` of every index script, in the order ``prelude.lua``
        reads them."""
        return (self.meta, self.stats, self.ids, self.names, self.free, self.copies)


@dataclass(frozen=True, slots=True)
class StreamKeys:
    """One pod stream's lease keys (``<prefix>:stream:{<member>}:``)."""

    lease: str  # string: the replica holding the lease, with a TTL
    position: str  # string: where the stream's owner resumes
    digest: str  # string: the payload digest (hex) of the batch at the position


class KeySpace:
    """Every key under ``prefix``: ``models`` (a set of the model names written),
    ``layout`` (the layout version of everything under the prefix), ``incarnation``
    and ``rebuilds`` (:mod:`kvindex.indexer.redis.incarnation`; one hash tag, so one script
    touches both in a cluster), each model's :class:`ModelKeys` and each stream's
    :class:`StreamKeys`."""

    __slots__ = ("_models", "incarnation", "layout", "models", "prefix", "rebuilds")

    def __init__(self, prefix: str) -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"Redis key prefix {prefix!r} must be non-empty, without braces")
        self.prefix = prefix
        self.models = f"{prefix}:models"
        self.layout = f"{prefix}:layout"
        # string: a token written with the index; gone or changed = Redis lost the index
        self.incarnation = f"{prefix}:{{index}}:incarnation"
        # hash: member -> how its stream's rebuild after the last loss stands
        self.rebuilds = f"{prefix}:{{index}}:rebuilds"
        self._models: dict[str, ModelKeys] = {}

    def model(self, model: str) -> ModelKeys:
        keys = self._models.get(model)
        if keys is None:
            keys = self._models[model] = ModelKeys(f"{self.prefix}:{{{model_tag(model)}}}:")
        return keys

    def stream(self, member: str) -> StreamKeys:
        base = f"{self.prefix}:stream:{{{member}}}:"
        return StreamKeys(base + "lease", base + "pos", base + "digest")

"""Every Redis key kvindex writes, named in one place (the layout is described in
:mod:`kvindex.indexer.redis_scripts`).

Why one object: the backend, the stream leases, the Lua scripts, the benchmarks and
the tests all need the same names, and a key spelled out in two places is a key that
will one day be spelled two ways. Every key starts with the prefix; every key of one
model carries the model as its hash tag (and every key of one stream the stream's
member), so in Redis Cluster each script's keys live in one slot.

Redis Cluster's rule is that a script names every key it touches in ``KEYS``. The
index scripts get the model's fixed keys there (:meth:`ModelKeys.script_keys`); the
bucket (``b:<n>``) and reverse-record (``log:<id>``) keys are still derived inside
the scripts from the same base, because which ones a call touches is known only there:
a member's id is allocated by the script, and a clear walks the reverse record it reads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def model_tag(model: str) -> str:
    """The model as a Redis Cluster hash tag: its name, unless that could not be one
    (empty, or holding a brace), then a digest of it."""
    if model and "{" not in model and "}" not in model:
        return model
    return "#" + hashlib.sha1(model.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class ModelKeys:
    """One model's keys; ``base`` is ``<prefix>:{<model tag>}:``."""

    base: str

    @property
    def meta(self) -> str:
        """Hash: ``buckets`` (fixed by the model's first write), ``next_id``."""
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

    def log(self, member_id: int) -> str:
        """String: the member's reverse record (8-byte keys it came to hold)."""
        return f"{self.base}log:{member_id}"

    def log_tmp(self, member_id: int) -> str:
        """String: the reverse record being compacted."""
        return f"{self.base}log:{member_id}:tmp"

    def script_keys(self) -> tuple[str, str, str, str, str, str]:
        """``KEYS`` of every index script, in the order ``prelude.lua`` reads them."""
        return (self.meta, self.stats, self.ids, self.names, self.free, self.copies)


@dataclass(frozen=True, slots=True)
class StreamKeys:
    """One pod stream's lease keys (``<prefix>:stream:{<member>}:``)."""

    lease: str  # string: the replica holding the lease, with a TTL
    position: str  # string: where the stream's owner resumes
    digest: str  # string: the payload digest (hex) of the batch at the position


class KeySpace:
    """Every key under ``prefix``: ``models`` (a set of the model names written), each
    model's :class:`ModelKeys` and each stream's :class:`StreamKeys`."""

    __slots__ = ("_models", "models", "prefix")

    def __init__(self, prefix: str) -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"Redis key prefix {prefix!r} must be non-empty, without braces")
        self.prefix = prefix
        self.models = f"{prefix}:models"
        self._models: dict[str, ModelKeys] = {}

    def model(self, model: str) -> ModelKeys:
        keys = self._models.get(model)
        if keys is None:
            keys = self._models[model] = ModelKeys(f"{self.prefix}:{{{model_tag(model)}}}:")
        return keys

    def stream(self, member: str) -> StreamKeys:
        base = f"{self.prefix}:stream:{{{member}}}:"
        return StreamKeys(base + "lease", base + "pos", base + "digest")

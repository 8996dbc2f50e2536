"""The Lua scripts of the Redis backend, and how they are called.

The sources are in ``indexer/redis/lua/``, one ``.lua`` file per script (each says what its
``KEYS`` and ``ARGV`` are and what it returns); every index script runs after
``prelude.lua``, its shared helpers. They ship as package data (``pyproject.toml``).

Why server-side scripts for writes: a store or remove must read a block's member
bitmap, change one bit and write it back, keep per-member counters exact and append to
the member's reverse record; as a script it is one round trip per delivery chunk, and
atomic. Reads are not scripts (:mod:`kvindex.indexer.redis.read` says why).

Every key a script touches comes in ``KEYS`` (Redis Cluster's rule), named and laid out
by :class:`~kvindex.indexer.redis.keys.ModelKeys`. A script run on a model written in
another layout answers the error ``KVLAYOUT <n>`` and changes nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib.resources import files
from typing import Any

_LUA = files("kvindex.indexer.redis").joinpath("lua")


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

"""The Redis backend: one index shared by every kvindex replica, kept across restarts.

Layout (details in :mod:`kvindex.indexer.redis_scripts` and the README's "Shared index
in Redis"): per model, block keys live in a fixed number of Redis hashes ("buckets"),
each field a block key and each value a bitmap of the per-model member ids holding it
in that tier: one hash field per block (~64 bytes) instead of a Redis key per block
(~100 bytes), and with many buckets each stays small enough for Redis's compact
listpack encoding (~19 bytes per block, slower lookups). Each member has a reverse
record (the keys it came to hold), so clearing a pod costs that pod's blocks, never a
scan. Every key starts with the prefix and carries the model as its hash tag.

Round trips: ``apply`` is one pipeline of script calls per delivery chunk (plus one
per CLEAR, which runs in bounded chunks); ``lookup`` is one script call whatever the
prompt length. No ``KEYS`` and no ``SCAN`` anywhere.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Collection, Sequence
from typing import Any

import msgspec
import numpy as np

from kvindex.indexer.backend import (
    TIERS,
    Change,
    IndexStats,
    MemberMatch,
    MemberPresence,
    MemberStats,
    Op,
    Tier,
)
from kvindex.indexer.redis_conn import RedisConnection, RedisOptions
from kvindex.indexer.redis_keys import KeySpace
from kvindex.indexer.redis_scripts import SCRIPTS

#: Most keys one script call touches: bounds how long one call holds Redis (~2 ms).
SCRIPT_KEYS = 2048
#: Reverse-record entries one clear or compaction call reads.
CLEAR_CHUNK = 4096

_APPLY, _CLEAR, _LOOKUP = SCRIPTS["apply"], SCRIPTS["clear"], SCRIPTS["lookup"]
_MEMBER_STATS, _MEMBER_KEYS = SCRIPTS["member_stats"], SCRIPTS["member_keys"]
_MODEL_STATS = SCRIPTS["model_stats"]
_PRESENCE = SCRIPTS["presence"]
_OPS = {Op.STORE: b"s", Op.REMOVE: b"r", Op.ANNOUNCE: b"a"}
_TIER_ARG = {Tier.GPU: b"0", Tier.CPU: b"1", Tier.STORAGE: b"2"}
_LITTLE = sys.byteorder == "little"
_decode_flat = msgspec.msgpack.Decoder(list[str | int]).decode


def pack_keys(keys: Sequence[int] | np.ndarray) -> bytes:
    """Block keys as 8-byte big-endian words; ValueError unless each is in [0, 2**64)."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1:
            raise ValueError(f"block keys must be one-dimensional, got shape {keys.shape}")
        kind = keys.dtype.kind
        if kind == "u" or (kind == "i" and not (keys < 0).any()):
            return keys.astype(">u8", copy=False).tobytes()
        raise ValueError(f"block keys must be unsigned 64-bit integers, got {keys.dtype}")
    try:
        words = array("Q", keys)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"block keys must be integers in [0, 2**64): {exc}") from None
    if _LITTLE:
        words.byteswap()
    return words.tobytes()


def unpack_keys(packed: bytes) -> list[int]:
    words = array("Q", packed)
    if _LITTLE:
        words.byteswap()
    return words.tolist()


def lookup_reply(packed: bytes) -> list[MemberMatch]:
    """The lookup script's msgpack reply as matches, best first."""
    reply = _decode_flat(packed)
    out = [
        MemberMatch(reply[i], reply[i + 1], (reply[i + 2], reply[i + 3], reply[i + 4]))
        for i in range(0, len(reply), 5)
    ]
    out.sort(key=lambda m: (-m.matched_blocks, -m.by_tier[0], m.member))
    return out


class RedisBackend:
    """An :class:`~kvindex.indexer.backend.IndexBackend` in Redis (or Redis Cluster).

    Writers and readers may be in different processes; each script call is atomic, so a
    lookup never sees half of a store. ``buckets`` is used for a model's first write only.
    """

    def __init__(
        self, connection: RedisConnection, prefix: str = "kvindex", buckets: int | None = None
    ) -> None:
        self.keys = KeySpace(prefix)  # ValueError for a prefix that cannot be one
        self.connection = connection
        self.prefix = prefix
        self._buckets = buckets or connection.options.buckets
        self._models_key = self.keys.models
        self._known_models: list[str] = []  # as last read; a guess, never trusted alone

    @classmethod
    def from_url(cls, url: str, prefix: str = "kvindex") -> RedisBackend:
        """``redis://host:port/db`` (``rediss://``, ``unix://``; options in
        :mod:`kvindex.indexer.redis_conn`). Does not connect yet."""
        return cls(RedisConnection(RedisOptions.from_url(url)), prefix)

    def meta_key(self, model: str) -> str:
        """The model's ``meta`` key; every other key of the model shares its tag."""
        return self.keys.model(model).meta

    def _script_keys(self, model: str) -> tuple[str, ...]:
        return self.keys.model(model).script_keys()

    # -- writes ------------------------------------------------------------------------------

    def apply(self, changes: Sequence[Change]) -> None:
        """Apply in order: runs of stores and removes as one pipeline of script calls
        (one per model and ~``SCRIPT_KEYS`` keys), each CLEAR on its own."""
        for step in _plan(changes):
            if isinstance(step, _ClearStep):
                self._clear(step.member, step.tier)
            else:
                self._apply_run(step)

    def _apply_run(self, run: dict[str, list[list[bytes]]]) -> None:
        commands: list[tuple[Any, ...]] = [("SADD", self._models_key, *run)]
        default = str(self._buckets).encode()
        for model, calls in run.items():
            keys = self._script_keys(model)
            commands += [_APPLY.args(keys, [default, *argv]) for argv in calls]
        results = self.connection.pipeline("apply", commands)
        for model, result in zip(_models_of(run), results[1:], strict=True):
            for member in result:
                self._chunked(model, member.decode(), b"")

    def _clear(self, member: str, tier: Tier | None) -> int:
        which = b"a" if tier is None else _TIER_ARG[tier]
        return sum(self._chunked(model, member, which) for model in self._models())

    def _chunked(self, model: str, member: str, which: bytes) -> int:
        """Run the clear/compaction script over the member's whole reverse record."""
        keys = self._script_keys(model)
        offset, dropped = 0, 0
        while offset >= 0:
            n, offset = self.connection.call(
                "clear", *_CLEAR.args(keys, [member, which, offset, CLEAR_CHUNK])
            )
            dropped += n
        return dropped

    def clear_member(self, member: str) -> int:
        """Drop everything ``member`` holds; cost: its reverse records, in chunks."""
        return self._clear(member, None)

    # -- reads -------------------------------------------------------------------------------

    def lookup(
        self, model: str, keys: Sequence[int], members: Collection[str] | None = None
    ) -> list[MemberMatch]:
        """One script call: each member's longest held prefix of ``keys``, best first."""
        argv: list[Any] = [pack_keys(keys)]
        if not argv[0]:
            return []
        if members is not None:
            argv += list(members)
            if len(argv) == 1:
                return []
        return lookup_reply(
            self.connection.call("lookup", *_LOOKUP.args(self._script_keys(model), argv))
        )

    def presence(
        self, model: str, keys: Sequence[int], members: Collection[str] | None = None
    ) -> list[MemberPresence]:
        """One script call: per member, which positions of ``keys`` it holds per tier."""
        argv: list[Any] = [pack_keys(keys)]
        if not argv[0]:
            return []
        if members is not None:
            argv += list(members)
            if len(argv) == 1:
                return []
        keys = self._script_keys(model)
        ids, blocks = self.connection.call("presence", *_PRESENCE.args(keys, argv))
        names = {int(ids[i]): ids[i + 1].decode() for i in range(0, len(ids), 2)}
        masks: dict[str, list[int]] = {}
        for i in range(0, len(blocks), 4):
            bit = 1 << int(blocks[i])
            for tier in TIERS:
                bitmap = int.from_bytes(blocks[i + 1 + tier], "little")  # bit id = member id
                while bitmap:
                    low = bitmap & -bitmap
                    name = names.get(low.bit_length() - 1)
                    if name is not None:
                        masks.setdefault(name, [0, 0, 0])[tier] |= bit
                    bitmap ^= low
        return [MemberPresence(m, tuple(masks[m])) for m in sorted(masks)]  # type: ignore[arg-type]

    def models(self) -> list[str]:
        """Every model written to this index (one call; /score's model check uses it
        instead of one member_stats round trip per member)."""
        return self._models()

    def _models(self) -> list[str]:
        with self.connection.guard("models"):
            names = self.connection.client().smembers(self._models_key)
        return sorted(n.decode() for n in names)

    def _per_model(self, op: str, script_name: str, argv: list[Any]) -> list[tuple[str, Any]]:
        """Run a script for every model. One round trip when the models are the ones
        seen last time: the model list is read in the same pipeline, and only models
        that appeared since cost a second round trip."""
        script = SCRIPTS[script_name]
        guess = self._known_models
        results = self.connection.pipeline(
            op,
            [("SMEMBERS", self._models_key)]
            + [script.args(self._script_keys(m), argv) for m in guess],
        )
        models = sorted(n.decode() for n in results[0])
        found = dict(zip(guess, results[1:], strict=True))
        missing = [m for m in models if m not in found]
        if missing:
            more = self.connection.pipeline(
                op, [script.args(self._script_keys(m), argv) for m in missing]
            )
            found.update(zip(missing, more, strict=True))
        self._known_models = models
        return [(m, found[m]) for m in models]

    def member_stats(self, member: str) -> MemberStats | None:
        stats = MemberStats(member)
        for model, counts in self._per_model("member_stats", "member_stats", [member]):
            per_tier = {t: int(counts[t]) for t in TIERS if counts and counts[t]}
            if per_tier:
                stats.blocks[model] = per_tier
        return stats if stats.blocks else None

    def member_keys(self, member: str, model: str, tier: Tier | None = None) -> list[int]:
        keys = self._script_keys(model)
        which = b"" if tier is None else _TIER_ARG[tier]
        found: set[int] = set()
        offset = 0
        while offset >= 0:
            packed, offset = self.connection.call(
                "member_keys", *_MEMBER_KEYS.args(keys, [member, which, offset, CLEAR_CHUNK])
            )
            found.update(unpack_keys(packed))
        return sorted(found)

    def members(self) -> list[str]:
        names: set[str] = set()
        for _, reply in self._per_model("members", "model_stats", []):
            names.update(n.decode() for n in reply[4:])
        return sorted(names)

    def stats(self) -> IndexStats:
        names: set[str] = set()
        blocks = dict.fromkeys(TIERS, 0)
        keys = models = 0
        for _, reply in self._per_model("stats", "model_stats", []):
            keys += reply[0]
            for tier in TIERS:
                blocks[tier] += reply[1 + tier]
            names.update(n.decode() for n in reply[4:])
            models += 1 if reply[0] else 0
        return IndexStats(
            members=len(names), blocks=blocks, keys=keys, extra={"models": float(models)}
        )

    def ping(self) -> None:
        self.connection.ping()

    def close(self) -> None:
        self.connection.close()

    def error_counts(self) -> dict[str, int]:
        """Redis errors since start, by operation (no Redis call: safe while it is down)."""
        return dict(self.connection.errors)


# -- planning ------------------------------------------------------------------------------


class _ClearStep:
    __slots__ = ("member", "tier")

    def __init__(self, member: str, tier: Tier | None) -> None:
        self.member = member
        self.tier = tier


#: A run of stores and removes: per model, the ARGV tails of its script calls.
_Run = dict[str, list[list[bytes]]]


def _models_of(run: _Run) -> list[str]:
    return [model for model, calls in run.items() for _ in calls]


def _plan(changes: Sequence[Change]) -> list[_Run | _ClearStep]:
    """Validate every change (nothing is written when one is invalid) and cut them into
    steps: runs of stores and removes, split per model (models are independent, so only
    the order within a model matters) and into script calls of about ``SCRIPT_KEYS``
    keys; each CLEAR is a step of its own, so nothing moves across it."""
    steps: list[_Run | _ClearStep] = []
    run: _Run = {}
    sizes: dict[str, int] = {}
    for change in changes:
        op, tier = change.op, change.tier
        if op is Op.CLEAR:
            if tier is not None and not isinstance(tier, Tier):
                raise ValueError(f"CLEAR tier must be a Tier or None, got {tier!r}")
            if run:
                steps.append(run)
                run, sizes = {}, {}
            steps.append(_ClearStep(change.member, tier))
            continue
        code = _OPS.get(op)
        if code is None:
            raise ValueError(f"unknown op {op!r}")
        if not isinstance(tier, Tier):
            raise ValueError(f"{op.name} needs a tier, got {tier!r}")
        packed = pack_keys(change.keys)
        if not packed:
            continue
        member = change.member.encode()
        calls = run.setdefault(change.model, [])
        step = SCRIPT_KEYS * 8
        for start in range(0, len(packed), step):
            piece = packed[start : start + step]
            if not calls or sizes[change.model] + len(piece) > step:
                calls.append([])
                sizes[change.model] = 0
            calls[-1] += [code, member, _TIER_ARG[tier], piece]
            sizes[change.model] += len(piece)
    if run:
        steps.append(run)
    return steps

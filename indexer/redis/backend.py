"""The Redis backend: one index shared by every kvindex replica, kept across restarts.

Layout (details in :class:`~kvindex.indexer.redis.keys.ModelKeys` and docs/redis.md): per
model, block keys live in a fixed number of Redis hashes ("buckets"), each field a block
key and each value a bitmap of the per-model member ids holding it in that tier: one hash
field per block instead of a Redis key per block (bench/README.md has the bytes). Each
member has a reverse record (the keys it came to hold), so clearing a pod costs that
pod's blocks, never a scan. Every key starts with the prefix and carries the model as its
hash tag.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from kvindex.indexer.backend import (
    TIERS,
    BackendError,
    Change,
    IndexStats,
    MemberMatch,
    MemberPresence,
    MemberStats,
    Op,
    Tier,
)
from kvindex.indexer.redis.connection import RedisConnection, RedisOptions
from kvindex.indexer.redis.keys import (
    LAYOUT,
    KeySpace,
    ModelKeys,
    RedisLayoutError,
    bucket_numbers,
)
from kvindex.indexer.redis.read import BlockReader
from kvindex.indexer.redis.scripts import SCRIPTS
from kvindex.indexer.redis.walk import held_positions, prefix_matches
from kvindex.indexer.redis.wire import key_array, pack_keys, unpack_keys

#: Most keys one script call touches: bounds how long one call holds Redis.
SCRIPT_KEYS = 2048
#: Reverse-record entries one clear or compaction call reads.
CLEAR_CHUNK = 4096

#: Times a clear reads a chunk of the record again because it changed under it.
_CLEAR_RETRIES = 8

_APPLY, _CLEAR = SCRIPTS["apply"], SCRIPTS["clear"]
_OPS = {Op.STORE: b"s", Op.REMOVE: b"r", Op.ANNOUNCE: b"a"}
_TIER_ARG = {Tier.GPU: b"0", Tier.CPU: b"1", Tier.STORAGE: b"2"}
_LAYOUT = str(LAYOUT).encode()

__all__ = ["RedisBackend", "pack_keys"]


class RedisBackend:
    """An :class:`~kvindex.indexer.backend.IndexBackend` in Redis (or Redis Cluster).

    Writers and readers may be in different processes; each script call is atomic and a
    read is one transaction, so a lookup never sees half of a store. ``buckets`` is used
    for a model's first write only.

    Round trips: ``apply`` is one pipeline of script calls per delivery chunk (plus, per
    CLEAR, two per chunk of the member's record: read it, then clear it); ``lookup`` and
    ``presence`` are one MULTI/EXEC of HMGETs whatever the prompt length
    (:mod:`kvindex.indexer.redis.read`), the walk done here
    (:mod:`kvindex.indexer.redis.walk`). Every key a script touches is passed in ``KEYS``.
    No ``KEYS`` command and no ``SCAN`` anywhere.
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
        self._reader = BlockReader(connection, self.keys)
        self._write_buckets: dict[str, int] = {}  # per model, as its meta said
        self._layout_checked = False
        # Redis lost the index: entries this replica wrote before it noticed may sit
        # there without the layout key; the next write claims it again.
        self._layout_lost = False

    @classmethod
    def from_url(cls, url: str, prefix: str = "kvindex") -> RedisBackend:
        """``redis://host:port/db`` (``rediss://``, ``unix://``; options in
        :mod:`kvindex.indexer.redis.connection`). Does not connect yet."""
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
        steps = _plan(changes)
        if steps and not self._layout_checked:
            self._check_layout(claim=True)
        for step in steps:
            if isinstance(step, _ClearStep):
                self._clear(step.member, step.tier)
            else:
                self._apply_run(step)

    def _apply_run(self, run: _Run) -> None:
        pending = list(run.items())
        commands: list[tuple[Any, ...]] = [("SADD", self._models_key, *run)]
        for attempt in range(2):
            sent = [
                (model, call, self._write_buckets.get(model, self._buckets))
                for model, calls in pending
                for call in calls
            ]
            commands += [self._apply_command(model, buckets, call) for model, call, buckets in sent]
            results = self.connection.pipeline("apply", commands)[len(commands) - len(sent) :]
            retry: dict[str, list[_Call]] = {}
            for (model, call, buckets), result in zip(sent, results, strict=True):
                if int(result[0]) == 1:  # the model's meta fixed another bucket count
                    self._write_buckets[model] = int(result[1])
                    retry.setdefault(model, []).append(call)
                    continue
                self._write_buckets[model] = buckets
                for member in result[1:]:
                    self._chunked(model, member.decode(), b"")
            if not retry:
                return
            if attempt:
                raise BackendError(f"Redis: bucket counts of {sorted(retry)} kept changing")
            pending, commands = list(retry.items()), []

    def _apply_command(self, model: str, buckets: int, call: _Call) -> tuple[Any, ...]:
        """The apply script's EVALSHA for one call: every key it touches in KEYS."""
        names = self.keys.model(model)
        keys: list[str] = list(names.script_keys())
        log_at: dict[str, int] = {}
        for _, member, _, _ in call:
            if member not in log_at:
                log_at[member] = len(keys) + 1
                keys += [names.log(member), names.log_tmp(member)]
        packed = b"".join(piece for _, _, _, piece in call)
        bucket_keys, positions = _buckets_of(names, unpack_keys(packed), buckets, len(keys) + 1)
        keys += bucket_keys
        argv: list[Any] = [buckets]
        at = 0
        for code, member, tier, piece in call:
            n = len(piece) // 4  # two position bytes per 8-byte key
            argv += [code, member, log_at[member], tier, piece, positions[at : at + n]]
            at += n
        return _APPLY.args(keys, argv)

    def _clear(self, member: str, tier: Tier | None) -> int:
        which = b"a" if tier is None else _TIER_ARG[tier]
        return sum(self._chunked(model, member, which) for model in self._models())

    def _chunked(self, model: str, member: str, which: bytes) -> int:
        """Run the clear/compaction script over the member's whole reverse record, a
        chunk at a time: read the chunk, then clear it with its buckets in KEYS."""
        names = self.keys.model(model)
        record, rewrite = names.log(member), names.log_tmp(member)
        offset, dropped, rereads = 0, 0, 0
        while offset >= 0:
            chunk, buckets = self.connection.pipeline(
                "clear",
                [
                    ("GETRANGE", record, offset * 8, (offset + CLEAR_CHUNK) * 8 - 1),
                    ("HGET", names.meta, "buckets"),
                ],
            )
            if buckets is None:
                return dropped
            keys = [*names.script_keys(), record, rewrite]
            bucket_keys, positions = _buckets_of(names, unpack_keys(chunk), int(buckets), 9)
            argv = [buckets, member, which, offset, CLEAR_CHUNK, chunk, positions]
            n, next_offset = self.connection.call("clear", *_CLEAR.args(keys + bucket_keys, argv))
            if next_offset == -2:  # the record changed between the two calls
                rereads += 1
                if rereads > _CLEAR_RETRIES:
                    raise BackendError(f"Redis: {member!r}'s record kept changing during a clear")
                continue
            dropped += n
            offset = next_offset
        return dropped

    def clear_member(self, member: str) -> int:
        """Drop everything ``member`` holds; cost: its reverse records, in chunks."""
        return self._clear(member, None)

    def _check_layout(self, *, claim: bool) -> None:
        """Refuse a prefix holding data of another layout; with ``claim``, mark an
        empty prefix as this layout's (before the first write)."""
        layout, models = self.connection.pipeline(
            "layout", [("GET", self.keys.layout), ("EXISTS", self._models_key)]
        )
        if layout is None and models and not self._layout_lost:
            raise RedisLayoutError.found(self.prefix, None, None)
        if layout is not None and layout != _LAYOUT:
            raise RedisLayoutError.found(self.prefix, None, layout)
        if claim and layout is None:
            self.connection.call("layout", "SET", self.keys.layout, LAYOUT, "NX")
        if claim:
            self._layout_checked, self._layout_lost = True, False

    def index_lost(self) -> None:
        """Redis lost the index (:mod:`kvindex.indexer.redis.incarnation`): forget what was
        read of it (a model written again restarts its member ids) and claim the layout
        again at the next write."""
        self._reader.forget_all()
        self._write_buckets.clear()
        self._known_models = []
        self._layout_checked = False
        self._layout_lost = True

    # -- reads -------------------------------------------------------------------------------

    def lookup(
        self, model: str, keys: Sequence[int], members: Collection[str] | None = None
    ) -> list[MemberMatch]:
        """One transaction of reads: each member's longest held prefix of ``keys``, best
        first."""
        if not len(keys) or (members is not None and not members):
            key_array(keys)  # ValueError for keys out of range, even when nothing is read
            return []
        blocks = self._reader.read(model, keys)
        if blocks is None:
            return []
        compiled = self.connection.compiled
        if members is None:
            return prefix_matches(blocks, compiled=compiled)
        return prefix_matches(blocks, _member_ids(blocks.view.ids, members), compiled=compiled)

    def presence(
        self, model: str, keys: Sequence[int], members: Collection[str] | None = None
    ) -> list[MemberPresence]:
        """One transaction of reads: per member, which positions of ``keys`` it holds
        per tier."""
        if not len(keys) or (members is not None and not members):
            key_array(keys)  # ValueError for keys out of range, even when nothing is read
            return []
        blocks = self._reader.read(model, keys)
        if blocks is None:
            return []
        compiled = self.connection.compiled
        if members is None:
            return held_positions(blocks, compiled=compiled)
        return held_positions(blocks, _member_ids(blocks.view.ids, members), compiled=compiled)

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
        """The member's reverse record, a chunk at a time, each chunk's keys checked
        with :meth:`presence` (the record also holds keys it dropped since)."""
        record = self.keys.model(model).log(member)
        found: set[int] = set()
        offset = 0
        while True:
            chunk = self.connection.call(
                "member_keys", "GETRANGE", record, offset * 8, (offset + CLEAR_CHUNK) * 8 - 1
            )
            keys = unpack_keys(chunk)
            for held in self.presence(model, keys, [member]):
                mask = held.held if tier is None else held.by_tier[tier]
                found.update(keys[_positions(mask, keys.size)].tolist())
            if len(chunk) < CLEAR_CHUNK * 8:
                return sorted(found)
            offset += CLEAR_CHUNK

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
        """Redis answers, and what it holds under the prefix is in this code's layout."""
        self.connection.ping()
        self._check_layout(claim=False)

    def close(self) -> None:
        self.connection.close()

    def error_counts(self) -> dict[str, int]:
        """Redis errors since start, by operation (no Redis call: safe while it is down)."""
        return dict(self.connection.errors)


def _member_ids(ids: dict[str, int], members: Collection[str]) -> list[int]:
    return [ids[m] for m in members if m in ids]


def _positions(mask: int, n: int) -> np.ndarray:
    """The set bits of ``mask`` (bit i = position i), as indexes."""
    raw = np.frombuffer(mask.to_bytes((n + 7) // 8, "little"), np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little")[:n])


def _buckets_of(
    names: ModelKeys, keys: np.ndarray, buckets: int, first: int
) -> tuple[list[str], bytes]:
    """The bucket keys ``keys`` fall in, to pass in KEYS from position ``first`` on, and
    per key the KEYS position of its bucket as two big-endian bytes."""
    numbers = bucket_numbers(keys, buckets)
    present = np.bincount(numbers, minlength=buckets) > 0  # cheaper than np.unique's sort
    position = np.cumsum(present) - 1 + first
    used = np.flatnonzero(present).tolist()
    return [names.bucket(n) for n in used], position[numbers].astype(">u2").tobytes()


# -- planning ------------------------------------------------------------------------------


class _ClearStep:
    __slots__ = ("member", "tier")

    def __init__(self, member: str, tier: Tier | None) -> None:
        self.member = member
        self.tier = tier


#: One change of a script call: op code, member, tier code, packed keys.
_Change = tuple[bytes, str, bytes, bytes]
#: One script call: its changes, about ``SCRIPT_KEYS`` keys in all.
_Call = list[_Change]
#: A run of stores and removes: per model, its script calls in order.
_Run = dict[str, list[_Call]]


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
        calls = run.setdefault(change.model, [])
        step = SCRIPT_KEYS * 8
        for start in range(0, len(packed), step):
            piece = packed[start : start + step]
            if not calls or sizes[change.model] + len(piece) > step:
                calls.append([])
                sizes[change.model] = 0
            calls[-1].append((code, change.member, _TIER_ARG[tier], piece))
            sizes[change.model] += len(piece)
    if run:
        steps.append(run)
    return steps

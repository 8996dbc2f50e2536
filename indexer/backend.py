"""The backend contract: what every index store (memory, Redis) must do, and nothing more.

The index holds, per model, which members (pods, or a pod's data-parallel rank) hold
each block key, and in which tier. Every backend passes the same contract suite
(``tests/test_backend_contract.py``); metrics and tracing wrap a backend instead of
living inside it.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from kvindex.events.errors import Unavailable


class Tier(enum.IntEnum):
    """Where a member holds a block. Lower is better: a block held in several tiers by
    one member counts in the best one."""

    GPU = 0
    CPU = 1
    STORAGE = 2

    @property
    def label(self) -> str:
        return self.name.lower()


TIERS = tuple(Tier)


class Op(enum.Enum):
    """What a change does to each (member, tier, key) it names.

    An engine can hold one block hash in several physical blocks (vLLM 0.33 recomputes
    the last block of a fully cached, block-aligned prompt into a new block, and
    publishes a ``BlockStored`` for every copy and a ``BlockRemoved`` for every copy it
    evicts), so the index counts copies: a member holds a key while its count is >= 1.
    """

    STORE = "store"  # one more copy
    REMOVE = "remove"  # one copy fewer; a key held in no copy stays absent (never < 0)
    ANNOUNCE = "announce"  # held: one copy if none is counted, else nothing changes
    CLEAR = "clear"  # every copy of everything, in one tier or all


@dataclass(slots=True)
class Change:
    """One change to the index, as produced from an event.

    STORE, REMOVE and ANNOUNCE touch ``keys`` of ``model`` for ``member`` in ``tier``
    only, once per occurrence (a key listed twice in a STORE is two copies).
    CLEAR drops everything ``member`` holds, in every model, in ``tier`` or (tier None)
    in every tier.
    """

    op: Op
    member: str
    model: str = ""
    tier: Tier | None = Tier.GPU
    keys: Sequence[int] = ()


class MemberMatch(msgspec.Struct, gc=False):
    """How long a prefix of the looked-up chain one member holds.

    ``by_tier[t]`` counts blocks of the matched prefix whose best tier is ``t``; the
    counts add up to ``matched_blocks``.

    A msgspec Struct, not a dataclass: a lookup makes one per member that matched (64
    per /score at 64 pods), and a Struct is built in about a fifth of the time (its
    ``__init__`` is compiled; the memory backend's compiled walk calls it directly).
    """

    member: str
    matched_blocks: int
    by_tier: tuple[int, int, int]


@dataclass(slots=True)
class MemberPresence:
    """Which blocks of a looked-up list one member holds, position by position.

    ``by_tier[t]`` is a bitmask over positions of the list: bit ``i`` is set when the
    member holds ``keys[i]`` in tier ``t``. Unlike :class:`MemberMatch` it does not stop
    at the first hole: sliding-window and Mamba KV groups hit on blocks near the end of
    a prefix, not on the whole prefix (see :mod:`kvindex.scoring.hybrid`).
    """

    member: str
    by_tier: tuple[int, int, int]

    @property
    def held(self) -> int:
        """Positions held in any tier."""
        gpu, cpu, storage = self.by_tier
        return gpu | cpu | storage


@dataclass(slots=True)
class MemberStats:
    """What one member holds: ``blocks[model][tier] = count``."""

    member: str
    blocks: dict[str, dict[Tier, int]] = field(default_factory=dict)

    def total(self, tier: Tier | None = None) -> int:
        return sum(
            n for by_tier in self.blocks.values() for t, n in by_tier.items() if tier in (None, t)
        )


@dataclass(slots=True)
class IndexStats:
    """Index-wide figures for metrics and /index/pods."""

    members: int
    blocks: dict[Tier, int]  # (block, member) entries per tier
    keys: int  # distinct (model, block key) pairs held by anyone
    evictions: int = 0
    capacity: int | None = None
    extra: dict[str, float] = field(default_factory=dict)


class BackendError(RuntimeError):
    """Base class for backend failures."""


class BackendUnavailable(BackendError, Unavailable):
    """The backend cannot be reached (Redis down); callers answer 503 and retry later."""

    code = "backend_unavailable"


class IndexBackend(Protocol):
    """A block-key → members index. Writers call from one thread; readers from any."""

    def apply(self, changes: Sequence[Change]) -> None:
        """Apply changes in order. A backend may batch them (one round trip for Redis).

        Per (member, model, tier, key) the backend keeps a copy count: STORE adds one,
        REMOVE takes one away (not below zero), ANNOUNCE makes it at least one, CLEAR
        zeroes it. Lookups, stats and member keys see only whether it is >= 1."""

    def clear_member(self, member: str) -> int:
        """Drop everything ``member`` holds, in every model and tier; return the entries
        dropped. Costs time proportional to that member's blocks, never a full scan."""

    def lookup(
        self, model: str, keys: Sequence[int], members: Collection[str] | None = None
    ) -> list[MemberMatch]:
        """For the ordered chain ``keys``, each member's longest consecutive prefix held
        in any tier. Only members with at least one matched block are returned, best
        first: most blocks, then most GPU blocks, then member (the scorer relies on it
        to skip a sort, and checks it). ``members`` restricts the answer to those."""

    def presence(
        self, model: str, keys: Sequence[int], members: Collection[str] | None = None
    ) -> list[MemberPresence]:
        """For each position of ``keys`` (any keys, not only a chain), which members hold
        it and in which tier. Only members holding at least one of the keys are
        returned, sorted by member id; ``members`` restricts the answer as in
        :meth:`lookup`. Costs one probe per key (no early stop)."""

    def member_stats(self, member: str) -> MemberStats | None:
        """What ``member`` holds, or None when it holds nothing."""

    def member_keys(self, member: str, model: str, tier: Tier | None = None) -> list[int]:
        """Every key ``member`` holds for ``model`` (in ``tier``, or in any tier), sorted.

        For operators and consistency checks (``GET /index/pods/{pod}/blocks``); costs
        time proportional to that member's blocks."""

    def members(self) -> list[str]:
        """Every member holding at least one block."""

    def models(self) -> list[str]:
        """Every model the index holds blocks for, sorted (a shared backend may also list
        models that held blocks earlier). One call: /score's unknown-model check uses it."""

    def stats(self) -> IndexStats:
        """Index-wide counts."""

    def ping(self) -> None:
        """Return when the backend answers; raise BackendUnavailable otherwise."""

    def close(self) -> None:
        """Release connections and threads."""

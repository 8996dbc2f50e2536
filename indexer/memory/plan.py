"""How the memory backend batches one ``apply`` call: changes validated, gathered into
steps of about ``CHUNK_KEYS`` keys (one vectorised update per (model, tier) each), and
their keys converted to ``uint64`` arrays in one go.

Pure planning, no state: :class:`~kvindex.indexer.memory.backend.MemoryBackend` runs the steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

import numpy as np

from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.memory.table import (
    ANNOUNCE,
    CHUNK_KEYS,
    REMOVE,
    STORE,
    Ops,
    U64s,
    as_keys,
)


class Group:
    """STORE/REMOVE/ANNOUNCE changes of one (model, tier) gathered for one vectorised
    update.

    A group may mix members and operations: :meth:`BlockTable.update` folds the
    operations on each (key, member) pair in order.
    """

    __slots__ = ("keys", "members", "ops", "pieces", "sizes")

    def __init__(self) -> None:
        self.pieces: list[Sequence[int] | np.ndarray] = []  # the changes' keys, as given
        self.members: list[str] = []
        self.ops: list[int] = []  # STORE, REMOVE or ANNOUNCE per change
        self.sizes: list[int] = []
        self.keys: U64s = NO_KEYS  # all pieces' keys, once converted

    def op_codes(self) -> int | Ops:
        """The op per key; a scalar when uniform."""
        first = self.ops[0]
        if all(o == first for o in self.ops):
            return first
        return np.repeat(np.array(self.ops, np.int8), self.sizes)


class Clear(NamedTuple):
    member: str
    tier: Tier | None


#: What one lock hold applies: gathered STORE/REMOVE groups, or one CLEAR.
Step = dict[tuple[str, Tier], Group] | Clear


def plan(changes: Sequence[Change]) -> list[Step]:
    """Validate every change, gather them into steps of at most about ``CHUNK_KEYS``
    keys (a CLEAR is a step of its own, so nothing moves across it) and convert all
    keys.

    Key lists (Python ints, as the event decoder makes them) are converted in one go:
    one big conversion costs much less than many small ones.
    """
    steps: list[Step] = []
    groups: dict[tuple[str, Tier], Group] = {}
    budget = CHUNK_KEYS
    for change in changes:
        op, tier = change.op, change.tier
        if op is Op.CLEAR:
            if tier is not None and not isinstance(tier, Tier):
                raise ValueError(f"CLEAR tier must be a Tier or None, got {tier!r}")
            if groups:
                steps.append(groups)
                groups, budget = {}, CHUNK_KEYS
            steps.append(Clear(change.member, tier))
            continue
        code = OP_CODES.get(op)
        if code is None:
            raise ValueError(f"unknown op {op!r}")
        if not isinstance(tier, Tier):
            raise ValueError(f"{op.name} needs a tier, got {tier!r}")
        keys = change.keys
        size = len(keys)
        if size <= CHUNK_KEYS:
            pieces: Sequence[tuple[Sequence[int] | np.ndarray, int]] = ((keys, size),)
        else:  # a huge change goes in pieces
            pieces = [
                (keys[i : i + CHUNK_KEYS], len(keys[i : i + CHUNK_KEYS]))
                for i in range(0, size, CHUNK_KEYS)
            ]
        for piece, n in pieces:
            if not n:
                continue
            group = groups.get((change.model, tier))
            if group is None:
                group = groups[(change.model, tier)] = Group()
            group.pieces.append(piece)  # this loop runs per change: kept flat
            group.members.append(change.member)
            group.ops.append(code)
            group.sizes.append(n)
            budget -= n
            if budget <= 0:
                steps.append(groups)
                groups, budget = {}, CHUNK_KEYS
    if groups:
        steps.append(groups)
    convert([g for step in steps if not isinstance(step, Clear) for g in step.values()])
    return steps


def convert(groups: list[Group]) -> None:
    """Set each group's ``keys``: lists of ints of all groups in one conversion."""
    lists = [g for g in groups if not any(isinstance(p, np.ndarray) for p in g.pieces)]
    for g in groups:
        if g not in lists:
            g.keys = np.concatenate([as_keys(p) for p in g.pieces])
    if not lists:
        return
    flat = as_keys(list(chain.from_iterable(p for g in lists for p in g.pieces)))
    start = 0
    for g in lists:
        size = sum(g.sizes)
        g.keys = flat[start : start + size]
        start += size


NO_KEYS = np.zeros(0, np.uint64)
OP_CODES = {Op.STORE: STORE, Op.REMOVE: REMOVE, Op.ANNOUNCE: ANNOUNCE}

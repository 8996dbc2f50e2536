"""Reads of the memory backend in Python terms: the member filter of a lookup, and a
table's longest-prefix answer as ``MemberMatch`` objects, best first.

Pure functions of the backend's member names and ids (taken under its lock). The
compiled walk (:meth:`~kvindex.indexer.memory.table.BlockTable.walk`) builds the answer
itself; the numpy path decodes a :class:`~kvindex.indexer.memory.table.ChainMatch` here
(:func:`answer`). Both give the same objects in the same order
(``tests/test_memory_table_paths.py``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from kvindex.indexer import compiled
from kvindex.indexer.backend import MemberMatch
from kvindex.indexer.memory.table import WORD, BlockTable, ChainMatch, U64s, as_keys, bit_positions


def member_bits(ids: Mapping[str, int], members: Collection[str]) -> int:
    """The listed members that hold anything, as an int of their id bits (0: none)."""
    mask = 0
    for member in members:
        mid = ids.get(member)
        if mid is not None:
            mask |= 1 << mid
    return mask


def mask_row(bits: int | None, width: int) -> np.ndarray | np.uint64 | None:
    """Member bits as the numpy path's bitmask row (a scalar when one word wide)."""
    if bits is None:
        return None
    if width == 1:
        return np.uint64(bits)
    return np.array([(bits >> (64 * w)) & WORD for w in range(width)], np.uint64)


def member_mask(
    ids: Mapping[str, int], width: int, members: Collection[str]
) -> np.ndarray | np.uint64 | None:
    """Bitmask row of the listed members that hold anything; None when none do."""
    return mask_row(member_bits(ids, members) or None, width)


def longest(
    table: BlockTable,
    keys: U64s | list[int],
    allowed: int | None,
    names: list[str | None],
) -> list[MemberMatch]:
    """Each member's longest held prefix of ``keys``, best first (most blocks, then most
    GPU blocks, then name); ``allowed`` the member filter's bits (None: everyone).

    Compiled: one call, a list of ints read in C (keys it cannot read, such as numpy
    integers or bad values, are converted by :func:`as_keys`, which names a bad key).
    numpy: the vectorised probe and :func:`answer`."""
    if compiled.probe is not None:
        try:
            return table.walk(keys, allowed, names)
        except (TypeError, OverflowError):
            if not isinstance(keys, list):
                raise
        return table.walk(as_keys(keys), allowed, names)  # ValueError for a bad key
    found = table.match(as_keys(keys), mask_row(allowed, table.width))
    return [] if found is None else answer(found, names)


def answer(found: ChainMatch, names: Sequence[str | None]) -> list[MemberMatch]:
    """MemberMatch objects, best first. Per-member Python work is kept to building
    the object: it is most of a lookup's cost when many members match."""
    out: list[MemberMatch] = []
    append, match = out.append, MemberMatch  # locals: this loop is hot
    if found.off_gpu is None:  # GPU only: by length, then member id
        after = 0
        for n, value in zip(reversed(found.ends), reversed(found.values), strict=True):
            mask = value & ~after  # the members whose prefix is n blocks
            after = value
            if not mask & (mask - 1):  # one member (the common case)
                append(match(names[mask.bit_length() - 1], n, (n, 0, 0)))  # type: ignore[arg-type]
            else:
                group = sorted([names[m] for m in bit_positions(mask)])  # type: ignore[type-var]
                by_tier = (n, 0, 0)
                out += [match(name, n, by_tier) for name in group]  # type: ignore[arg-type]
        return out
    off_gpu, cpu = found.off_gpu, found.cpu
    assert cpu is not None
    after = 0
    for n, value in zip(reversed(found.ends), reversed(found.values), strict=True):
        mask = value & ~after  # by length, then GPU blocks, then member id
        after = value
        if not mask & (mask - 1):
            m = mask.bit_length() - 1
            off, c = off_gpu[m], cpu[m]
            append(match(names[m], n, (n - off, c, off - c)))  # type: ignore[arg-type]
            continue
        for off, name, m in sorted((off_gpu[m], names[m], m) for m in bit_positions(mask)):
            append(match(name, n, (n - off, cpu[m], off - cpu[m])))  # type: ignore[arg-type]
    return out

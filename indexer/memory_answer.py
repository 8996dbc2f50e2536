"""Reads of the memory backend in Python terms: the member filter of a lookup as a
bitmask row, and a table's raw :class:`~kvindex.indexer.memory_table.ChainMatch` as
``MemberMatch`` objects, best first.

Pure functions of the backend's member names and ids (taken under its lock).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from kvindex.indexer.backend import MemberMatch
from kvindex.indexer.memory_table import WORD, ChainMatch, bit_positions


def member_mask(
    ids: Mapping[str, int], width: int, members: Collection[str]
) -> np.ndarray | np.uint64 | None:
    """Bitmask row of the listed members that hold anything; None when none do."""
    mask = 0
    for member in members:
        mid = ids.get(member)
        if mid is not None:
            mask |= 1 << mid
    if not mask:
        return None
    if width == 1:
        return np.uint64(mask)
    return np.array([(mask >> (64 * w)) & WORD for w in range(width)], np.uint64)


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

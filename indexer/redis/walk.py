"""The lookup walk over bitmaps read from Redis, in the client: compiled, or numpy.

Redis answers each block's member bitmaps (:mod:`kvindex.indexer.redis.read`, as one
matrix: a row per block); this module turns them into the backend's answers. The
compiled walks (indexer/redis/_redis_lookup.c: ``prefix_walk``, ``held_positions``) run when
the kernels are built; the numpy ones here give the same answers and are the reference
the tests hold them to. Both cut the chain into runs of identical rows first:
consecutive blocks of a chain usually carry identical bitmaps (the same pods stored the
whole prefix). Here the per-member work is then done on the runs as small boolean
matrices: a run x member-bit matrix per tier, ``logical_and.accumulate`` for "held every
block so far", one matrix product for the matched lengths. Pure functions: no Redis
here.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from kvindex.indexer.backend import MemberMatch, MemberPresence
from kvindex.indexer.redis.compiled import kernels
from kvindex.indexer.redis.read import Blocks


def _mask(allowed: Collection[int] | None, bits: int) -> np.ndarray | None:
    if allowed is None:
        return None
    mask = np.zeros(bits, bool)
    mask[[mid for mid in allowed if mid < bits]] = True
    return mask


def _unpack(slots: np.ndarray) -> np.ndarray:
    """(..., width) bitmaps as (..., 8 * width) bools, bit ``id`` of each."""
    return np.unpackbits(slots, axis=-1, bitorder="little").view(bool)


def prefix_matches(
    blocks: Blocks, allowed: Collection[int] | None = None, *, compiled: bool = False
) -> list[MemberMatch]:
    """Each member's longest held prefix of the chain, best first (the backend's
    ``lookup``); ``allowed`` member ids restrict the answer. ``compiled``: the walk of
    indexer/redis/_redis_lookup.c (the kernels must be built)."""
    view = blocks.view
    if compiled:
        assert kernels is not None
        ids = None if allowed is None else list(allowed)
        return kernels.prefix_walk(
            blocks.rows, blocks.per_key, blocks.width, view.rank, view.by_id, ids, MemberMatch
        )
    slots = blocks.slots()
    if not slots.size:
        return []
    flat = slots.reshape(len(slots), -1)
    nobody = np.flatnonzero(~flat.any(axis=1))
    end = int(nobody[0]) if nobody.size else len(flat)  # the chain stops there
    if not end:
        return []
    flat = flat[:end]
    starts = [0, *(np.flatnonzero((flat[1:] != flat[:-1]).any(axis=1)) + 1).tolist()]
    sizes = np.diff(np.array([*starts, end], np.int64))
    runs = _unpack(slots[starts])  # (runs, per_key, member bits)
    tiered = blocks.per_key == 3
    gpu = runs[:, 0]
    held = gpu | runs[:, 1] | runs[:, 2] if tiered else gpu
    mask = _mask(allowed, held.shape[1])
    if mask is not None:
        held = held & mask
    alive = np.logical_and.accumulate(held, axis=0)
    matched = sizes @ alive
    rank = view.rank
    found = np.flatnonzero(matched[: rank.size])
    found = found[rank[found] >= 0]  # a bit without a name cannot be in one snapshot
    if not found.size:
        return []
    lengths = matched[found]
    if tiered:
        cpu = runs[:, 1]
        on_gpu = (sizes @ (alive & gpu))[found]
        on_cpu = (sizes @ (alive & cpu & ~gpu))[found]
    else:
        on_gpu, on_cpu = lengths, np.zeros_like(lengths)
    order = np.lexsort((rank[found], -on_gpu, -lengths))  # longest, most on GPU, by member
    names = view.names
    return [
        MemberMatch(names[mid], n, (g, c, n - g - c))
        for mid, n, g, c in zip(
            found[order].tolist(),
            lengths[order].tolist(),
            on_gpu[order].tolist(),
            on_cpu[order].tolist(),
            strict=True,
        )
    ]


def held_positions(
    blocks: Blocks, allowed: Collection[int] | None = None, *, compiled: bool = False
) -> list[MemberPresence]:
    """Per member, a bitmask per tier of the positions it holds (the backend's
    ``presence``), sorted by member. ``compiled``: indexer/redis/_redis_lookup.c's."""
    if compiled:
        assert kernels is not None
        view = blocks.view
        ids = None if allowed is None else list(allowed)
        return kernels.held_positions(
            blocks.rows, blocks.per_key, blocks.width, view.rank, view.by_id, ids, MemberPresence
        )
    slots = blocks.slots()
    if not slots.size:
        return []
    mask = _mask(allowed, 8 * blocks.width)
    per_tier = []
    for tier in range(blocks.per_key):
        bits = _unpack(slots[:, tier])
        if mask is not None:
            bits = bits & mask
        rows = np.packbits(bits.T, axis=1, bitorder="little")  # one row per member bit
        per_tier.append([int.from_bytes(row.tobytes(), "little") for row in rows])
    while len(per_tier) < 3:
        per_tier.append([0] * (8 * blocks.width))
    names = blocks.view.names
    out = [
        MemberPresence(names[mid], (g, c, s))
        for mid, (g, c, s) in enumerate(zip(*per_tier, strict=True))
        if (g or c or s) and mid in names
    ]
    out.sort(key=lambda p: p.member)
    return out

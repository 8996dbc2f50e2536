"""The lookup walk over bitmaps read from Redis, in the client (numpy).

Redis answers each block's member bitmaps (:mod:`kvindex.indexer.redis_read`); this
module turns them into the backend's answers. Consecutive blocks of a chain usually
carry identical bitmaps (the same pods stored the whole prefix), so the chain is first
cut into runs of identical values (one comparison per block), and the per-member work
is done on the runs as small boolean matrices: a run x member-bit matrix per tier,
``logical_and.accumulate`` for "held every block so far", one matrix product for the
matched lengths. Pure functions: no Redis here.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from kvindex.indexer.backend import MemberMatch, MemberPresence
from kvindex.indexer.redis_read import Blocks

_NOBODY = (None, None, None)


def _bits(values: list[bytes | None], width: int) -> np.ndarray:
    """Bitmaps (bit ``id % 8`` of byte ``id // 8``) as a (len, 8 * width) bool matrix."""
    blob = b"".join([(v or b"").ljust(width, b"\0") for v in values])
    rows = np.frombuffer(blob, np.uint8).reshape(len(values), width)
    return np.unpackbits(rows, axis=1, bitorder="little").view(bool)


def _mask(allowed: Collection[int] | None, bits: int) -> np.ndarray | None:
    if allowed is None:
        return None
    mask = np.zeros(bits, bool)
    mask[[mid for mid in allowed if mid < bits]] = True
    return mask


def _runs(blocks: Blocks) -> tuple[list[int], list, int]:
    """Where each run of identical values starts, its value, and where the chain stops
    (its first block nobody holds, or its end). Comprehensions and ``list.index``: the
    per-block work of a lookup, kept to one comparison each."""
    if blocks.cpu is None or blocks.storage is None:
        values: list = blocks.gpu
        nobody: object = None
    else:
        values = list(zip(blocks.gpu, blocks.cpu, blocks.storage, strict=True))
        nobody = _NOBODY
    try:
        end = values.index(nobody)
    except ValueError:
        end = len(values)
    if not end:
        return [], [], 0
    starts = [0, *[j for j in range(1, end) if values[j] != values[j - 1]]]
    return starts, [values[j] for j in starts], end


def prefix_matches(blocks: Blocks, allowed: Collection[int] | None = None) -> list[MemberMatch]:
    """Each member's longest held prefix of the chain, best first (the backend's
    ``lookup``); ``allowed`` member ids restrict the answer."""
    starts, values, end = _runs(blocks)
    if not starts:
        return []
    sizes = np.diff(np.array([*starts, end], np.int64))
    tiered = blocks.cpu is not None
    if tiered:
        gpu_v, cpu_v, storage_v = (list(col) for col in zip(*values, strict=True))
        width = max(map(len, (v for v in (*gpu_v, *cpu_v, *storage_v) if v)))
        gpu, cpu = _bits(gpu_v, width), _bits(cpu_v, width)
        held = gpu | cpu | _bits(storage_v, width)
    else:
        width = max(map(len, values))
        held = gpu = _bits(values, width)
    mask = _mask(allowed, 8 * width)
    if mask is not None:
        held = held & mask
    alive = np.logical_and.accumulate(held, axis=0)
    matched = sizes @ alive
    rank = blocks.view.rank
    found = np.flatnonzero(matched[: rank.size])
    found = found[rank[found] >= 0]  # a bit without a name cannot be in one snapshot
    if not found.size:
        return []
    lengths = matched[found]
    if tiered:
        on_gpu = (sizes @ (alive & gpu))[found]
        on_cpu = (sizes @ (alive & cpu & ~gpu))[found]
    else:
        on_gpu, on_cpu = lengths, np.zeros_like(lengths)
    order = np.lexsort((rank[found], -on_gpu, -lengths))  # longest, most on GPU, by member
    names = blocks.view.names
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


def held_positions(blocks: Blocks, allowed: Collection[int] | None = None) -> list[MemberPresence]:
    """Per member, a bitmask per tier of the positions it holds (the backend's
    ``presence``), sorted by member."""
    tiers = [blocks.gpu]
    if blocks.cpu is not None and blocks.storage is not None:
        tiers += [blocks.cpu, blocks.storage]
    width = max((len(v) for values in tiers for v in values if v), default=0)
    if not width:
        return []
    mask = _mask(allowed, 8 * width)
    per_tier = []
    for values in tiers:
        bits = _bits(values, width)
        if mask is not None:
            bits = bits & mask
        rows = np.packbits(bits.T, axis=1, bitorder="little")  # one row per member bit
        per_tier.append([int.from_bytes(row.tobytes(), "little") for row in rows])
    while len(per_tier) < 3:
        per_tier.append([0] * (8 * width))
    names = blocks.view.names
    out = [
        MemberPresence(names[mid], (g, c, s))
        for mid, (g, c, s) in enumerate(zip(*per_tier, strict=True))
        if (g or c or s) and mid in names
    ]
    out.sort(key=lambda p: p.member)
    return out

"""Storage of the memory backend's hash table: constants, key conversion, bitmask-row
helpers and the layout builders shared by the parts of
:class:`~kvindex.indexer.memory_table.BlockTable`.

The table is assembled in :mod:`kvindex.indexer.memory_table` from one mixin per concern
(``table_probe``, ``table_update``, ``table_copies``, ``table_members``, ``table_query``,
``table_state``); this module holds what they share. Why the table looks as it does:

Why numpy and not a dict: a ``dict[int, ...]`` of block keys costs 110+ bytes per block
(the int objects and the dict slots) before it records a single member, which rules out
a budget of ~64 bytes per (block, member) entry. Here a block costs one ``uint64`` key
and one ``uint64`` member bitmask per tier (per 64 members) per slot, at a load factor
of 0.35-0.7, an optional ``uint32`` "last stored" stamp per slot (only with a capacity
bound), and a 4-byte reverse-record entry per member holding it: about 26 bytes per
(block, member) entry at 1M blocks over 16 members (``bench/bench_index.py``).

Layout of one model's table:

* ``keys: uint64[cap + PAD + 1]``, open addressing with linear probing from the home
  slot ``((key ^ seed) * golden) >> (64 - log2 cap)`` (a multiplicative mix with a
  per-process random seed, so neither structured nor crafted keys pile up). Probing
  never wraps around: the ``PAD`` slots past ``cap`` absorb the end of the table, and a
  key that would land more than ``PAD - WINDOW`` slots from home forces a rebuild. ``0``
  marks an empty slot; the key ``0`` itself lives in a reserved last slot, so no
  separate "used" array is needed.
* ``masks[tier]: uint64[slots, W]``: bit ``m`` is set when member id ``m`` holds the
  block in that tier; ``W = ceil(member ids / 64)`` grows as members are interned. The
  CPU and STORAGE arrays are allocated on the first store to that tier (most deployments
  are GPU-only).
* ``copies``: a dict, ``(slot, member id, tier)`` code -> extra copies, for the rare
  entries held in two or more physical blocks (vLLM publishes a ``BlockStored`` and a
  ``BlockRemoved`` per copy); an entry in one copy is its bit alone, so the common
  case costs nothing more (about 100 bytes per entry with extra copies).
* A slot whose masks become all-zero stays occupied as a *dead* slot (no tombstones: a
  later store of the same key revives it). When dead slots pass a quarter of the table,
  or the table must grow, it is rebuilt from its live slots in one vectorised pass.

Probing is vectorised and made for numpy's per-call cost (about a microsecond, whatever
the size): one gather settles the keys sitting in their home slot (about 3 in 4 at load
0.5); the others read windows of ``WINDOW`` slots at once. Inserts resolve collisions
between keys of one batch by scatter-then-read-back (the last write to a slot wins it;
the losers move on).
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvindex.indexer import compiled

if TYPE_CHECKING:
    from kvindex.indexer.table_members import _SlotLog

U64s = npt.NDArray[np.uint64]
Slots = npt.NDArray[np.intp]
Bools = npt.NDArray[np.bool_]
Counts = npt.NDArray[np.int64]
Ops = npt.NDArray[np.int8]

#: Slots read per key in one probe round. Linear probing at load ≤ 0.7 finds almost every
#: key within 8 slots of home; a wider window costs more gathers for every key.
WINDOW = 8
#: Slots a lookup reads per key in its first round after the home slot (at most).
LOOKUP_WINDOW = 32
#: Slots past the home range, so probing never wraps (no ``& mask`` in the hot path).
PAD = 512
#: Largest displacement from home a key may have; an insert that would go further
#: rebuilds the table at twice the size.
MAX_DISPLACEMENT = PAD - WINDOW
#: Grow (rebuild) when occupied slots would exceed this fraction of ``cap``...
MAX_LOAD = 0.7
#: ... into the smallest table where live keys fill at most this fraction.
REBUILD_LOAD = 0.5
#: Rebuild from live slots when dead slots pass this fraction of ``cap``.
DEAD_FRACTION = 0.25
MIN_CAP = 1024
#: Most keys one lock hold applies: bounds how long a lookup can wait behind a writer.
CHUNK_KEYS = 4096
#: Share of the capacity freed when the capacity bound is exceeded.
EVICT_FRACTION = 0.1
#: Reverse records are compacted when they exceed ``2 * held + LOG_SLACK`` entries.
LOG_SLACK = 64

_OFFSETS = np.arange(WINDOW, dtype=np.intp)[:, None]
_WIDE_OFFSETS = np.arange(max(WINDOW, LOOKUP_WINDOW), dtype=np.intp)[:, None]
_MULT = np.uint64(0x9E3779B97F4A7C15)
_BIT = np.left_shift(np.uint64(1), np.arange(64, dtype=np.uint64))
STAMP_MAX = 2**32 - 1
WORD = 2**64 - 1
_SMALL = 64  # batches up to this size check for duplicates with a Python set, not a sort


class NeedRoom(Exception):
    """Raised before any write when an insert would push the table past ``MAX_LOAD``."""

    def __init__(self, need: int) -> None:
        self.need = need


class TableFull(Exception):
    """Raised when a key would land more than ``MAX_DISPLACEMENT`` slots from home."""


def as_keys(keys: Sequence[int] | np.ndarray) -> U64s:
    """Block keys as a 1-D ``uint64`` array; raise ValueError unless every key is an
    integer in ``0 <= k < 2**64``. A ``uint64`` array is used as is (no copy)."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1:
            raise ValueError(f"block keys must be one-dimensional, got shape {keys.shape}")
        if keys.dtype == np.uint64:
            return keys
        if keys.dtype.kind == "u" or (keys.dtype.kind == "i" and not (keys < 0).any()):
            return keys.astype(np.uint64)
        raise ValueError(f"block keys must be unsigned 64-bit integers, got {keys.dtype}")
    if isinstance(keys, bytes | bytearray | memoryview | str):
        raise ValueError(f"block keys must be integers, got {type(keys).__name__}")
    try:  # array('Q') converts a list of ints faster than np.array, with range checks
        return np.frombuffer(array.array("Q", keys), dtype=np.uint64)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"block keys must be integers in [0, 2**64): {exc}") from None


def _sorted_unique(values: np.ndarray) -> Slots:
    """Sorted distinct values as ``intp`` (np.unique is several times slower). Values
    at or above 2**63 wrap, which keeps them distinct."""
    s = np.sort(values.astype(np.intp))
    if s.size < 2:
        return s
    keep = np.empty(s.size, np.bool_)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def _bit_counts(rows: np.ndarray, width: int) -> npt.NDArray[np.int64]:
    """For ``uint64[n, W]`` bitmask rows, how many rows have each of the ``64 * W`` bits."""
    total = np.zeros(64 * width, np.int64)
    step = 1 << 16  # bounds the unpacked temporary to 64 * W bytes per row of a step
    for start in range(0, rows.shape[0], step):
        part = np.ascontiguousarray(rows[start : start + step]).astype("<u8", copy=False)
        bits = np.unpackbits(part.view(np.uint8), axis=1, bitorder="little")
        total += bits.sum(axis=0, dtype=np.int64)
    return total


def _nonzero_rows(rows: np.ndarray) -> Bools:
    """Whether each row of ``uint64[n, W]`` has a bit set. (numpy reduces along a short
    last axis slowly, ~30x slower than OR-ing the W columns.)"""
    acc = rows[:, 0]
    for w in range(1, rows.shape[1]):
        acc = acc | rows[:, w]
    return acc != 0


def _rows_differ(rows: np.ndarray) -> Bools:
    """Whether each row of ``uint64[n, W]`` differs from the one before it (rows
    compared as W * 8-byte blobs, for the same reason)."""
    blobs = np.ascontiguousarray(rows).view(f"V{rows.dtype.itemsize * rows.shape[1]}")
    blobs = blobs.reshape(-1)
    return blobs[1:] != blobs[:-1]


def _bit_matrix(rows: np.ndarray) -> npt.NDArray[np.uint8]:
    """``uint64[n, W]`` rows as ``uint8[n, 64 * W]``: column ``m`` is member id ``m``'s bit."""
    part = np.ascontiguousarray(rows).astype("<u8", copy=False)
    return np.unpackbits(part.view(np.uint8), axis=1, bitorder="little")


@dataclass(slots=True)
class _Layout:
    """A table's storage, built aside and installed in one step."""

    cap: int
    keys: U64s
    masks: list[np.ndarray | None]
    stamps: npt.NDArray[np.uint32] | None
    live: int = 0
    max_disp: int = 0
    zero_used: bool = False
    logs: dict[int, _SlotLog] = field(default_factory=dict)
    copies: dict[int, int] = field(default_factory=dict)


#: Allocates a table's keys and masks: ``zeros(shape, dtype)``, zero-filled. ``np.zeros``
#: by default; :class:`kvindex.indexer.shared_arrays.SharedArrays` puts them in shared
#: memory, where other processes read them (``kvindex serve --processes``).
Zeros = Callable[[tuple[int, ...], type], np.ndarray]


def _empty_layout(
    cap: int, width: int, tiers: tuple[bool, ...], stamped: bool, zeros: Zeros = np.zeros
) -> _Layout:
    size = cap + PAD + 1  # PAD slots past the home range, then the slot of key 0
    return _Layout(
        cap,
        zeros((size,), np.uint64),
        [zeros((size, width), np.uint64) if on else None for on in tiers],
        np.zeros(size, np.uint32) if stamped else None,
    )


def _home(keys: U64s, seed: np.uint64, shift: np.uint64) -> Slots:
    """Home slot: the top bits of a multiplicative (Fibonacci) mix of the seeded key."""
    # below 2**(64 - shift) <= 2**31 after the shift: viewing as intp is exact
    return (((keys ^ seed) * _MULT) >> shift).view(np.intp)


def _shift_for(cap: int) -> np.uint64:
    return np.uint64(64 - (cap.bit_length() - 1))


def _layout(keys: U64s, cap: int, seed: np.uint64, into: U64s) -> tuple[Slots, int]:
    """Lay distinct keys out in ``into``, the empty keys array of a table of ``cap``;
    return their slots and the largest displacement, without probing rounds. Raises
    TableFull past ``MAX_DISPLACEMENT`` (``into`` is then partly written).

    Compiled: each key in turn goes to the first empty slot from its home. numpy:
    sorted by home slot, key ``i`` lands at ``max(home_i, slot_{i-1} + 1)``, which
    unrolls to ``i + max_{j<=i}(home_j - j)``: one sort and one running maximum.
    """
    out = np.empty(keys.size, np.intp)
    probe = compiled.probe
    if probe is not None:
        shift = int(_shift_for(cap))
        disp = probe.layout(
            into, np.ascontiguousarray(keys), int(seed), shift, MAX_DISPLACEMENT, cap + PAD, out
        )
        if disp < 0:
            raise TableFull
        return out, disp
    zero = keys == 0
    out[zero] = cap + PAD  # the reserved slot of key 0, which holds 0
    rows = np.flatnonzero(~zero)
    if not rows.size:
        return out, 0
    home = _home(keys[rows], seed, _shift_for(cap))
    order = np.argsort(home, kind="stable")
    ordered = home[order]
    rank = np.arange(ordered.size)
    pos = np.maximum.accumulate(ordered - rank) + rank
    disp = int((pos - ordered).max())
    if disp > MAX_DISPLACEMENT:
        raise TableFull
    out[rows[order]] = pos
    into[out] = keys
    return out, disp


def _move_rows(src: np.ndarray, dst: np.ndarray, src_rows: Slots, dst_rows: Slots) -> None:
    """``dst[dst_rows] = src[src_rows]`` for arrays of one dtype and row shape (one
    compiled pass, without numpy's temporary copy of the gathered rows)."""
    probe = compiled.probe
    if probe is None:
        dst[dst_rows] = src[src_rows]
        return
    probe.move_rows(src, dst, src_rows, dst_rows, src.strides[0])

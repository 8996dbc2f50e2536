"""Constants and stateless array functions of the memory backend's hash table
(:class:`~kvindex.indexer.memory.table.BlockTable`, whose docstring explains the layout):
key conversion, home slots, the numpy probing and insertion loops, laying keys out in
an empty table, bitmask-row helpers.

Each function that has a compiled twin in ``indexer/memory/_probe.c`` (reached through
:mod:`kvindex.indexer.compiled`) calls it when it is built and keeps the numpy version
as the reference the differential tests compare against.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvindex.indexer import compiled

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
    """Sorted distinct values as ``intp`` (a sort and one comparison: np.unique does
    more). Values at or above 2**63 wrap, which keeps them distinct."""
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
    """Whether each row of ``uint64[n, W]`` has a bit set (OR-ing the W columns: numpy
    reduces along a short last axis slowly)."""
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


#: Allocates a table's keys and masks: ``zeros(shape, dtype)``, zero-filled. ``np.zeros``
#: by default; :class:`kvindex.indexer.memory.shared_arrays.SharedArrays` puts them in shared
#: memory, where other processes read them (``kvindex serve --processes``).
Zeros = Callable[[tuple[int, ...], type], np.ndarray]


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


def probe_windows(
    table: U64s,
    max_disp: int,
    keys: U64s,
    home: Slots,
    slots: Slots,
    todo: Slots,
    cursors: Slots | None,
) -> None:
    """numpy probing of the keys array ``table``: fill ``slots[todo]`` for non-zero
    ``keys`` (``home`` their home slots, row for row) by reading windows from home,
    until each key is found, an empty slot proves it absent, or ``max_disp`` is passed.
    With ``cursors``, record for each absent key its first empty slot, where inserting
    it starts (raises TableFull when there is none within ``MAX_DISPLACEMENT``)."""
    offset = 0
    # Lookups read up to LOOKUP_WINDOW slots at once: one wide round is cheaper
    # than a second narrow one. Inserts mostly stop at a near empty slot.
    width = WINDOW if cursors is not None else min(LOOKUP_WINDOW, max_disp + 1)
    while todo.size and offset <= max_disp:
        m = todo.size
        pos = _WIDE_OFFSETS[:width] + (home + offset)  # (width, m): long axis inner
        window = table[pos]
        hits = np.flatnonzero(window == keys)
        rows = hits % m  # each non-zero key matches at most one slot
        slots[todo[rows]] = pos.ravel()[hits]
        if rows.size == m:
            return
        empty = window == 0
        go = ~empty.any(axis=0)
        go[rows] = False
        if cursors is not None:  # absent: the first empty slot is where it goes
            done = ~go
            done[rows] = False
            cursors[todo[done]] = home[done] + offset + empty[:, done].argmax(axis=0)
        todo, home, keys = todo[go], home[go], keys[go]
        offset += width
        width = WINDOW
    while cursors is not None and todo.size:  # absent, past max_disp: find a gap
        if offset > MAX_DISPLACEMENT:
            raise TableFull
        empty = table[_OFFSETS + (home + offset)] == 0
        done = empty.any(axis=0)
        cursors[todo[done]] = home[done] + offset + empty[:, done].argmax(axis=0)
        todo, home = todo[~done], home[~done]
        offset += WINDOW


def insert_absent(table: U64s, keys: U64s, cursor: Slots, home: Slots) -> Slots:
    """numpy insertion into the keys array ``table``: place non-zero keys known to be
    absent (repeats allowed), each starting at its ``cursor`` (the first empty slot
    probing saw; ``home`` its home slot); return their slots.

    Keys probing the same empty slot all write it; the one whose write survived won it
    (with its repeats), the others continue after it. Raises TableFull past
    ``MAX_DISPLACEMENT`` (keys already placed are then dead slots).
    """
    out = np.empty(keys.size, np.intp)
    rows = np.arange(keys.size)
    start = home
    cand = cursor  # empty when found: the first round needs no probing
    mine = keys
    has_free = None
    if (cand - start).max() > MAX_DISPLACEMENT:
        raise TableFull
    while True:
        take = np.arange(rows.size) if has_free is None else np.flatnonzero(has_free)
        slots = cand[take]
        table[slots] = mine[take]  # the last write to a slot wins it
        won = take[table[slots] == mine[take]]
        out[rows[won]] = cand[won]
        if won.size == rows.size:
            return out
        cursor = cand + 1 if has_free is None else np.where(has_free, cand + 1, cursor + WINDOW)
        left = np.ones(rows.size, np.bool_)
        left[won] = False
        rows, start, cursor, mine = rows[left], start[left], cursor[left], mine[left]
        free = table[_OFFSETS + cursor] == 0
        has_free = free.any(axis=0)
        cand = cursor + free.argmax(axis=0)
        if not has_free.all():
            cand[~has_free] = -1
        if max((cand - start).max(), (cursor - start).max()) > MAX_DISPLACEMENT:
            raise TableFull


def _move_rows(src: np.ndarray, dst: np.ndarray, src_rows: Slots, dst_rows: Slots) -> None:
    """``dst[dst_rows] = src[src_rows]`` for arrays of one dtype and row shape (one
    compiled pass, without numpy's temporary copy of the gathered rows)."""
    probe = compiled.probe
    if probe is None:
        dst[dst_rows] = src[src_rows]
        return
    probe.move_rows(src, dst, src_rows, dst_rows, src.strides[0])


def check_array(array: Any, dtype: type, shape: tuple[int, ...], name: str) -> None:
    """Raise ValueError unless ``array`` is an ndarray of ``dtype`` and ``shape`` (a
    snapshot's arrays are checked before a table adopts them)."""
    if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != shape:
        got = (getattr(array, "dtype", type(array).__name__), getattr(array, "shape", None))
        raise ValueError(f"table array {name}: expected {np.dtype(dtype)} {shape}, got {got}")

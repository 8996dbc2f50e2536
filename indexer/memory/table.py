"""One model's block index in the memory backend: :class:`BlockTable`, a compact numpy
hash table of block keys with one member bitmask per tier, and everything that reads or
writes it (probing, batched updates, per-member records, lookups, rebuilds, snapshots).

Stateless array helpers and constants are in :mod:`kvindex.indexer.memory.table_layout`; the
rare entries held in several physical copies are kept by
:class:`~kvindex.indexer.memory.table_copies.ExtraCopies`. The hot paths (``update`` on ingest,
``walk`` on ``/score``) hand the work to ``indexer/memory/_probe.c`` in one call each when it is
built; the numpy code beside them is the reference the differential tests compare with.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from kvindex.indexer import compiled
from kvindex.indexer.backend import TIERS, BackendError, MemberMatch, Tier
from kvindex.indexer.memory.table_copies import MAX_MEMBERS, MEMBER_BITS, ExtraCopies
from kvindex.indexer.memory.table_layout import (
    _BIT,
    _MULT,
    _SMALL,
    CHUNK_KEYS,
    DEAD_FRACTION,
    EVICT_FRACTION,
    LOG_SLACK,
    MAX_DISPLACEMENT,
    MAX_LOAD,
    MIN_CAP,
    PAD,
    REBUILD_LOAD,
    STAMP_MAX,
    WORD,
    Bools,
    Counts,
    NeedRoom,
    Ops,
    Slots,
    TableFull,
    U64s,
    Zeros,
    _bit_counts,
    _bit_matrix,
    _home,
    _layout,
    _move_rows,
    _nonzero_rows,
    _rows_differ,
    _shift_for,
    _sorted_unique,
    as_keys,
    check_array,
    insert_absent,
    probe_windows,
)

__all__ = [
    "ANNOUNCE",
    "CHUNK_KEYS",
    "DEAD_FRACTION",
    "EVICT_FRACTION",
    "MAX_DISPLACEMENT",
    "MAX_MEMBERS",
    "MEMBER_BITS",
    "MIN_CAP",
    "PAD",
    "REMOVE",
    "STAMP_MAX",
    "STORE",
    "WORD",
    "_MULT",
    "BlockTable",
    "ChainMatch",
    "NeedRoom",
    "Ops",
    "Slots",
    "TableFull",
    "U64s",
    "Zeros",
    "_home",
    "as_keys",
    "bit_positions",
]

#: Op codes of :meth:`BlockTable.update` (an ``int8`` array of them, or one for all).
STORE, REMOVE, ANNOUNCE = 1, -1, 0


def _effect(op: int | Ops) -> tuple[int | Counts, int | Counts]:
    """``(delta, floor)`` of ops: a count ``c`` becomes ``max(c + delta, floor)``."""
    if isinstance(op, int):
        return op, int(op == ANNOUNCE)
    return op.astype(np.int64), (op == ANNOUNCE).astype(np.int64)


@dataclass(slots=True)
class ChainMatch:
    """Raw lookup answer of the numpy path. The running "held by" mask is ``values[i]``
    up to block ``ends[i]`` (ascending), so the members whose prefix is exactly
    ``ends[i]`` blocks are ``values[i] & ~values[i + 1]``. ``off_gpu[m]`` counts the
    blocks of member ``m``'s prefix it holds only off the GPU, ``cpu[m]`` those of them
    in CPU memory (the rest are in storage); both None when the model has only GPU
    entries."""

    ends: list[int]
    values: list[int]
    off_gpu: list[int] | None = None
    cpu: list[int] | None = None


def bit_positions(value: int) -> list[int]:
    """Positions of the set bits of a non-negative int, lowest first."""
    out = []
    while value:
        low = value & -value
        out.append(low.bit_length() - 1)
        value ^= low
    return out


def _row_int(words: list[int]) -> int:
    """A bitmask row of 64-bit words as one int (bit ``64 * w + b`` = word w, bit b)."""
    return sum(word << (64 * w) for w, word in enumerate(words))


class _SlotLog:
    """Append-only record of the slots one member took in one table (lazy deletion).

    Entries go stale when the member drops the block; they are filtered whenever the
    record is read, and the table compacts the record once it is more than about twice
    the member's live blocks, so clearing a member costs time proportional to its blocks.
    """

    __slots__ = ("buf", "n")

    def __init__(self, slots: Slots | None = None) -> None:
        self.buf = np.empty(16, np.uint32) if slots is None else slots.astype(np.uint32)
        self.n = 0 if slots is None else slots.size

    def extend(self, slots: Slots) -> None:
        need = self.n + slots.size
        if need > self.buf.size:
            grown = np.empty(max(need, self.buf.size + self.buf.size // 2), np.uint32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : need] = slots
        self.n = need

    def view(self) -> npt.NDArray[np.uint32]:
        return self.buf[: self.n]

    def reset(self, slots: Slots) -> None:
        self.buf = slots.astype(np.uint32)
        self.n = slots.size

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes


@dataclass(slots=True)
class _Layout:
    """A table's storage, built aside (a rebuild, a snapshot) and installed in one step."""

    cap: int
    keys: U64s
    masks: list[np.ndarray | None]
    stamps: npt.NDArray[np.uint32] | None
    live: int = 0
    max_disp: int = 0
    zero_used: bool = False
    logs: dict[int, _SlotLog] = field(default_factory=dict)
    copies: ExtraCopies = field(default_factory=ExtraCopies)


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


class BlockTable:
    """One model's keys and member bitmasks. Not thread-safe: the owning
    :class:`~kvindex.indexer.memory.backend.MemoryBackend` serialises writers, and its docstring
    states which reads may run beside a write (the lock-free read rule), which limits
    what :meth:`update` may change in place.

    Why numpy and not a dict: a ``dict[int, ...]`` of block keys costs more per block
    (the int objects and the dict slots) than this whole layout does per (block, member)
    entry. Storage (``bench/README.md`` has the figures):

    * ``keys: uint64[cap + PAD + 1]``: open addressing with linear probing from the home
      slot ``((key ^ seed) * golden) >> (64 - log2 cap)`` (a multiplicative mix with a
      per-process random seed, so neither structured nor crafted keys pile up). Probing
      never wraps: the ``PAD`` slots past ``cap`` absorb the end of the table, and a key
      that would land more than ``MAX_DISPLACEMENT`` slots from home forces a rebuild.
      ``0`` marks an empty slot; the key ``0`` itself lives in the reserved last slot
      ``zero_slot``, so no separate "used" array is needed.
    * ``masks[tier]: uint64[slots, width]``: bit ``m`` is set when member id ``m`` holds
      the block in that tier; ``width`` grows as members are interned. The CPU and
      STORAGE arrays are allocated on the first store to that tier.
    * ``stamps: uint32[slots]``, when the backend has a capacity bound: the step that
      last stored each key (eviction takes the oldest).
    * ``logs``: member id -> :class:`_SlotLog`, the slots it took (clearing a member
      reads its record, never the table); ``copies``: :class:`ExtraCopies`.
    * A slot whose masks become all-zero stays occupied as a *dead* slot (no tombstones:
      a later store of the same key revives it). Past ``DEAD_FRACTION`` of dead slots,
      or when the table must grow, it is rebuilt from its live slots in one pass.

    Invariants (:meth:`check_invariants` verifies them): ``counts[t, m]`` is the number
    of slots whose tier-``t`` mask has bit ``m``; ``held[m]`` the number of slots where
    ``m`` has a bit in any tier; every such slot appears in ``logs[m]``; ``n_live``
    counts slots with any bit set; ``n_used`` counts occupied slots (live or dead);
    every key lies within ``max_disp`` slots after its home slot, with no empty slot in
    between; ``copies`` holds an entry exactly for each (slot, member, tier) held in two
    or more copies.
    """

    #: Allocator of keys and masks (see :data:`~kvindex.indexer.memory.table_layout.Zeros`).
    zeros: Zeros = np.zeros
    # The state, all of it (install() sets what a layout brings).
    keys: U64s
    masks: list[np.ndarray | None]
    stamps: npt.NDArray[np.uint32] | None
    logs: dict[int, _SlotLog]
    copies: ExtraCopies
    cap: int
    shift: np.uint64
    zero_slot: int
    zero_used: bool
    max_disp: int
    n_used: int
    n_live: int
    width: int
    seed: np.uint64
    stamped: bool
    counts: npt.NDArray[np.int64]
    held: npt.NDArray[np.int64]
    rebuilds: int

    def __init__(
        self, width: int, *, seed: int, stamped: bool, cap: int = MIN_CAP, zeros: Zeros = np.zeros
    ) -> None:
        """An empty table of ``cap`` slots (a power of two, at least ``MIN_CAP``), its keys
        and masks allocated by ``zeros``."""
        if cap < MIN_CAP or cap & (cap - 1):
            raise ValueError(f"table capacity must be a power of two >= {MIN_CAP}, got {cap}")
        self.width = width
        self.seed = np.uint64(seed)
        self.stamped = stamped
        self.counts = np.zeros((len(TIERS), 64 * width), np.int64)
        self.held = np.zeros(64 * width, np.int64)
        self.rebuilds = -1  # the first install is not a rebuild
        self.zeros = zeros
        self.install(_empty_layout(cap, width, (True, False, False), stamped, zeros))

    @classmethod
    def reader(
        cls, cap: int, keys: U64s, masks: list[np.ndarray | None], seed: int, width: int
    ) -> Self:
        """A read-only table over arrays another process writes (the shared index's
        readers): :meth:`walk`, :meth:`match` and :meth:`presence` only. Its counters and
        records stay with the writer. It probes up to ``MAX_DISPLACEMENT`` slots, since
        it cannot know the writer's ``max_disp``: probing stops at the first empty slot
        anyway, so the larger bound costs nothing and is never wrong."""
        table = cls.__new__(cls)
        table.cap = cap
        table.seed = np.uint64(seed)
        table.shift = _shift_for(cap)
        table.max_disp = MAX_DISPLACEMENT
        table.zero_slot = cap + PAD
        table.zero_used = True  # if unused, the reserved slot holds no bits: "not held"
        table.width = width
        table.keys = keys
        table.masks = masks
        return table

    # -- storage ---------------------------------------------------------------------------

    def use_storage(self, zeros: Zeros) -> None:
        """Allocate keys and masks with ``zeros`` from now on, the current ones copied
        into it (a table restored from a snapshot, moved into shared memory)."""
        self.zeros = zeros
        keys = zeros(self.keys.shape, np.uint64)
        keys[:] = self.keys
        self.keys = keys
        for tier, m in enumerate(self.masks):
            if m is not None:
                moved = zeros(m.shape, np.uint64)
                moved[:] = m
                self.masks[tier] = moved

    def install(self, layout: _Layout) -> None:
        """Switch to ``layout`` (from :meth:`plan_rebuild`, a snapshot, or empty)."""
        self.cap = layout.cap
        self.shift = _shift_for(layout.cap)
        self.zero_slot = layout.cap + PAD
        self.keys = layout.keys
        self.masks = layout.masks
        self.stamps = layout.stamps
        self.zero_used = layout.zero_used
        self.max_disp = layout.max_disp
        self.n_used = self.n_live = layout.live
        self.logs = layout.logs
        self.copies = layout.copies
        self.rebuilds += 1

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays and reverse records, and an estimate for ``copies``."""
        arrays = [self.keys, self.stamps, *self.masks]
        return (
            sum(a.nbytes for a in arrays if a is not None)
            + sum(log.nbytes for log in self.logs.values())
            + self.copies.nbytes
        )

    def _tier_flat(self, tier: Tier, create: bool) -> np.ndarray | None:
        """The tier's masks as one flat array indexed by ``slot * width + word``."""
        m = self.masks[tier]
        if m is None:
            if not create:
                return None
            m = self.masks[tier] = self.zeros((self.keys.size, self.width), np.uint64)
        return m.reshape(-1)

    def live_rows(self, slots: Slots) -> Bools:
        """Whether each slot holds anything (any member, any tier)."""
        acc = None
        for m in self.masks:
            if m is not None:
                acc = m[slots] if acc is None else acc | m[slots]
        assert acc is not None
        return _nonzero_rows(acc)

    def live_slots(self) -> Slots:
        """Every slot that holds anything; a scan of the whole table."""
        allocated = [m for m in self.masks if m is not None]
        if len(allocated) == 1:  # one tier (most deployments): read it, no copy
            return np.flatnonzero(_nonzero_rows(allocated[0]))
        acc = allocated[0].copy()
        for m in allocated[1:]:
            np.bitwise_or(acc, m, out=acc)
        return np.flatnonzero(_nonzero_rows(acc))

    def dead_slots(self) -> int:
        return self.n_used - self.n_live

    def stamps_of(self, slots: Slots) -> npt.NDArray[np.uint32]:
        assert self.stamps is not None
        return self.stamps[slots]

    # -- probing: key -> slot -------------------------------------------------------------

    def _home_slots(self, keys: U64s) -> Slots:
        return _home(keys, self.seed, self.shift)

    def find(self, keys: U64s, *, exact: bool = True) -> Slots:
        """Slot of each key, or -1 when absent (dead slots are found: they hold keys).

        With ``exact`` false (lookups), key 0 may be answered with an empty slot when
        key 0 is not stored: empty slots hold no bits, so that reads as "not held", and
        the check costs one operation less.
        """
        return self._find(keys, exact=exact, cursors=None)

    def _find(self, keys: U64s, *, exact: bool, cursors: Slots | None) -> Slots:
        """``find``; with ``cursors`` (an array as long as ``keys``), also where each
        absent non-zero key should be inserted: its first empty slot, or where probing
        stopped.

        Compiled (:mod:`kvindex.indexer.compiled`): one probing loop per key, always
        exact. numpy: most keys sit in their home slot at the loads the table keeps, so
        one gather settles them; only the others read windows of ``WINDOW`` slots.
        """
        probe = compiled.probe
        if probe is not None:
            slots = np.empty(keys.size, np.intp)
            status = probe.find(
                self.keys,
                np.ascontiguousarray(keys),
                int(self.seed),
                int(self.shift),
                self.max_disp,
                MAX_DISPLACEMENT,
                self.zero_slot if self.zero_used else -1,
                slots,
                cursors,
            )
            if status < 0:
                raise TableFull
            return slots
        home = self._home_slots(keys)
        at = self.keys[home]
        at_home = at == keys
        if (exact or self.zero_used) and not keys.all():
            zero = keys == 0  # key 0 "matches" every empty slot; it has a reserved slot
            slots = np.where(at_home & ~zero, home, -1)
            slots[zero] = self.zero_slot if self.zero_used else -1
            rest = np.flatnonzero(~at_home & ~zero)
            far = home[rest]
        else:
            rest = np.flatnonzero(~at_home)
            if not rest.size:
                return home
            far = home[rest]
            slots = home  # home becomes the answer
            slots[rest] = -1
            if not exact and not keys[rest].all():  # key 0, not stored: must not probe
                stored = keys[rest] != 0
                rest, far = rest[stored], far[stored]
        if cursors is not None:  # an empty home slot: absent, and the place to insert
            vacant = at[rest] == 0
            cursors[rest[vacant]] = far[vacant]
            rest, far = rest[~vacant], far[~vacant]
        probe_windows(self.keys, self.max_disp, keys[rest], far, slots, rest, cursors)
        return slots

    def _insert(self, keys: U64s, cursor: Slots) -> Slots:
        """Place keys known to be absent (repeats allowed), starting at ``cursor``, the
        first empty slot ``_find`` saw for each; return their slots. ``n_used`` is left
        to the caller, which counts distinct new slots. Raises TableFull past
        ``MAX_DISPLACEMENT`` (keys already placed are then dead slots, which the rebuild
        that follows drops).

        Compiled: the keys are placed one after another, which settles every race.
        numpy: :func:`~kvindex.indexer.memory.table_layout.insert_absent` settles them by
        scatter-then-read-back.
        """
        out = np.empty(keys.size, np.intp)
        probe = compiled.probe
        if probe is not None:
            worst = probe.insert(
                self.keys,
                np.ascontiguousarray(keys),
                np.ascontiguousarray(cursor),
                int(self.seed),
                int(self.shift),
                MAX_DISPLACEMENT,
                self.zero_slot,
                out,
            )
            if worst < 0:
                raise TableFull
            if not keys.all():
                self.zero_used = True
            self.max_disp = max(self.max_disp, worst)
            return out
        if keys.all():
            placing, at = keys, cursor
        else:
            zero = keys == 0
            out[zero] = self.zero_slot
            self.zero_used = True
            placing, at = keys[~zero], cursor[~zero]
        if placing.size:
            home = self._home_slots(placing)
            slots = insert_absent(self.keys, placing, at, home)
            if placing is keys:
                out = slots
            else:
                out[~zero] = slots
            self.max_disp = max(self.max_disp, int((slots - home).max()))
        return out

    def _locate(self, keys: U64s, store: bool | Bools) -> tuple[Slots, Bools | None]:
        """Slots for a batch with stores: stored keys are inserted when absent, removed
        keys that are absent get -1. Also says which elements' slots this call created
        (None: none). Raises NeedRoom (before writing anything) or TableFull."""
        cursors = np.empty(keys.size, np.intp)
        slots = self._find(keys, exact=True, cursors=cursors)
        missing = slots < 0
        rows = np.flatnonzero(missing if store is True else missing & store)
        if not rows.size:
            return slots, None
        limit = MAX_LOAD * self.cap
        if self.n_used + rows.size > limit:  # repeats counted: check again without them
            need = _sorted_unique(keys[rows]).size
            if self.n_used + need > limit:
                raise NeedRoom(need)
        slots[rows] = self._insert(keys[rows], cursors[rows])
        if store is not True:  # a key removed after it was first stored in this batch
            again = np.flatnonzero(missing & ~store)
            if again.size:
                slots[again] = self.find(keys[again])
        return slots, missing

    # -- updates: the ingest path --------------------------------------------------------

    def update(self, tier: Tier, keys: U64s, mid: int | Slots, op: int | Ops, tick: int) -> None:
        """Apply one op per key for member ``mid`` in ``tier`` (``STORE`` adds a copy,
        ``REMOVE`` takes one away but never below zero, ``ANNOUNCE`` makes the count at
        least one), in order per (key, member). Raises NeedRoom or TableFull, after
        which the caller rebuilds and retries (nothing visible changed)."""
        if (
            isinstance(op, int)
            and op == STORE
            and isinstance(mid, int)
            and compiled.probe is not None
            and self.n_used + keys.size <= MAX_LOAD * self.cap
        ):
            self._store(tier, keys, mid, tick)
            return
        if isinstance(op, int):
            needs_slot: bool | Bools = op != REMOVE
        else:
            needs_slot = op != REMOVE
            if needs_slot.all():
                needs_slot = True
        if needs_slot is False:
            if self.masks[tier] is None:
                return
            slots, created = self.find(keys), None
        else:
            slots, created = self._locate(keys, needs_slot)
        if needs_slot is not True:
            found = slots >= 0
            if not found.all():
                slots = slots[found]
                if not isinstance(mid, int):
                    mid = mid[found]
                if not isinstance(op, int):
                    op = op[found]
                if created is not None:
                    created = created[found]
        if not slots.size:
            return
        delta, floor = _effect(op)
        kept, first, folded = self._fold_pairs(slots, mid, delta, floor)
        if kept is not None:
            slots = slots[kept]
            if not isinstance(mid, int):
                mid = mid[kept]
            if created is not None:
                created = created[kept]
            delta, floor = folded
        if created is not None:  # count each new slot once
            self.n_used += int(np.count_nonzero(created if first is None else created & first))
        self._write(tier, slots, mid, delta, floor, None if first is None else slots[first], tick)

    def _store(self, tier: Tier, keys: U64s, mid: int, tick: int) -> None:
        """:meth:`update` for one member storing one copy of each key, compiled
        (``probe.store``): what the steps below do, in one pass per key. Raises
        TableFull like them (nothing visible changed: placed keys hold no bits)."""
        flat = self._tier_flat(tier, create=True)
        assert flat is not None and compiled.probe is not None
        others = tuple(
            m.reshape(-1) for t, m in enumerate(self.masks) if t != tier and m is not None
        )
        n = keys.size
        slots = np.empty(n, np.intp)
        had = np.empty(n, np.uint8)
        gained = np.empty(n, np.uint32)
        done = compiled.probe.store(
            self.keys,
            np.ascontiguousarray(keys),
            int(self.seed),
            int(self.shift),
            MAX_DISPLACEMENT,
            self.zero_slot,
            self.zero_used,
            flat,
            others,
            self.stamps,
            tick,
            self.width,
            mid >> 6,
            int(_BIT[mid & 63]),
            slots,
            had,
            gained,
        )
        if done is None:
            raise TableFull
        worst, created, newly, n_gained, live_new = done
        self.max_disp = max(self.max_disp, worst)
        if not keys.all():
            self.zero_used = True
        self.n_used += created
        self.n_live += live_new
        self.counts[tier, mid] += newly
        self.held[mid] += n_gained
        if n_gained:
            self._extend_log(mid, gained[:n_gained])
        if newly < n:  # extra copies of keys the member held already (rare)
            self.copies.add_one(slots[had.view(np.bool_)], mid, tier)

    def _fold_pairs(
        self, slots: Slots, mid: int | Slots, delta: int | Counts, floor: int | Counts
    ) -> tuple[Slots | None, Bools | None, tuple[int | Counts, int | Counts]]:
        """One element per (slot, member) pair, with the pair's ops folded into one.

        Every op maps a count ``c`` to ``max(c + delta, floor)`` (STORE: +1, 0;
        REMOVE: -1, 0; ANNOUNCE: 0, 1), and such maps compose into one of the same
        form, so a run of ops on one pair folds into its total ``delta`` and a
        ``floor`` of ``max_i(floor_i + the deltas after i)``. Returns the kept
        elements (the last of each pair, in (slot, member) order; None to keep all as
        they are), which of them start a slot (None when every kept element has its own
        slot), and the folded ``(delta, floor)`` arrays of the kept elements.

        Batches without repeated slots skip the sort (compiled: any size, checked in
        one pass; numpy: small ones, such as one 32-block event).
        """
        n = slots.size
        probe = compiled.probe
        if probe is not None:
            if probe.distinct(np.ascontiguousarray(slots)):
                return None, None, (delta, floor)
        elif n <= _SMALL and len(set(slots.tolist())) == n:
            return None, None, (delta, floor)
        single = isinstance(mid, int)
        pair = slots if single else (slots << (64 * self.width - 1).bit_length()) | mid
        order = np.argsort(pair, kind="stable")
        ordered = pair[order]
        last = np.empty(n, np.bool_)
        last[-1] = True
        np.not_equal(ordered[1:], ordered[:-1], out=last[:-1])
        kept = order[last]  # sorted by slot, then member
        if kept.size == n:  # no repeated pair: nothing to fold
            d, f = (np.broadcast_to(x, n)[kept] for x in (delta, floor))
        else:
            starts = np.flatnonzero(np.concatenate(([True], last[:-1])))
            d_all = np.broadcast_to(np.asarray(delta, np.int64), n)[order]
            f_all = np.broadcast_to(np.asarray(floor, np.int64), n)[order]
            running = np.cumsum(d_all)
            end_total = running[last]  # running sum at each pair's last element
            after = np.repeat(end_total, np.diff(np.append(starts, n))) - running
            f = np.maximum.reduceat(f_all + after, starts)
            d = np.add.reduceat(d_all, starts)
        slots = slots[kept]
        first = np.empty(slots.size, np.bool_)
        first[0] = True
        np.not_equal(slots[1:], slots[:-1], out=first[1:])
        return kept, None if first.all() else first, (d, f)

    def _write(
        self,
        tier: Tier,
        slots: Slots,
        mid: int | Slots,
        delta: int | Counts,
        floor: int | Counts,
        distinct: Slots | None,
        tick: int,
    ) -> None:
        """Take each element's copy count to ``max(count + delta, floor)``: set or clear
        one member bit per element, keep extra copies in ``copies`` and every counter
        exact.

        ``slots`` are sorted (slot, member)-pairs without repeats when ``distinct`` is
        given, otherwise all different.
        """
        width = self.width
        flat = self._tier_flat(tier, create=True)
        assert flat is not None
        word = mid >> 6
        bit = _BIT[mid & 63]
        cell = slots if width == 1 else slots * width + word
        old = flat[cell]
        had = (old & bit) != 0
        store = self.copies.settle(tier, slots, mid, had, delta, floor)
        other = self._held_elsewhere(tier, cell, bit)
        rows = slots if distinct is None else distinct
        # one word, one tier (a GPU-only model under 64 members): the word is the row
        whole_row = distinct is None and width == 1 and other is None
        live_before = old != 0 if whole_row else self.live_rows(rows)

        if store is True:
            set_bits, clear_bits = bit, None
        elif store is False:
            set_bits, clear_bits = None, bit
        else:
            set_bits = np.where(store, bit, np.uint64(0))
            clear_bits = np.where(store, np.uint64(0), bit)
        if distinct is None:
            new = old
            if set_bits is not None:
                new = new | set_bits
            if clear_bits is not None:
                new = new & ~clear_bits
            flat[cell] = new
        else:  # several members share a word of one slot: combine per (slot, word) cell
            self._write_cells(flat, cell, set_bits, clear_bits)

        if store is True:
            self.n_live += rows.size - int(np.count_nonzero(live_before))
        else:
            live_after = new != 0 if whole_row else self.live_rows(rows)
            self.n_live += int(np.count_nonzero(live_after)) - int(np.count_nonzero(live_before))
        if self.stamps is not None:
            refreshed = (np.asarray(delta) > 0) | (np.asarray(floor) > 0)
            if refreshed.ndim == 0:
                if refreshed:
                    self.stamps[slots] = tick
            else:
                self.stamps[slots[refreshed]] = tick

        newly = None if store is False else (~had if store is True else store & ~had)
        dropped = None if store is True else (had if store is False else had & ~store)
        self._count(self.counts[tier], mid, newly, dropped)
        gained = newly if newly is None or other is None else newly & ~other
        lost = dropped if dropped is None or other is None else dropped & ~other
        self._count(self.held, mid, gained, lost)
        if gained is not None:
            self._record(slots, mid, gained)

    @staticmethod
    def _write_cells(
        flat: np.ndarray, cell: Slots, set_bits: np.ndarray | None, clear_bits: np.ndarray | None
    ) -> None:
        starts = np.flatnonzero(np.concatenate(([True], cell[1:] != cell[:-1])))
        cells = cell[starts]
        value = flat[cells]
        for bits, is_set in ((set_bits, True), (clear_bits, False)):
            if bits is None:
                continue
            bits = np.broadcast_to(bits, cell.shape)
            combined = np.bitwise_or.reduceat(bits, starts)
            value = value | combined if is_set else value & ~combined
        flat[cells] = value

    def _held_elsewhere(self, tier: Tier, cell: Slots, bit: np.ndarray | np.uint64) -> Bools | None:
        """Whether each element's member holds its slot in another tier (None: no other
        tier is allocated, so never)."""
        acc = None
        for t, m in enumerate(self.masks):
            if t != tier and m is not None:
                held = (m.reshape(-1)[cell] & bit) != 0
                acc = held if acc is None else acc | held
        return acc

    def _count(
        self, counter: np.ndarray, mid: int | Slots, up: Bools | None, down: Bools | None
    ) -> None:
        n = counter.size
        for mask, sign in ((up, 1), (down, -1)):
            if mask is None:
                continue
            if isinstance(mid, int):
                counter[mid] += sign * int(np.count_nonzero(mask))
            else:
                counter += sign * np.bincount(mid[mask], minlength=n)

    # -- members: reverse records, clearing, re-numbering ---------------------------------

    def widen(self, width: int) -> None:
        """Make room for member ids below ``64 * width``."""
        for t, m in enumerate(self.masks):
            if m is not None:
                wide = self.zeros((m.shape[0], width), np.uint64)
                wide[:, : self.width] = m
                self.masks[t] = wide
        n = 64 * width
        self.counts = np.pad(self.counts, ((0, 0), (0, n - self.counts.shape[1])))
        self.held = np.pad(self.held, (0, n - self.held.size))
        self.width = width

    def narrow(self, width: int) -> None:
        """Drop the mask words past ``width`` (every member id is below ``64 * width``)."""
        for t, m in enumerate(self.masks):
            if m is not None:
                narrow = self.zeros((m.shape[0], width), np.uint64)
                narrow[:] = m[:, :width]
                self.masks[t] = narrow
        self.counts = self.counts[:, : 64 * width].copy()
        self.held = self.held[: 64 * width].copy()
        self.width = width

    def move_member(self, old: int, new: int) -> None:
        """Give member ``old``'s bits, counters, record and copies to the unused id
        ``new``. Costs time proportional to that member's blocks (its record)."""
        log = self.logs.pop(old, None)
        if log is not None:
            slots = _sorted_unique(log.view())
            width = self.width
            old_bit, new_bit = _BIT[old & 63], _BIT[new & 63]
            for m in self.masks:
                if m is None:
                    continue
                flat = m.reshape(-1)
                cells = slots * width + (old >> 6)
                mine = slots[(flat[cells] & old_bit) != 0]
                flat[mine * width + (old >> 6)] &= ~old_bit
                flat[mine * width + (new >> 6)] |= new_bit
            self.logs[new] = log
        self.counts[:, new], self.counts[:, old] = self.counts[:, old], 0
        self.held[new], self.held[old] = self.held[old], 0
        self.copies.move_member(old, new)

    def _record(self, slots: Slots, mid: int | Slots, gained: Bools) -> None:
        """Append slots a member newly holds to its reverse record."""
        if isinstance(mid, int):
            if gained.any():
                self._extend_log(mid, slots[gained])
            return
        rows = np.flatnonzero(gained)
        if not rows.size:
            return
        ids = mid[rows]
        if self.width <= 1024:  # ids below 2**16: numpy's stable sort is then a radix sort
            ids = ids.astype(np.uint16)
        order = rows[np.argsort(ids, kind="stable")]
        ids = mid[order]
        bounds = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        for part in np.split(order, bounds):
            self._extend_log(int(mid[part[0]]), slots[part])

    def _extend_log(self, mid: int, slots: Slots) -> None:
        log = self.logs.get(mid)
        if log is None:
            log = self.logs[mid] = _SlotLog()
        log.extend(slots)
        if log.n > 2 * int(self.held[mid]) + LOG_SLACK:
            self._compact_log(mid, log)

    def _compact_log(self, mid: int, log: _SlotLog) -> None:
        slots = _sorted_unique(log.view())
        slots = slots[self._member_holds(slots, mid)]
        if slots.size:
            log.reset(slots)
        else:
            del self.logs[mid]

    def _member_holds(self, slots: Slots, mid: int) -> Bools:
        """Whether member ``mid`` holds each slot in any tier."""
        cell = slots * self.width + (mid >> 6)
        bit = _BIT[mid & 63]
        acc = np.zeros(slots.size, np.bool_)
        for m in self.masks:
            if m is not None:
                acc |= (m.reshape(-1)[cell] & bit) != 0
        return acc

    def clear_member(self, mid: int, tiers: Collection[Tier]) -> int:
        """Drop what member ``mid`` holds in ``tiers``; return the (block, tier) entries
        dropped. Reads only the member's reverse record."""
        log = self.logs.get(mid)
        if log is None:
            return 0
        slots = _sorted_unique(log.view())
        cell = slots * self.width + (mid >> 6)
        bit = _BIT[mid & 63]
        live_before = self.live_rows(slots)
        kept = np.zeros(slots.size, np.bool_)
        dropped = 0
        for t, m in enumerate(self.masks):
            if m is None:
                continue
            flat = m.reshape(-1)
            old = flat[cell]
            has = (old & bit) != 0
            if t not in tiers:
                kept |= has
                continue
            n = int(np.count_nonzero(has))
            if n:
                flat[cell[has]] = old[has] & ~bit
                self.counts[t, mid] -= n
                dropped += n
        self.n_live += int(np.count_nonzero(self.live_rows(slots))) - int(
            np.count_nonzero(live_before)
        )
        self.copies.drop_member(mid, tiers)
        remaining = slots[kept]
        self.held[mid] = remaining.size
        if remaining.size:
            log.reset(remaining)
        else:
            del self.logs[mid]
        return dropped

    def member_keys(self, mid: int, tier: Tier | None) -> list[int]:
        """The keys member ``mid`` holds (in ``tier``, or in any), sorted; reads only its
        reverse record."""
        log = self.logs.get(mid)
        if log is None:
            return []
        slots = _sorted_unique(log.view())
        if tier is None:
            slots = slots[self._member_holds(slots, mid)]
        else:
            m = self.masks[tier]
            if m is None:
                return []
            slots = slots[(m.reshape(-1)[slots * self.width + (mid >> 6)] & _BIT[mid & 63]) != 0]
        return np.sort(self.keys[slots]).tolist()

    def forget_member(self, mid: int) -> None:
        """Drop the (all stale) record of a member that holds nothing, before its id is
        reused."""
        self.logs.pop(mid, None)

    def drop_slots(self, slots: Slots) -> None:
        """Empty these live slots for every member and tier (capacity eviction)."""
        width = self.width
        acc = np.zeros((slots.size, width), np.uint64)
        for t, m in enumerate(self.masks):
            if m is not None:
                rows = m[slots]
                self.counts[t] -= _bit_counts(rows, width)
                acc |= rows
                m[slots] = 0
        self.held -= _bit_counts(acc, width)
        self.n_live -= slots.size
        self.copies.drop_slots(slots)

    # -- queries: the lookup path (read-only) ----------------------------------------------

    def match(self, keys: U64s, allowed: np.ndarray | np.uint64 | None) -> ChainMatch | None:
        """Each member's longest run of leading ``keys`` held in any tier.

        The running AND of the per-block "held anywhere" masks drops a member's bit at
        its first hole, so the running mask changes at most once per member: the
        prefix lengths come from those few change rows, decoded as Python ints.
        """
        slots = self.find(keys, exact=False)
        first_absent = int(slots.argmin())  # -1 is the smallest slot value
        if slots[first_absent] < 0:
            if first_absent == 0:
                return None
            slots = slots[:first_absent]
        one_word = self.width == 1
        held = None
        for m in self.masks:
            if m is not None:
                rows = (m.reshape(-1) if one_word else m)[slots]
                held = rows if held is None else held | rows
        assert held is not None
        if allowed is not None:
            held &= allowed
        running = np.bitwise_and.accumulate(held, axis=0)
        if one_word:
            length = int(np.count_nonzero(running))
            if not length:
                return None
            run = running[:length]
            last = np.flatnonzero(run[:-1] != run[1:])
            values = run[last].tolist()
            values.append(int(run[-1]))
        else:
            length = int(np.count_nonzero(_nonzero_rows(running)))
            if not length:
                return None
            run = running[:length]
            last = np.flatnonzero(_rows_differ(run))
            values = [_row_int(row) for row in run[last].tolist()]
            values.append(_row_int(run[-1].tolist()))
        ends = (last + 1).tolist()
        ends.append(length)
        found = ChainMatch(ends, values)
        if self.masks[Tier.CPU] is not None or self.masks[Tier.STORAGE] is not None:
            self._count_tiers(found, slots[:length], run)
        return found

    def walk(
        self, keys: U64s | list[int], allowed: int | None, names: list[str | None]
    ) -> list[MemberMatch]:
        """Each member's longest run of leading ``keys`` held in any tier, as the
        compiled kernel answers it in one call (``indexer/memory/_probe.c`` ``walk``): probing,
        the running mask, the prefix lengths, the tier counts and the answer objects,
        best first (the order :func:`kvindex.indexer.memory.answer.answer` gives).

        ``keys`` is a ``uint64`` array or a list of ints (read in C; anything else in
        the list raises TypeError or OverflowError, and the caller converts it);
        ``allowed`` the member filter as an int of bits (None: every member); ``names``
        member id -> name. Only when :data:`kvindex.indexer.compiled.probe` is set.
        """
        probe = compiled.probe
        assert probe is not None
        gpu, cpu, storage = self.masks
        return probe.walk(  # type: ignore[no-any-return]
            self.keys,
            gpu,
            cpu,
            storage,
            keys,
            int(self.seed),
            int(self.shift),
            self.max_disp,
            self.zero_slot if self.zero_used else -1,
            allowed,
            self.width,
            names,
            MemberMatch,
        )

    def presence(self, keys: U64s, allowed: np.ndarray | np.uint64 | None) -> dict[int, list[int]]:
        """Per member id holding any of ``keys``: one bitmask per tier over the positions
        of ``keys`` (bit ``i`` = holds ``keys[i]`` there). No early stop: every key is
        probed (sliding-window and Mamba hits need blocks past a hole)."""
        slots = self.find(keys, exact=False)
        at = np.flatnonzero(slots >= 0)
        out: dict[int, list[int]] = {}
        if not at.size:
            return out
        slots = slots[at]
        n = keys.size
        for tier, masks in enumerate(self.masks):
            if masks is None:
                continue
            rows = masks[slots]
            if allowed is not None:
                rows = rows & allowed
            bits = _bit_matrix(rows)  # uint8[len(at), 64 * W]: column m = member id m
            for mid in np.flatnonzero(bits.any(axis=0)).tolist():
                mask = np.zeros(n, np.uint8)
                mask[at[bits[:, mid].astype(np.bool_)]] = 1
                packed = np.packbits(mask, bitorder="little").tobytes()
                out.setdefault(mid, [0, 0, 0])[tier] = int.from_bytes(packed, "little")
        return out

    def _count_tiers(self, found: ChainMatch, slots: Slots, run: np.ndarray) -> None:
        """Fill ``found.off_gpu`` and ``found.cpu``.

        Row ``i`` of the running mask holds exactly the members whose prefix covers
        block ``i``, so ``run & ~gpu`` marks, per member, the prefix blocks held only off
        the GPU (and ``& cpu`` those in CPU memory). Those rows come in long runs of
        equal values (offloading moves whole ranges), so each distinct run is unpacked
        once and weighted by its length.
        """
        gpu, cpu, _ = self.masks
        assert gpu is not None
        length = slots.size
        off = run.reshape(length, -1) & ~gpu[slots]
        both = off if cpu is None else np.concatenate((off, off & cpu[slots]), axis=1)
        changes = np.flatnonzero(_rows_differ(both)) + 1
        bounds = np.concatenate(((0,), changes, (length,)))
        runs = bounds[1:] - bounds[:-1]
        counts = (runs @ _bit_matrix(both[bounds[:-1]])).tolist()
        n = 64 * self.width
        found.off_gpu = counts[:n]
        found.cpu = counts[n:] if cpu is not None else [0] * n

    # -- rebuilds ----------------------------------------------------------------------------

    @staticmethod
    def cap_for(live: int) -> int:
        """Smallest table where ``live`` keys fill at most ``REBUILD_LOAD`` of it."""
        cap = MIN_CAP
        while live > REBUILD_LOAD * cap:
            cap *= 2
        return cap

    def plan_rebuild(self, cap: int) -> _Layout:
        """This table's live slots re-inserted into a fresh table of at least ``cap``
        slots, with the reverse records remapped; dead slots disappear.

        Only reads the table, so readers may keep reading it meanwhile; the writer must
        not change it before :meth:`install`. Raises BackendError when keys collide so
        badly that no sane size fits them. Compiled (``probe.relayout``): one pass over
        the old table, no temporary arrays, reverse records rebuilt exact.
        """
        if compiled.probe is not None:
            return self._plan_rebuild_compiled(cap)
        live = self.live_slots()
        keys = self.keys[live]
        tiers = tuple(m is not None for m in self.masks)
        while True:
            if cap > 64 * max(keys.size, MIN_CAP):
                raise BackendError("block keys collide pathologically; the table cannot grow")
            out = _empty_layout(cap, self.width, tiers, self.stamped, self.zeros)
            try:
                slots, max_disp = _layout(keys, cap, self.seed, out.keys)
                break
            except TableFull:
                cap *= 2
        for old, new in zip(self.masks, out.masks, strict=True):
            if old is not None and new is not None:
                _move_rows(old, new, live, slots)
        if self.stamps is not None and out.stamps is not None:
            _move_rows(self.stamps, out.stamps, live, slots)
        out.live, out.max_disp, out.zero_used = keys.size, max_disp, bool((keys == 0).any())
        remap = np.full(self.keys.size, -1, np.intp)
        remap[live] = slots
        for mid, log in self.logs.items():  # entries of dead slots go; stale ones may stay
            moved = remap[log.view()]
            out.logs[mid] = _SlotLog(moved[moved >= 0])
        out.copies = self.copies.moved(lambda old: remap[old])
        return out

    def _plan_rebuild_compiled(self, cap: int) -> _Layout:
        probe = compiled.probe
        assert probe is not None
        tiers = tuple(m is not None for m in self.masks)
        old_masks = tuple(m for m in self.masks if m is not None)
        while True:
            if cap > 64 * max(self.n_live, MIN_CAP):
                raise BackendError("block keys collide pathologically; the table cannot grow")
            out = _empty_layout(cap, self.width, tiers, self.stamped, self.zeros)
            done = probe.relayout(
                self.keys,
                old_masks,
                out.keys,
                tuple(m for m in out.masks if m is not None),
                self.width,
                self.stamps,
                out.stamps,
                int(self.seed),
                int(_shift_for(cap)),
                MAX_DISPLACEMENT,
                self.zero_slot,
                cap + PAD,
            )
            if done is not None:
                break
            cap *= 2
        out.live, out.max_disp, out.zero_used, records = done

        def new_slots(old: Slots) -> Slots:
            moved = np.empty(old.size, np.intp)
            probe.find(
                out.keys, self.keys[old], int(self.seed), int(_shift_for(cap)), out.max_disp,
                MAX_DISPLACEMENT, cap + PAD, moved, None,
            )  # fmt: skip
            return moved

        out.logs = {mid: _SlotLog(np.frombuffer(slots, np.uint32)) for mid, slots in records}
        out.copies = self.copies.moved(new_slots)
        return out

    # -- snapshots -----------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """This table as plain arrays (copies) and scalars, for a snapshot file.

        With :meth:`from_state` this is the one place that enumerates the table's
        storage: a change of representation changes these two methods and nothing else.
        """
        mids = sorted(self.logs)
        logs = [self.logs[m].view() for m in mids]
        return {
            "width": self.width,
            "seed": int(self.seed),
            "cap": self.cap,
            "max_disp": self.max_disp,
            "zero_used": self.zero_used,
            "n_used": self.n_used,
            "n_live": self.n_live,
            "keys": self.keys.copy(),
            "masks": [None if m is None else m.copy() for m in self.masks],
            "stamps": None if self.stamps is None else self.stamps.copy(),
            "counts": self.counts.copy(),
            "held": self.held.copy(),
            "log_members": np.array(mids, np.int64),
            "log_sizes": np.array([log.size for log in logs], np.int64),
            "log_slots": np.concatenate(logs) if logs else np.zeros(0, np.uint32),
            **self.copies.to_arrays(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], *, stamped: bool) -> Self:
        """A table from :meth:`to_state`'s output (arrays are adopted, not copied).
        ``stamped`` is the backend's current setting: stamps are added (all "oldest") or
        dropped to match it. Raises ValueError when the arrays do not fit together."""
        table = cls.__new__(cls)
        width, cap = int(state["width"]), int(state["cap"])
        size = cap + PAD + 1
        keys, counts, held = state["keys"], state["counts"], state["held"]
        masks = list(state["masks"])
        if cap < MIN_CAP or cap & (cap - 1) or width < 1 or len(masks) != len(TIERS):
            raise ValueError(f"table of {cap} slots and {width} mask words is not valid")
        check_array(keys, np.uint64, (size,), "keys")
        check_array(counts, np.int64, (len(TIERS), 64 * width), "counts")
        check_array(held, np.int64, (64 * width,), "held")
        for tier, m in enumerate(masks):
            if m is not None:
                check_array(m, np.uint64, (size, width), f"masks[{tier}]")
        if masks[Tier.GPU] is None:
            raise ValueError("table has no GPU masks")
        stamps = state["stamps"]
        if stamps is not None:
            check_array(stamps, np.uint32, (size,), "stamps")
        if stamped and stamps is None:
            stamps = np.zeros(size, np.uint32)
        elif not stamped:
            stamps = None
        members, sizes, slots = state["log_members"], state["log_sizes"], state["log_slots"]
        check_array(slots, np.uint32, (int(sizes.sum()),), "log_slots")
        if members.shape != sizes.shape or (slots.size and int(slots.max()) >= size):
            raise ValueError("reverse records do not fit the table")
        logs: dict[int, _SlotLog] = {}
        start = 0
        for mid, n in zip(members.tolist(), sizes.tolist(), strict=True):
            if not 0 <= mid < 64 * width:
                raise ValueError(f"reverse record of member id {mid} out of range")
            logs[mid] = _SlotLog(slots[start : start + n])
            start += n
        table.width = width
        table.seed = np.uint64(int(state["seed"]))
        table.stamped = stamped
        table.counts = counts
        table.held = held
        table.rebuilds = -1
        layout = _Layout(cap, keys, masks, stamps, int(state["n_live"]))
        layout.max_disp = int(state["max_disp"])
        layout.zero_used = bool(state["zero_used"])
        layout.logs = logs
        layout.copies = ExtraCopies.from_arrays(state, size, width)
        table.install(layout)
        table.n_used = int(state["n_used"])
        table.check_invariants()
        return table

    def check_invariants(self) -> None:
        """Raise ValueError unless the invariants of BlockTable's docstring hold.

        A snapshot's checksum proves the file is the one written, not that what was
        written (or forged with a fresh checksum) is a table: wrong counters would be
        served as block counts, and a key outside its probe range is never found. Every
        derived number is recomputed from the keys and masks and compared, in passes
        linear in the table's slots (plus its reverse records and extra copies).
        """
        keys, width = self.keys, self.width
        if not 0 <= self.max_disp <= MAX_DISPLACEMENT:
            raise ValueError(f"largest probe displacement {self.max_disp} is out of range")
        if keys[self.zero_slot] != 0:
            raise ValueError("the slot reserved for key 0 holds another key")
        slots = np.flatnonzero(keys)
        # Each key is found where it sits: within max_disp of its home with no empty
        # slot between (the probe invariant), and no copy of it earlier on its path.
        try:
            found = self.find(keys[slots])
        except TableFull:
            found = np.full(slots.size, -1, np.intp)
        misplaced = np.flatnonzero(found != slots)
        if misplaced.size:
            raise ValueError(
                f"{misplaced.size} key(s) are not where probing finds them (first at slot "
                f"{int(slots[misplaced[0]])}): a broken probe invariant or a duplicate key"
            )
        if slots.size + self.zero_used != self.n_used:
            raise ValueError(f"{self.n_used} slots said used, {slots.size + self.zero_used} are")
        any_tier = np.zeros((keys.size, width), np.uint64)
        for tier, masks in enumerate(self.masks):
            if masks is None:
                recount = np.zeros(64 * width, np.int64)
            else:
                recount = _bit_counts(masks, width)
                np.bitwise_or(any_tier, masks, out=any_tier)
            if not np.array_equal(recount, self.counts[tier]):
                raise ValueError(f"{TIERS[tier].label} block counts do not match the table")
        if not np.array_equal(_bit_counts(any_tier, width), self.held):
            raise ValueError("blocks held per member do not match the table")
        live = _nonzero_rows(any_tier)
        occupied = keys != 0
        occupied[self.zero_slot] = self.zero_used
        if (live & ~occupied).any():
            raise ValueError("members hold blocks in empty slots")
        if int(np.count_nonzero(live)) != self.n_live:
            raise ValueError(f"{self.n_live} slots said live, {int(live.sum())} are")
        recorded = np.zeros_like(any_tier)
        for mid, log in self.logs.items():
            recorded[log.view(), mid >> 6] |= _BIT[mid & 63]
        if (any_tier & ~recorded).any():
            raise ValueError("a member holds blocks its reverse record does not list")
        self.copies.check(self.masks)

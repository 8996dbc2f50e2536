"""Applying stores, removals and announcements to the table, with exact counters.

Part of :class:`~kvindex.indexer.memory_table.BlockTable` (a mixin). One call of
:meth:`_Updates.update` applies a vectorised batch for one tier: slots are found or
inserted (``table_probe``), the ops on each (slot, member) pair are folded into one, and
member bits, copy counts (``table_copies``), counters, stamps and reverse records
(``table_members``) are written. This is the ingest hot path (``bench/bench_ingest.py``).
"""

from __future__ import annotations

import numpy as np

from kvindex.indexer import compiled
from kvindex.indexer.backend import Tier
from kvindex.indexer.table_copies import _copy_codes
from kvindex.indexer.table_layout import (
    _BIT,
    _SMALL,
    MAX_DISPLACEMENT,
    MAX_LOAD,
    Bools,
    Counts,
    Ops,
    Slots,
    TableFull,
    U64s,
)

#: Op codes of :meth:`BlockTable.update` (an ``int8`` array of them, or one for all).
STORE, REMOVE, ANNOUNCE = 1, -1, 0


def _effect(op: int | Ops) -> tuple[int | Counts, int | Counts]:
    """``(delta, floor)`` of ops: a count ``c`` becomes ``max(c + delta, floor)``."""
    if isinstance(op, int):
        return op, int(op == ANNOUNCE)
    return op.astype(np.int64), (op == ANNOUNCE).astype(np.int64)


class _Updates:
    """:meth:`update` and the steps it is made of."""

    def _tier_flat(self, tier: Tier, create: bool) -> np.ndarray | None:
        """The tier's masks as one flat array indexed by ``slot * W + word``."""
        m = self.masks[tier]
        if m is None:
            if not create:
                return None
            m = self.masks[tier] = self.zeros((self.keys.size, self.width), np.uint64)
        return m.reshape(-1)

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
            copies = self.copies
            for code in _copy_codes(slots[had.view(np.bool_)], mid, tier):
                copies[code] = copies.get(code, 0) + 1

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
        store = self._settle_copies(tier, slots, mid, had, delta, floor)
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

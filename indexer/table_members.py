"""Per-member bookkeeping: the reverse records of the slots each member holds, and the
operations that work member by member (clear, list, re-number, widen the masks).

Part of :class:`~kvindex.indexer.memory_table.BlockTable` (a mixin). The reverse record
is why clearing one pod costs time proportional to its blocks, not to the table.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import numpy.typing as npt

from kvindex.indexer.backend import Tier
from kvindex.indexer.table_copies import _code_fields, _copy_codes
from kvindex.indexer.table_layout import (
    _BIT,
    LOG_SLACK,
    Bools,
    Slots,
    _bit_counts,
    _sorted_unique,
)


class _SlotLog:
    """Append-only record of the slots one member took in one model (lazy deletion).

    Entries go stale when the member drops the block; they are filtered whenever the
    record is read, and the record is compacted once it is more than about twice the
    member's live blocks, so clearing a member costs time proportional to its blocks.
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


class _Members:
    """Member-wise operations over the reverse records in ``logs``."""

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
        if self.copies:
            codes = np.fromiter(self.copies, np.int64, len(self.copies))
            slot, mid, tier = _code_fields(codes)
            for code, s, t in zip(
                codes[mid == old].tolist(),
                slot[mid == old].tolist(),
                tier[mid == old].tolist(),
                strict=True,
            ):
                (recoded,) = _copy_codes(np.array([s]), new, t)
                self.copies[recoded] = self.copies.pop(code)

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
        if self.copies:
            self._drop_copies(lambda slot, m, t: (m == mid) & np.isin(t, list(tiers)))
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
        if self.copies:
            self._drop_copies(lambda slot, m, t: np.isin(slot, slots))

    def stamps_of(self, slots: Slots) -> npt.NDArray[np.uint32]:
        assert self.stamps is not None
        return self.stamps[slots]

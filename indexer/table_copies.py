"""Extra physical copies of an entry (vLLM keeps one hash in several blocks at times).

Part of :class:`~kvindex.indexer.memory_table.BlockTable` (a mixin over its ``copies``
dict). An entry held in one copy is its member bit alone; only the rare entries held in
two or more copies get a ``copies`` entry, keyed by one int that packs slot, member id
and tier (:func:`_copy_codes`), holding the number of copies past the first.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvindex.indexer.backend import Tier
from kvindex.indexer.table_layout import Bools, Counts, Slots

#: Member ids must fit the copy code's member field (see :func:`_copy_codes`).
MEMBER_BITS = 18
MAX_MEMBERS = 1 << MEMBER_BITS
#: About what one ``copies`` entry costs (dict slot, int key; small counts are cached).
COPY_ENTRY_BYTES = 100


def _copy_codes(slots: Slots, mid: int | Slots, tier: int) -> list[int]:
    """Keys of ``BlockTable.copies``: slot, member id and tier in one int."""
    codes = (slots.astype(np.int64) << (MEMBER_BITS + 2)) | (np.asarray(mid, np.int64) << 2)
    return (codes | tier).tolist()


def _code_fields(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slot, member id and tier of copy codes."""
    return codes >> (MEMBER_BITS + 2), (codes >> 2) & (MAX_MEMBERS - 1), codes & 3


class _Copies:
    """Keeps ``copies`` exact as counts change or members and slots go."""

    def _settle_copies(
        self,
        tier: Tier,
        slots: Slots,
        mid: int | Slots,
        had: Bools,
        delta: int | Counts,
        floor: int | Counts,
    ) -> bool | Bools:
        """Update ``copies`` (extra copies past the first) for the elements' new counts;
        return whether each element's member holds the key afterwards (True/False when
        uniform). A count is ``had`` (its bit) plus its extra copies; numpy work only,
        unless an element has or gets a second copy (rare)."""
        copies = self.copies
        any_had = bool(had.any())
        if not any_had:
            if isinstance(delta, int) and isinstance(floor, int):  # the common case
                return max(delta, floor) >= 1
            new: int | Counts = np.maximum(delta, floor)
            count = None
        else:
            count = had.astype(np.int64)
            if copies:
                rows = np.flatnonzero(had)
                codes = _copy_codes(slots[rows], mid if isinstance(mid, int) else mid[rows], tier)
                count[rows] += [copies.get(c, 0) for c in codes]
            new = np.maximum(count + delta, floor)
        if np.ndim(new) == 0:
            held = int(new) >= 1
            if int(new) >= 2:  # a scalar count: every element, all absent before
                new = np.full(slots.size, int(new), np.int64)
            else:
                return held
        busy = new >= 2
        if count is not None and copies:
            busy |= count >= 2
        rows = np.flatnonzero(busy)
        if rows.size:
            codes = _copy_codes(slots[rows], mid if isinstance(mid, int) else mid[rows], tier)
            for code, n in zip(codes, new[rows].tolist(), strict=True):
                if n >= 2:
                    copies[code] = n - 1
                else:
                    copies.pop(code, None)
        held_each = new >= 1
        if held_each.all():
            return True
        if not held_each.any():
            return False
        return held_each

    def _drop_copies(self, which: Callable[[Slots, Slots, Slots], Bools]) -> None:
        """Forget the extra copies ``which(slot, member id, tier)`` selects (a pass over
        the extra copies only, which are few)."""
        codes = np.fromiter(self.copies, np.int64, len(self.copies))
        for code in codes[which(*_code_fields(codes))].tolist():
            del self.copies[code]

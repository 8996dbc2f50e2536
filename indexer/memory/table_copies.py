"""Extra physical copies of a table entry: vLLM keeps one hash in several blocks at times
and publishes a ``BlockStored`` and a ``BlockRemoved`` per copy.

An entry held in one copy is its member bit alone; only the rare entries held in two or
more copies get a record here, so the common case costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from kvindex.indexer.backend import TIERS, Tier
from kvindex.indexer.memory.table_layout import _BIT, Bools, Counts, Slots, check_array

#: Member ids must fit the copy code's member field (see :func:`_copy_codes`).
MEMBER_BITS = 18
MAX_MEMBERS = 1 << MEMBER_BITS
#: About what one entry costs (dict slot, int key; small counts are cached).
COPY_ENTRY_BYTES = 100


def _copy_codes(slots: Slots, mid: int | Slots, tier: int) -> list[int]:
    """Slot, member id and tier of each element as one int (the record's key)."""
    codes = (slots.astype(np.int64) << (MEMBER_BITS + 2)) | (np.asarray(mid, np.int64) << 2)
    return (codes | tier).tolist()


def _code_fields(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slot, member id and tier of copy codes."""
    return codes >> (MEMBER_BITS + 2), (codes >> 2) & (MAX_MEMBERS - 1), codes & 3


class ExtraCopies:
    """Copies past the first of each (slot, member id, tier) entry held two or more times.

    Owned by one :class:`~kvindex.indexer.memory.table.BlockTable`, which calls it
    whenever counts change or members and slots go. Invariant: every record has a count
    of at least 1, and its member's bit is set in that tier of that slot.
    """

    __slots__ = ("_extra",)

    def __init__(self, extra: dict[int, int] | None = None) -> None:
        self._extra: dict[int, int] = {} if extra is None else extra

    def __len__(self) -> int:
        return len(self._extra)

    @property
    def nbytes(self) -> int:
        """An estimate: a dict entry with its int key per record."""
        return COPY_ENTRY_BYTES * len(self._extra)

    def entries(self) -> list[tuple[int, int, int, int]]:
        """Every record as ``(slot, member id, tier, extra copies)``."""
        codes = self._codes()
        slot, mid, tier = _code_fields(codes)
        return list(
            zip(slot.tolist(), mid.tolist(), tier.tolist(), self._extra.values(), strict=True)
        )

    def _codes(self) -> np.ndarray:
        return np.fromiter(self._extra, np.int64, len(self._extra))

    # -- counts changing --------------------------------------------------------------

    def settle(
        self,
        tier: Tier,
        slots: Slots,
        mid: int | Slots,
        had: Bools,
        delta: int | Counts,
        floor: int | Counts,
    ) -> bool | Bools:
        """Take each element's copy count to ``max(count + delta, floor)``, where a count
        is ``had`` (its member bit) plus its extra copies; return whether each element's
        member holds the key afterwards (True/False when uniform). numpy work only,
        unless an element has or gets a second copy (rare)."""
        extra = self._extra
        any_had = bool(had.any())
        if not any_had:
            if isinstance(delta, int) and isinstance(floor, int):  # the common case
                return max(delta, floor) >= 1
            new: int | Counts = np.maximum(delta, floor)
            count = None
        else:
            count = had.astype(np.int64)
            if extra:
                rows = np.flatnonzero(had)
                codes = _copy_codes(slots[rows], mid if isinstance(mid, int) else mid[rows], tier)
                count[rows] += [extra.get(c, 0) for c in codes]
            new = np.maximum(count + delta, floor)
        if np.ndim(new) == 0:
            held = int(new) >= 1
            if int(new) >= 2:  # a scalar count: every element, all absent before
                new = np.full(slots.size, int(new), np.int64)
            else:
                return held
        busy = new >= 2
        if count is not None and extra:
            busy |= count >= 2
        rows = np.flatnonzero(busy)
        if rows.size:
            codes = _copy_codes(slots[rows], mid if isinstance(mid, int) else mid[rows], tier)
            for code, n in zip(codes, new[rows].tolist(), strict=True):
                if n >= 2:
                    extra[code] = n - 1
                else:
                    extra.pop(code, None)
        held_each = new >= 1
        if held_each.all():
            return True
        if not held_each.any():
            return False
        return held_each

    def add_one(self, slots: Slots, mid: int, tier: Tier) -> None:
        """One more copy of each element, whose member held it already."""
        extra = self._extra
        for code in _copy_codes(slots, mid, tier):
            extra[code] = extra.get(code, 0) + 1

    # -- members and slots going ------------------------------------------------------

    def drop_member(self, mid: int, tiers: Collection[Tier]) -> None:
        if self._extra:
            self._drop(lambda slot, m, t: (m == mid) & np.isin(t, list(tiers)))

    def drop_slots(self, slots: Slots) -> None:
        if self._extra:
            self._drop(lambda slot, m, t: np.isin(slot, slots))

    def _drop(self, which: Callable[[Slots, Slots, Slots], Bools]) -> None:
        """Forget the records ``which(slot, member id, tier)`` selects (a pass over the
        records only, which are few)."""
        codes = self._codes()
        for code in codes[which(*_code_fields(codes))].tolist():
            del self._extra[code]

    def move_member(self, old: int, new: int) -> None:
        """Give member ``old``'s records to the unused id ``new``."""
        if not self._extra:
            return
        codes = self._codes()
        slot, mid, tier = _code_fields(codes)
        mine = mid == old
        for code, s, t in zip(
            codes[mine].tolist(), slot[mine].tolist(), tier[mine].tolist(), strict=True
        ):
            (recoded,) = _copy_codes(np.array([s]), new, t)
            self._extra[recoded] = self._extra.pop(code)

    def moved(self, new_slots: Callable[[Slots], Slots]) -> ExtraCopies:
        """These records in a rebuilt table, ``new_slots`` mapping old slots to new ones.
        Records sit on live slots only, so every one moves."""
        if not self._extra:
            return ExtraCopies()
        codes = self._codes()
        slot, mid, tier = _code_fields(codes)
        moved_codes = _copy_codes(new_slots(slot), mid, 0)
        return ExtraCopies(
            {
                code | t: n
                for code, t, n in zip(moved_codes, tier.tolist(), self._extra.values(), strict=True)
            }
        )

    # -- snapshots ----------------------------------------------------------------------

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The snapshot arrays ``copy_codes`` and ``copy_extra``."""
        return {
            "copy_codes": self._codes(),
            "copy_extra": np.fromiter(self._extra.values(), np.int64, len(self._extra)),
        }

    @classmethod
    def from_arrays(cls, state: dict[str, Any], size: int, width: int) -> ExtraCopies:
        """The records of a snapshot's arrays (none in a snapshot without them) for a
        table of ``size`` slots and ``width`` mask words; raises ValueError when a code
        or count does not fit the table."""
        codes = state.get("copy_codes")
        extra = state.get("copy_extra")
        if codes is None or extra is None:
            return cls()
        check_array(codes, np.int64, codes.shape[:1], "copy_codes")
        check_array(extra, np.int64, codes.shape, "copy_extra")
        slot, mid, tier = _code_fields(codes)
        if codes.size and (
            int(slot.max()) >= size
            or int(mid.max()) >= 64 * width
            or int(tier.max()) >= len(TIERS)
            or int(extra.min()) < 1
            or int(codes.min()) < 0
        ):
            raise ValueError("extra copies do not fit the table")
        return cls(dict(zip(codes.tolist(), extra.tolist(), strict=True)))

    def check(self, masks: list[np.ndarray | None]) -> None:
        """Raise ValueError unless every record's member holds its slot in its tier."""
        if not self._extra:
            return
        slot, mid, tier = _code_fields(self._codes())
        for t in np.unique(tier).tolist():
            m, mine = masks[t], tier == t
            if m is None or not (m[slot[mine], mid[mine] >> 6] & _BIT[mid[mine] & 63]).all():
                raise ValueError("extra copies of blocks their member does not hold")

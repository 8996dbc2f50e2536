"""The table as plain arrays and back, for snapshot files.

Part of :class:`~kvindex.indexer.memory_table.BlockTable` (a mixin). With
:meth:`_State.to_state`, :meth:`_State.from_state` is the one place that enumerates the
table's storage, and the place that validates a snapshot's arrays before adopting them.
"""

from __future__ import annotations

from typing import Any, Self

import numpy as np

from kvindex.indexer.backend import TIERS, Tier
from kvindex.indexer.table_copies import _code_fields
from kvindex.indexer.table_layout import (
    _BIT,
    MAX_DISPLACEMENT,
    MIN_CAP,
    PAD,
    TableFull,
    _bit_counts,
    _Layout,
    _nonzero_rows,
)
from kvindex.indexer.table_members import _SlotLog


def _check(array: Any, dtype: type, shape: tuple[int, ...], name: str) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != shape:
        got = (getattr(array, "dtype", type(array).__name__), getattr(array, "shape", None))
        raise ValueError(f"table array {name}: expected {np.dtype(dtype)} {shape}, got {got}")


def _copies_from_state(state: dict[str, Any], size: int, width: int) -> dict[int, int]:
    """``BlockTable.copies`` from a snapshot's arrays (none in a snapshot without them);
    raises ValueError when a code or count does not fit the table."""
    codes = state.get("copy_codes")
    extra = state.get("copy_extra")
    if codes is None or extra is None:
        return {}
    _check(codes, np.int64, codes.shape[:1], "copy_codes")
    _check(extra, np.int64, codes.shape, "copy_extra")
    slot, mid, tier = _code_fields(codes)
    if codes.size and (
        int(slot.max()) >= size
        or int(mid.max()) >= 64 * width
        or int(tier.max()) >= len(TIERS)
        or int(extra.min()) < 1
        or int(codes.min()) < 0
    ):
        raise ValueError("extra copies do not fit the table")
    return dict(zip(codes.tolist(), extra.tolist(), strict=True))


class _State:
    """Snapshot (de)serialisation of one table."""

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
            "copy_codes": np.fromiter(self.copies, np.int64, len(self.copies)),
            "copy_extra": np.fromiter(self.copies.values(), np.int64, len(self.copies)),
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
        _check(keys, np.uint64, (size,), "keys")
        _check(counts, np.int64, (len(TIERS), 64 * width), "counts")
        _check(held, np.int64, (64 * width,), "held")
        for tier, m in enumerate(masks):
            if m is not None:
                _check(m, np.uint64, (size, width), f"masks[{tier}]")
        if masks[Tier.GPU] is None:
            raise ValueError("table has no GPU masks")
        stamps = state["stamps"]
        if stamps is not None:
            _check(stamps, np.uint32, (size,), "stamps")
        if stamped and stamps is None:
            stamps = np.zeros(size, np.uint32)
        elif not stamped:
            stamps = None
        members, sizes, slots = state["log_members"], state["log_sizes"], state["log_slots"]
        _check(slots, np.uint32, (int(sizes.sum()),), "log_slots")
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
        layout.copies = _copies_from_state(state, size, width)
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
        if self.copies:
            codes = np.fromiter(self.copies, np.int64, len(self.copies))
            slot, mid, tier = _code_fields(codes)
            for t in np.unique(tier).tolist():
                masks, mine = self.masks[t], tier == t
                if (
                    masks is None
                    or not (masks[slot[mine], mid[mine] >> 6] & _BIT[mid[mine] & 63]).all()
                ):
                    raise ValueError("extra copies of blocks their member does not hold")

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
from kvindex.indexer.table_layout import MIN_CAP, PAD, _Layout
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
        return table

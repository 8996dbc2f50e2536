"""The memory backend's data structure: one compact numpy hash table per model.

:class:`BlockTable` is assembled from one mixin per concern, each in its own module:

* ``table_layout``: constants, key conversion, the storage layout and its builders (read
  its docstring first: it explains the layout and why it is numpy);
* ``table_probe``: finding keys and placing new ones (windowed linear probing);
* ``table_update``: applying a batch of stores/removals/announcements (the ingest path);
* ``table_copies``: entries held in more than one physical block;
* ``table_members``: per-member reverse records, clearing and re-numbering members;
* ``table_query``: prefix matches and per-position presence (the lookup path);
* ``table_state``: the table as plain arrays for snapshot files, and back.

This module keeps what ties them together: construction, installing a layout, the size,
and planning rebuilds. The names other modules use are re-exported here.
"""

from __future__ import annotations

import numpy as np

from kvindex.indexer import compiled
from kvindex.indexer.backend import TIERS, BackendError
from kvindex.indexer.table_copies import (
    COPY_ENTRY_BYTES,
    MAX_MEMBERS,
    MEMBER_BITS,
    _code_fields,
    _Copies,
    _copy_codes,
)
from kvindex.indexer.table_layout import (
    _MULT,
    CHUNK_KEYS,
    DEAD_FRACTION,
    EVICT_FRACTION,
    MAX_DISPLACEMENT,
    MIN_CAP,
    PAD,
    REBUILD_LOAD,
    STAMP_MAX,
    WORD,
    NeedRoom,
    Ops,
    Slots,
    TableFull,
    U64s,
    Zeros,
    _empty_layout,
    _home,
    _Layout,
    _layout,
    _move_rows,
    _shift_for,
    as_keys,
)
from kvindex.indexer.table_members import _Members, _SlotLog
from kvindex.indexer.table_probe import _Probing
from kvindex.indexer.table_query import ChainMatch, _Queries, bit_positions
from kvindex.indexer.table_state import _State
from kvindex.indexer.table_update import ANNOUNCE, REMOVE, STORE, _Updates

__all__ = [
    "ANNOUNCE",
    "CHUNK_KEYS",
    "COPY_ENTRY_BYTES",
    "DEAD_FRACTION",
    "EVICT_FRACTION",
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
    "_home",
    "as_keys",
    "bit_positions",
]


class BlockTable(_Probing, _Updates, _Copies, _Members, _Queries, _State):
    """One model's keys and member bitmasks. Not thread-safe: the backend's lock guards it.

    Invariants: ``counts[t, m]`` is the number of slots whose tier-``t`` mask has bit
    ``m``; ``held[m]`` the number of slots where ``m`` has a bit in any tier; every such
    slot appears in ``logs[m]``; ``n_live`` counts slots with any bit set; ``n_used``
    counts occupied slots (live or dead); every key lies within ``max_disp`` slots after
    its home slot, with no empty slot in between; ``copies[code]`` (see
    :func:`_copy_codes`) is ``n - 1`` for each (slot, member, tier) held in ``n >= 2``
    copies, and there is no other entry (a held bit alone means one copy).

    State, all plain attributes: ``keys``, ``masks``, ``stamps`` (numpy arrays), the
    scalars ``cap``, ``width``, ``seed``, ``max_disp``, ``zero_used``, ``n_used``,
    ``n_live``, the per-member ``counts`` and ``held`` arrays, ``logs`` (member id ->
    reverse record, a ``uint32`` array) and ``copies`` (a dict of ints).
    """

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

    # -- storage -------------------------------------------------------------------------

    #: Allocator of keys and masks (see :data:`~kvindex.indexer.table_layout.Zeros`).
    zeros: Zeros = np.zeros

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
        """Switch to ``layout`` (from :meth:`plan_rebuild`, or empty)."""
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
        """Bytes of the arrays and reverse records, and an estimate for ``copies`` (a
        dict entry with its int key: about 100 bytes)."""
        arrays = [self.keys, self.stamps, *self.masks]
        return (
            sum(a.nbytes for a in arrays if a is not None)
            + sum(log.nbytes for log in self.logs.values())
            + COPY_ENTRY_BYTES * len(self.copies)
        )

    # -- rebuilds ----------------------------------------------------------------------------

    def dead_slots(self) -> int:
        return self.n_used - self.n_live

    @staticmethod
    def cap_for(live: int) -> int:
        """Smallest table where ``live`` keys fill at most ``REBUILD_LOAD`` of it."""
        cap = MIN_CAP
        while live > REBUILD_LOAD * cap:
            cap *= 2
        return cap

    def plan_rebuild(self, cap: int) -> _Layout:
        """This table's live slots re-inserted into a fresh table of at least ``cap``
        slots (vectorised), with the reverse records remapped; dead slots disappear.

        Only reads the table, so readers may keep reading it meanwhile; the writer must
        not change it before :meth:`install`. Raises BackendError when keys collide so
        badly that no sane size fits them.

        Compiled (``probe.relayout``): one pass over the old table, no temporary arrays,
        reverse records rebuilt exact.
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
        if self.copies:  # extra copies sit on live slots only: every one moves
            codes = np.fromiter(self.copies, np.int64, len(self.copies))
            slot, mid, tier = _code_fields(codes)
            moved_codes = _copy_codes(remap[slot], mid, 0)
            out.copies = {
                code | t: n
                for code, t, n in zip(moved_codes, tier.tolist(), self.copies.values(), strict=True)
            }
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
        out.logs = {mid: _SlotLog(np.frombuffer(slots, np.uint32)) for mid, slots in records}
        if self.copies:  # extra copies sit on live slots only: every one moves
            codes = np.fromiter(self.copies, np.int64, len(self.copies))
            slot, mid, tier = _code_fields(codes)
            keys = self.keys[slot]
            moved = np.empty(keys.size, np.intp)
            probe.find(
                out.keys, keys, int(self.seed), int(_shift_for(cap)), out.max_disp,
                MAX_DISPLACEMENT, cap + PAD, moved, None,
            )  # fmt: skip
            moved_codes = _copy_codes(moved, mid, 0)
            out.copies = {
                code | t: n
                for code, t, n in zip(moved_codes, tier.tolist(), self.copies.values(), strict=True)
            }
        return out

"""Finding keys in the table: home slots, windowed linear probing, and placing new keys.

Part of :class:`~kvindex.indexer.memory_table.BlockTable` (a mixin: it reads and writes
the table's ``keys``, ``seed``, ``shift``, ``max_disp``, ``zero_used``/``zero_slot`` and
``n_used``). The hot path of both ingest and lookups; see ``bench/bench_index.py``.
"""

from __future__ import annotations

import numpy as np

from kvindex.indexer import compiled
from kvindex.indexer.table_layout import (
    _OFFSETS,
    _WIDE_OFFSETS,
    LOOKUP_WINDOW,
    MAX_DISPLACEMENT,
    MAX_LOAD,
    WINDOW,
    Bools,
    NeedRoom,
    Slots,
    TableFull,
    U64s,
    _home,
    _nonzero_rows,
    _sorted_unique,
)


class _Probing:
    """Key -> slot: :meth:`find` for reads, :meth:`_locate` for writes (inserting)."""

    def _home(self, keys: U64s) -> Slots:
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
        exact. numpy: most keys sit in their home slot (about 3 in 4 at load 0.5), so
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
        home = self._home(keys)
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
        self._probe(keys[rest], far, slots, rest, cursors)
        return slots

    def _probe(
        self, keys: U64s, home: Slots, slots: Slots, todo: Slots, cursors: Slots | None
    ) -> None:
        """Fill ``slots[todo]`` for non-zero ``keys`` (``home`` their home slots, row for
        row) by reading windows from home, until each key is found, an empty slot proves
        it absent, or ``max_disp`` is passed. With ``cursors``, record for each absent
        key its first empty slot, where inserting it starts (raises TableFull when there is
        none within ``MAX_DISPLACEMENT``)."""
        offset = 0
        # Lookups read up to LOOKUP_WINDOW slots at once: one wide round is cheaper
        # than a second narrow one. Inserts mostly stop at a near empty slot.
        width = WINDOW if cursors is not None else min(LOOKUP_WINDOW, self.max_disp + 1)
        while todo.size and offset <= self.max_disp:
            m = todo.size
            pos = _WIDE_OFFSETS[:width] + (home + offset)  # (width, m): long axis inner
            window = self.keys[pos]
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
            empty = self.keys[_OFFSETS + (home + offset)] == 0
            done = empty.any(axis=0)
            cursors[todo[done]] = home[done] + offset + empty[:, done].argmax(axis=0)
            todo, home = todo[~done], home[~done]
            offset += WINDOW

    def _insert(self, keys: U64s, cursor: Slots) -> Slots:
        """Place keys known to be absent (repeats allowed), starting at ``cursor``, the
        first empty slot ``_find`` saw for each; return their slots. ``n_used`` is left
        to the caller, which counts distinct new slots.

        Keys probing the same empty slot all write it; the one whose write survived won
        it (with its repeats), the others continue after it. Raises TableFull past
        ``MAX_DISPLACEMENT`` (keys already placed are then dead slots, which the rebuild
        that follows drops).

        Compiled: the keys are placed one after another, which settles every race.
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
            rows = np.arange(keys.size)
        else:
            zero = keys == 0
            out[zero] = self.zero_slot
            self.zero_used = True
            rows = np.flatnonzero(~zero)
        if not rows.size:
            return out
        start = home = self._home(keys[rows])
        cand = cursor[rows]  # empty when found: the first round needs no probing
        mine = keys[rows]
        has_free = None
        if (cand - start).max() > MAX_DISPLACEMENT:
            raise TableFull
        while True:
            take = np.arange(rows.size) if has_free is None else np.flatnonzero(has_free)
            slots = cand[take]
            self.keys[slots] = mine[take]  # the last write to a slot wins it
            won = take[self.keys[slots] == mine[take]]
            out[rows[won]] = cand[won]
            if won.size == rows.size:
                break
            cursor = cand + 1 if has_free is None else np.where(has_free, cand + 1, cursor + WINDOW)
            left = np.ones(rows.size, np.bool_)
            left[won] = False
            rows, start, cursor, mine = rows[left], start[left], cursor[left], mine[left]
            free = self.keys[_OFFSETS + cursor] == 0
            has_free = free.any(axis=0)
            cand = cursor + free.argmax(axis=0)
            if not has_free.all():
                cand[~has_free] = -1
            if max((cand - start).max(), (cursor - start).max()) > MAX_DISPLACEMENT:
                raise TableFull
        placed = out if keys.all() else out[keys != 0]
        self.max_disp = max(self.max_disp, int((placed - home).max()))
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

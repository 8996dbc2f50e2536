"""Member ids of the memory backend: interning members to bit positions, releasing ids
nobody uses, and narrowing the masks when the members left fit in fewer words.

Part of :class:`~kvindex.indexer.memory.MemoryBackend` (a mixin: it reads and writes the
backend's ``_ids``, ``_names``, ``_free_ids``, ``_width`` and ``_tables``). Every change
here is structural for readers (a name moves, the masks change shape), so it runs with
the backend's read lock ``_lock`` held, on the writer's thread.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager

from kvindex.indexer.backend import BackendError
from kvindex.indexer.memory_table import MAX_MEMBERS, BlockTable


class _MemberIds:
    """Member name <-> bit position (id), lowest free id first."""

    _ids: dict[str, int]
    _names: list[str | None]
    _free_ids: list[int]
    _width: int
    _tables: dict[str, BlockTable]
    _lock: threading.Lock
    _structural: Callable[[], AbstractContextManager[None]]

    def _intern(self, member: str) -> int:
        """``member``'s id, given one when it has none (takes the read lock then: a
        new id may widen every table's masks)."""
        mid = self._ids.get(member)
        if mid is not None:
            return mid
        with self._structural():
            if self._free_ids:
                mid = heapq.heappop(self._free_ids)  # lowest first keeps the masks narrow
                self._names[mid] = member
            else:
                mid = len(self._names)
                if mid >= MAX_MEMBERS:
                    raise BackendError(f"more than {MAX_MEMBERS} members hold blocks at once")
                self._names.append(member)
                if mid >= 64 * self._width:
                    self._width += 1
                    for table in self._tables.values():
                        table.widen(self._width)
            self._ids[member] = mid
        return mid

    def _release(self, mid: int) -> bool:
        """Free the id of a member that holds nothing (read lock held)."""
        name = self._names[mid]
        if name is None:
            return False
        for table in self._tables.values():
            table.forget_member(mid)
        del self._ids[name]
        self._names[mid] = None
        heapq.heappush(self._free_ids, mid)
        return True

    def _compact_ids(self) -> None:
        """Narrow the bitmasks when the members left fit in half the words (read lock
        held). Members with ids past the new width move to free low ids (cost: their
        blocks); halving, not shrinking by a word, keeps a member count that swings
        around a word boundary from rebuilding masks back and forth."""
        names = self._names
        while names and names[-1] is None:
            names.pop()
        words = max(1, -(-len(self._ids) // 64))
        if 2 * words > self._width:
            self._free_ids = [i for i in self._free_ids if i < len(names)]
            heapq.heapify(self._free_ids)
            return
        limit = 64 * words
        free = (i for i in range(limit) if i >= len(names) or names[i] is None)
        for old in [mid for mid in self._ids.values() if mid >= limit]:
            new = next(free)
            for table in self._tables.values():
                table.move_member(old, new)
            name = names[old]
            assert name is not None
            if new >= len(names):
                names.extend([None] * (new + 1 - len(names)))
            names[new], names[old] = name, None
            self._ids[name] = new
        del names[limit:]
        while names and names[-1] is None:
            names.pop()
        self._free_ids = [i for i, n in enumerate(names) if n is None]
        heapq.heapify(self._free_ids)
        for table in self._tables.values():
            table.narrow(words)
        self._width = words

"""Sharing the memory backend's tables with other processes: where tables allocate their
keys and masks, and telling the shared index's writer of every structural change.

Part of :class:`~kvindex.indexer.memory.MemoryBackend` (a mixin over its locks, tables
and member names); :mod:`kvindex.indexer.shared_index` explains the protocol.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from kvindex.indexer.memory_table import BlockTable, Zeros
from kvindex.indexer.shared_index import Structure, table_ref

if TYPE_CHECKING:
    from kvindex.indexer.shared_index import SharedIndexWriter


class _Sharing:
    """The backend's side of :class:`~kvindex.indexer.shared_index.SharedIndexWriter`."""

    _writer: threading.Lock
    _step: threading.Lock
    _lock: threading.Lock
    _tables: dict[str, BlockTable]
    _names: list[str | None]
    _seed: int
    _width: int
    _zeros: Zeros
    _observer: SharedIndexWriter | None

    def share(self, observer: SharedIndexWriter) -> None:
        """Keep every table's keys and masks where ``observer.arrays`` allocates them
        (shared memory), and tell ``observer`` of every structural change from now on
        (:mod:`kvindex.indexer.shared_index` explains the protocol)."""
        with self._writer, self._step, self._lock:
            self._zeros = observer.arrays.zeros
            for table in self._tables.values():
                table.use_storage(self._zeros)
            self._observer = observer
            observer.begin()
            observer.end(self)

    @contextlib.contextmanager
    def _structural(self) -> Iterator[None]:
        """The read lock, for a structural change (writer only), published to the
        processes reading the tables from shared memory."""
        with self._lock:
            observer = self._observer
            if observer is None:
                yield
                return
            observer.begin()
            try:
                yield
            finally:
                observer.end(self)

    def _published(self) -> None:
        """Tell the readers of a structural change made in place meanwhile (a tier's first
        masks, allocated by an update): until then they read without that tier."""
        with self._structural():
            pass

    def structure(self, name_of: Callable[[np.ndarray], str]) -> Structure:
        """What a shared-memory reader needs besides the arrays (read lock held)."""
        return Structure(
            self._seed,
            self._width,
            list(self._names),
            {model: table_ref(t, name_of) for model, t in self._tables.items()},
        )

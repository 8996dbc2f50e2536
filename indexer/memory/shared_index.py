"""The memory backend's tables shared with other processes: one writer (the process that
ingests), any number of readers (``kvindex serve --processes N``'s serving workers).

Why: one Python process answers ``/score`` on one core. The answers need the whole
index, and ingesting every event in every process would multiply its CPU and memory,
so the writer's tables live in shared memory (:mod:`kvindex.indexer.memory.shared_arrays`)
and readers walk them in place with the same code as the writer's own lookups.
:class:`SharedIndexWriter` states the protocol and why it is sound.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvindex.indexer.backend import BackendError, IndexStats, MemberMatch, MemberPresence, Tier
from kvindex.indexer.memory.answer import longest, member_bits, member_mask
from kvindex.indexer.memory.shared_arrays import SharedArrays, attach
from kvindex.indexer.memory.table import BlockTable, as_keys

if TYPE_CHECKING:
    from kvindex.indexer.memory.backend import MemoryBackend

#: How long a reader waits for a structural change to finish before it gives up.
PATIENCE_S = 0.05
_CONTROL = "control"
_CONTROL_BYTES = 64
# The control file's 8-byte fields: the structure's generation, and two the service
# shares (api/serve/worker_pool.py): until when speculative entries live (time.monotonic(), one
# clock for every process of the machine) and the version of its published facts.
GENERATION, SPECULATIVE_UNTIL, FACTS_VERSION = 0, 1, 2


class SharedIndexBusy(BackendError):
    """The shared structure kept changing, or could not be read, for ``PATIENCE_S``."""


class ArrayRef(msgspec.Struct, array_like=True, frozen=True):
    name: str
    shape: tuple[int, ...]


class TableRef(msgspec.Struct, array_like=True, frozen=True):
    cap: int
    keys: ArrayRef
    masks: list[ArrayRef | None]  # per tier


class Structure(msgspec.Struct, frozen=True):
    """What a reader needs besides the arrays' contents."""

    seed: int
    width: int
    names: list[str | None]  # member id -> name
    tables: dict[str, TableRef]


_encode_structure = msgspec.msgpack.Encoder().encode
_decode_structure = msgspec.msgpack.Decoder(Structure).decode


class Control:
    """The control file: a few 8-byte fields every process maps."""

    def __init__(self, directory: str, create: bool) -> None:
        path = os.path.join(directory, _CONTROL)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, _CONTROL_BYTES)
            self._map = mmap.mmap(fd, _CONTROL_BYTES)
        finally:
            os.close(fd)
        self.words = np.frombuffer(self._map, np.uint64, 3)
        self.floats = np.frombuffer(self._map, np.float64, 3)

    def generation(self) -> int:
        return int(self.words[GENERATION])


def _structure_path(directory: str, generation: int) -> str:
    return os.path.join(directory, f"structure-{generation}")


class SharedIndexWriter:
    """Puts a memory backend's tables in shared memory and publishes their structure.

    ``directory`` is a new private directory under ``parent`` (``/dev/shm`` by default,
    tmpfs on Linux); :meth:`close` removes it with everything in it.

    The protocol, and why it is sound:

    * A table changes in two ways (the lock-free read rule in
      :class:`~kvindex.indexer.memory.backend.MemoryBackend`'s docstring): *in place* (keys
      fill empty slots, mask bits flip), which its own lock-free compiled lookups read
      word by word; and *structurally* (arrays replaced or reshaped, member ids given,
      freed or renumbered, tables added or dropped), under the backend's read lock. A
      reader elsewhere reads in place changes exactly as an in-process lookup does.
    * Around every structural change the writer moves a generation counter, seqlock
      style: odd while it changes (:meth:`begin`), then even once the new structure
      (array files, member names, seed, width) is written to a file named after that
      generation (:meth:`end`).
    * A reader reads the generation, maps that structure when it is new to it, walks,
      and reads the generation again; when it moved, the walk may have mixed two
      structures (a member name from before a renumbering, bits from after), so it
      walks again. An array the writer has dropped stays mapped in the reader until it
      maps the new structure, so a stale walk reads stale numbers, never freed memory.
    * A reader's table (:meth:`BlockTable.reader
      <kvindex.indexer.memory.table.BlockTable.reader>`) probes up to
      ``MAX_DISPLACEMENT`` slots from home, not knowing the writer's ``max_disp``.

    Readers give up after :data:`PATIENCE_S` of odd generations or vanished files and
    raise :class:`SharedIndexBusy`; the serving worker then hands the request to the
    writer's process, which answers from its own tables.
    """

    def __init__(self, backend: MemoryBackend, parent: str | None = None) -> None:
        self.directory = tempfile.mkdtemp(prefix="kvindex-", dir=parent or _default_parent())
        self.arrays = SharedArrays(self.directory)
        self.control = Control(self.directory, create=True)
        backend.share(self)  # moves the tables here, then calls begin() and end()

    def begin(self) -> None:
        """A structural change starts (the backend's read lock is held)."""
        self.control.words[GENERATION] += np.uint64(1)

    def end(self, backend: MemoryBackend) -> None:
        """The change is done: publish the structure, then make the generation even."""
        generation = self.control.generation() + 1
        structure = backend.structure(self.arrays.name_of)
        path = _structure_path(self.directory, generation)
        with open(path + ".tmp", "wb") as out:
            out.write(_encode_structure(structure))
        os.replace(path + ".tmp", path)
        self.control.words[GENERATION] = np.uint64(generation)
        with contextlib.suppress(FileNotFoundError):  # two back: a slow reader's target
            os.unlink(_structure_path(self.directory, generation - 4))

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _default_parent() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class _Mapped(msgspec.Struct):
    generation: int
    names: list[str | None]
    ids: dict[str, int]
    width: int
    tables: dict[str, BlockTable]  # readers (BlockTable.reader)


class SharedIndexReader:
    """An index backend that reads a :class:`SharedIndexWriter`'s tables from another
    process. Lookups and presence only: every write belongs to the writer's process."""

    never_waits = True  # a lookup is a walk in memory (api/service_parts.make_index_work)

    def __init__(self, directory: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.control = Control(directory, create=False)
        self._clock = clock
        self._mapped = _Mapped(-1, [], {}, 1, {})
        # arrays mapped for the current structure, kept for the next one: most structural
        # changes (a new member, a new table) leave the big arrays as they were
        self._attached: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    # -- the protocol ---------------------------------------------------------------

    def _current(self) -> _Mapped:
        """The structure of the current (even) generation, mapped."""
        give_up = self._clock() + PATIENCE_S
        pause = 20e-6
        while True:
            generation = self.control.generation()
            if generation == self._mapped.generation:
                return self._mapped
            if not generation & 1:
                try:
                    self._mapped = self._map(generation)
                    return self._mapped
                except (FileNotFoundError, ValueError, msgspec.DecodeError):
                    pass  # superseded while being read: read the newer one
            if self._clock() > give_up:
                raise SharedIndexBusy("the shared index is being restructured; try again")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def _map(self, generation: int) -> _Mapped:
        with open(_structure_path(self.directory, generation), "rb") as src:
            structure = _decode_structure(src.read())
        before, self._attached = self._attached, {}

        def attached(ref: ArrayRef) -> np.ndarray:
            key = (ref.name, ref.shape)
            array = before.get(key)
            if array is None:  # new since the last structure: map it
                array = attach(self.directory, ref.name, ref.shape, np.uint64)
            self._attached[key] = array
            return array

        tables = {
            model: BlockTable.reader(
                ref.cap,
                attached(ref.keys),
                [None if m is None else attached(m) for m in ref.masks],
                structure.seed,
                structure.width,
            )
            for model, ref in structure.tables.items()
        }
        ids = {name: mid for mid, name in enumerate(structure.names) if name is not None}
        return _Mapped(generation, structure.names, ids, structure.width, tables)

    def _read(self, reading: Any) -> Any:
        """``reading(mapped)`` until no structural change overlapped it."""
        give_up = self._clock() + PATIENCE_S
        while True:
            mapped = self._current()
            answer = reading(mapped)
            if self.control.generation() == mapped.generation:
                return answer
            if self._clock() > give_up:
                raise SharedIndexBusy("the shared index is being restructured; try again")

    # -- IndexBackend's reads -------------------------------------------------------

    def lookup(
        self, model: str, keys: Sequence[int], members: Collection[str] | None = None
    ) -> list[MemberMatch]:
        """:meth:`MemoryBackend.lookup <kvindex.indexer.memory.backend.MemoryBackend.lookup>`,
        from the shared tables."""

        def reading(mapped: _Mapped) -> list[MemberMatch]:
            table = mapped.tables.get(model)
            allowed = None if members is None else member_bits(mapped.ids, members)
            if table is None or not len(keys) or allowed == 0:
                as_keys(keys)  # nothing to look up: the keys are still checked
                return []
            chain = keys if type(keys) is list else as_keys(keys)
            return longest(table, chain, allowed, mapped.names)  # type: ignore[arg-type]

        return self._read(reading)  # type: ignore[no-any-return]

    def presence(
        self, model: str, keys: Sequence[int], members: Collection[str] | None = None
    ) -> list[MemberPresence]:
        wanted = as_keys(keys)

        def reading(mapped: _Mapped) -> list[MemberPresence]:
            table = mapped.tables.get(model)
            if table is None or not wanted.size:
                return []
            allowed = None
            if members is not None:
                allowed = member_mask(mapped.ids, mapped.width, members)
                if allowed is None:
                    return []
            found = table.presence(wanted, allowed)
            names = mapped.names
            return [MemberPresence(names[mid], tuple(masks)) for mid, masks in found.items()]  # type: ignore[arg-type]

        out: list[MemberPresence] = self._read(reading)
        out.sort(key=lambda p: p.member)
        return out

    def members(self) -> list[str]:
        return sorted(self._current().ids)

    def models(self) -> list[str]:
        return sorted(self._current().tables)

    def ping(self) -> None:
        self._current()

    def close(self) -> None:
        self._mapped = _Mapped(-1, [], {}, 1, {})
        self._attached = {}

    # -- the writer's process answers the rest (counters live there) -----------------

    def apply(self, changes: Sequence[Any]) -> None:
        raise BackendError("a shared-index reader does not ingest")

    def clear_member(self, member: str) -> int:
        raise BackendError("a shared-index reader does not ingest")

    def stats(self) -> IndexStats:
        raise BackendError("index figures are kept by the process that ingests")

    def member_stats(self, member: str) -> None:
        raise BackendError("index figures are kept by the process that ingests")

    def member_keys(self, member: str, model: str, tier: Tier | None = None) -> list[int]:
        raise BackendError("index figures are kept by the process that ingests")


def table_ref(table: BlockTable, name_of: Callable[[np.ndarray], str]) -> TableRef:
    """``table``'s arrays by their shared file names (``name_of``: array -> name)."""
    return TableRef(
        table.cap,
        ArrayRef(name_of(table.keys), table.keys.shape),
        [None if m is None else ArrayRef(name_of(m), m.shape) for m in table.masks],
    )

"""The in-process backend (the embedded default): block keys -> members, per model.

:class:`MemoryBackend` owns one :class:`~kvindex.indexer.memory.table.BlockTable` per
model, the member names and their bit positions, the locks, and the capacity bound. It
runs a call's changes as vectorised steps (planned in :mod:`kvindex.indexer.memory.plan`)
and answers lookups (decoded in :mod:`kvindex.indexer.memory.answer`) and stats.
"""

from __future__ import annotations

import contextlib
import heapq
import secrets
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvindex.events.wire.identity import MAX_MEMBER_CHARS, MAX_MODEL_CHARS
from kvindex.indexer import compiled
from kvindex.indexer.backend import (
    TIERS,
    BackendError,
    Change,
    IndexStats,
    MemberMatch,
    MemberPresence,
    MemberStats,
    Tier,
)
from kvindex.indexer.memory.answer import longest, member_bits, member_mask
from kvindex.indexer.memory.plan import NO_KEYS, Clear, Group, plan
from kvindex.indexer.memory.shared_index import Structure, table_ref
from kvindex.indexer.memory.table import (
    DEAD_FRACTION,
    EVICT_FRACTION,
    MAX_MEMBERS,
    MIN_CAP,
    REMOVE,
    STAMP_MAX,
    WORD,
    BlockTable,
    NeedRoom,
    Ops,
    Slots,
    TableFull,
    U64s,
    Zeros,
    as_keys,
)

if TYPE_CHECKING:
    from kvindex.indexer.memory.shared_index import SharedIndexWriter


def _gil_guards_walks() -> bool:
    """Whether the GIL is on, as the lock-free read rule needs (see MemoryBackend).
    Builds without ``sys._is_gil_enabled`` (before 3.13) always have it."""
    gil_enabled = getattr(sys, "_is_gil_enabled", None)
    return gil_enabled is None or bool(gil_enabled())


class MemoryBackend:
    """The block index in this process's memory.

    Batching: ``apply`` gathers the STORE/REMOVE changes of a call, across members, into
    one vectorised update per (model, tier), in steps of about ``CHUNK_KEYS`` keys. That
    keeps every order that matters: per (key, member, tier) the last operation wins,
    which is exactly what applying the changes one by one gives; a CLEAR is a step of
    its own, so nothing moves across it. numpy's cost is mostly per operation, so a big
    call costs little more than a small one.

    Costs: ``lookup`` is one compiled call (``BlockTable.walk``; the numpy path probes
    the chain once, vectorised, and decodes a few change rows); ``clear_member`` and
    ``member_keys`` cost time proportional to that member's blocks (a per-member
    reverse record, never a scan); ``stats``, ``member_stats`` and ``members`` time
    proportional to members and models.

    Capacity: with ``capacity_blocks`` set, when distinct live (model, key) pairs exceed
    it after a step, the least recently *stored* keys (a store by any member to any tier
    refreshes a key; lookups do not) are evicted for every member and tier at once,
    down to ``capacity_blocks - capacity_blocks // 10``. Keys stored in the same step
    share a stamp and are evicted in no particular order among themselves.
    ``IndexStats.evictions`` counts evicted keys.

    Thread safety: any number of reader threads and writers (serialised among
    themselves by ``_writer``; the ingest path has one). Two more locks, taken in this
    order when both are:

    * ``_step``: held by the writer while it applies a step (about ``CHUNK_KEYS``
      keys), and by the readers of counters and records (``stats``, ``member_stats``,
      ``member_keys``), which so see whole steps.
    * ``_lock``, the read lock: held by every reader, and by the writer only for
      *structural* changes: installing a rebuilt table, a new member id (which may widen
      the masks), releasing or renumbering ids, dropping an emptied table.

    The lock-free read rule: a compiled ``lookup`` takes the read lock only, so it does
    not wait for a step. It may see part of one (a key placed but its bit not yet set
    reads as not held; a block moving tiers may read as held in neither for that
    instant), as it may see a call's effect step by step, and every answer is still one
    the table gave at some moment, member by member. That holds because

    1. a step changes a table in place and only so: it fills empty key slots (keys never
       move, nor leave a gap between home and slot), sets and clears mask bits, and
       raises ``max_disp`` after placing keys; anything else (arrays replaced or
       reshaped, ids renumbered, tables added or dropped) is structural, under ``_lock``;
    2. the walk reads each mask word once, and holds the GIL, so it sees the writer
       between two of its Python operations, or inside a numpy loop that released the
       GIL, word by word.

    Where the GIL is off (free-threaded CPython), point 2 does not hold: such a backend
    makes compiled lookups take both locks, as the numpy path always does, and so see
    whole steps. The numpy path and ``presence`` read the masks in several passes, so
    they take both locks. ``tests/test_memory_concurrency.py`` checks the rule with
    readers racing a writer; the shared index (:mod:`kvindex.indexer.memory.shared_index`)
    relies on point 1 across processes. The O(table) work (rebuilding a table that
    grows or has too many dead slots, choosing keys to evict) runs outside both locks,
    reading a table no one else changes, and is swapped in with both held.

    Member ids (bit positions) are reused once a member holds nothing (lowest first),
    and when the members left fit in half the mask words, those with high ids move to
    free low ones and every table's masks narrow: the bitmask width, and the memory it
    costs, follow the number of members holding blocks at once, not every member ever
    seen. Every id change is structural, so it runs with ``_lock`` held.
    """

    def __init__(
        self,
        capacity_blocks: int | None = None,
        *,
        hash_seed: int | None = None,
        expected_keys: int | None = None,
    ):
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError("capacity_blocks must be positive (or None for unbounded)")
        if expected_keys is not None and expected_keys < 0:
            raise ValueError("expected_keys must be >= 0 (or None)")
        self._capacity = capacity_blocks
        # A sizing hint: a model's table starts where this many keys need no growth (it
        # still grows past them). Growing from empty rebuilds the table once per
        # doubling, each into fresh memory.
        self._initial_cap = BlockTable.cap_for(expected_keys or 0)
        self._seed = secrets.randbits(64) if hash_seed is None else hash_seed & (2**64 - 1)
        self._writer = threading.Lock()  # one writer at a time
        self._step = threading.Lock()  # the writer's steps; readers of counters
        self._lock = threading.Lock()  # lookups; the writer's structural changes
        self._tables: dict[str, BlockTable] = {}
        self._ids: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free_ids: list[int] = []
        self._width = 1
        self._tick = 0
        self._evictions = 0
        self._zeros: Zeros = np.zeros  # where tables allocate keys and masks
        self._observer: SharedIndexWriter | None = None  # told of structural changes
        # The lock-free read rule needs the GIL (class docstring); decided once, since a
        # GIL that is on at start stays on.
        self._walks_alone = _gil_guards_walks()

    #: Lookups are walks in memory: /score runs them on the event loop (api/http/offload.py).
    never_waits = True

    # -- writes ------------------------------------------------------------------------------

    def apply(self, changes: Sequence[Change]) -> None:
        """Apply changes in order (see the class docstring for how they are batched).

        Every change is validated before any is applied: an unknown op, a STORE/REMOVE
        without a tier, or a key outside ``[0, 2**64)`` raises ValueError and applies
        nothing from this call.
        """
        steps = plan(changes)
        with self._writer:
            for step in steps:
                if isinstance(step, Clear):
                    self._run_clear(step)
                else:
                    self._run_groups(step)

    def _run_clear(self, step: Clear) -> None:
        with self._step:
            mid = self._ids.get(step.member)
            if mid is None:
                return
            self._clear(mid, TIERS if step.tier is None else (step.tier,))
        self._maintain({mid})

    def _run_groups(self, groups: dict[tuple[str, Tier], Group]) -> None:
        pending = list(groups.items())
        pending.reverse()  # popped from the end, in order
        touched: set[int] = set()
        first = True
        while pending:
            with self._step:
                if first:  # one stamp per step
                    self._tick, first = self._next_tick(), False
                grow = self._apply_groups(pending, touched)
            if grow is not None:  # rebuilt outside the locks: readers keep reading
                self._rebuild(*grow)
        self._maintain(touched)

    def _apply_groups(
        self, pending: list[tuple[tuple[str, Tier], Group]], touched: set[int]
    ) -> tuple[BlockTable, int] | None:
        """Apply groups from the end of ``pending``, each as one vectorised update,
        adding the member ids to ``touched``. Stops at a group whose table must grow
        first, and returns that table and the size it needs."""
        while pending:
            (model, tier), group = pending[-1]
            table = self._tables.get(model)
            op = group.op_codes()
            if table is None and not (isinstance(op, int) and op == REMOVE):
                table = BlockTable(
                    self._width,
                    seed=self._seed,
                    stamped=self._capacity is not None,
                    cap=self._initial_cap,
                    zeros=self._zeros,
                )
                with self._structural():  # one dict store: seen whole or not at all
                    self._tables[model] = table
            if table is not None:
                keys, mid, op = self._member_ids(group, op, touched)
                try:
                    if keys.size:
                        first_in_tier = table.masks[tier] is None
                        table.update(tier, keys, mid, op, self._tick)
                        if first_in_tier and table.masks[tier] is not None:
                            self._published()  # the tier's masks: a new array
                except NeedRoom as room:
                    return table, table.cap_for(table.n_live + room.need)
                except TableFull:
                    return table, max(2 * table.cap, table.cap_for(table.n_live))
            pending.pop()
        return None

    def _rebuild(self, table: BlockTable, cap: int) -> None:
        """Rebuild ``table`` (writer only): built without the locks, swapped in with both."""
        layout = table.plan_rebuild(cap)
        with self._step, self._structural():
            table.install(layout)

    def _member_ids(
        self, group: Group, op: int | Ops, touched: set[int]
    ) -> tuple[U64s, int | Slots, int | Ops]:
        """The group's keys, member id per key and op per key (scalars when uniform),
        adding the ids to ``touched``. Stores and announcements intern their member;
        removes by members that hold nothing are dropped."""
        ids = self._ids
        mids = [
            self._intern(m) if o != REMOVE else ids.get(m, -1)
            for m, o in zip(group.members, group.ops, strict=True)
        ]
        touched.update(mids)
        touched.discard(-1)
        keys, first = group.keys, mids[0]
        if all(m == first for m in mids):
            return (keys, first, op) if first >= 0 else (NO_KEYS, first, op)
        mid = np.repeat(np.array(mids, np.intp), group.sizes)
        if first < 0 or min(mids) < 0:
            known = mid >= 0
            keys, mid = keys[known], mid[known]
            if not isinstance(op, int):
                op = op[known]
        return keys, mid, op

    def _clear(self, mid: int, tiers: Collection[Tier]) -> int:
        return sum(table.clear_member(mid, tiers) for table in self._tables.values())

    def _maintain(self, touched: set[int]) -> None:
        """After a step (writer only): enforce the capacity, drop emptied tables,
        reclaim dead slots, release members that hold nothing."""
        if self._capacity is not None and self._live_keys() > self._capacity:
            chosen = self._plan_eviction(self._capacity)  # a scan: without the locks
            with self._step:  # in place: bits cleared
                for table, slots in chosen:
                    table.drop_slots(slots)
                    self._evictions += slots.size
            touched = set(self._ids.values())
        with self._step:
            tables = self._tables
            # nobody holds anything there: its records are stale
            empty = [model for model, table in tables.items() if not table.n_live]
            idle = [mid for mid in touched if not any(t.held[mid] for t in tables.values())]
            if empty or idle:  # structural: readers wait for this
                with self._structural():
                    for model in empty:
                        del tables[model]
                    released = [self._release(mid) for mid in idle]
                    if any(released):
                        self._compact_ids()
            dead = [
                t
                for t in self._tables.values()
                if t.dead_slots() > max(DEAD_FRACTION * t.cap, MIN_CAP // 4)
            ]
        for table in dead:
            self._rebuild(table, table.cap_for(table.n_live))

    def clear_member(self, member: str) -> int:
        """Drop everything ``member`` holds; return the (block, tier) entries dropped (a
        block held in two tiers counts twice). Cost: the member's reverse records."""
        with self._writer:
            with self._step:
                mid = self._ids.get(member)
                if mid is None:
                    return 0
                dropped = self._clear(mid, TIERS)
            self._maintain({mid})
            return dropped

    # -- member ids: name <-> bit position, lowest free id first ----------------------------

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

    # -- capacity ----------------------------------------------------------------------------

    def _live_keys(self) -> int:
        return sum(t.n_live for t in self._tables.values())

    def _plan_eviction(self, capacity: int) -> list[tuple[BlockTable, Slots]]:
        """The least recently stored live slots to evict, per table, to bring the live
        keys down to ``capacity`` minus ``EVICT_FRACTION`` of it. Only reads."""
        tables = list(self._tables.values())
        live = [t.live_slots() for t in tables]
        stamps = np.concatenate([t.stamps_of(s) for t, s in zip(tables, live, strict=True)])
        excess = stamps.size - (capacity - max(1, int(capacity * EVICT_FRACTION)))
        if excess <= 0:
            return []
        chosen = np.zeros(stamps.size, np.bool_)
        if excess >= stamps.size:
            chosen[:] = True
        else:
            chosen[np.argpartition(stamps, excess - 1)[:excess]] = True
        out = []
        offset = 0
        for table, slots in zip(tables, live, strict=True):
            mine = chosen[offset : offset + slots.size]
            offset += slots.size
            if mine.any():
                out.append((table, slots[mine]))
        return out

    def _next_tick(self) -> int:
        """Stamp for this step; on overflow, halve every stamp (keeps their order)."""
        if self._tick >= STAMP_MAX:
            for t in self._tables.values():
                if t.stamps is not None:
                    t.stamps >>= 1
            self._tick >>= 1
        return self._tick + 1

    # -- snapshots ---------------------------------------------------------------------------

    def to_state(self) -> dict[str, Any]:
        """Everything this index holds, as arrays (copies) and scalars, for a snapshot.

        Waits for the writer (so a step is never half in it) but not for readers; the
        arrays are copied under the writer lock, so writes resume as soon as they are.
        """
        with self._writer:
            return {
                "seed": self._seed,
                "names": list(self._names),
                "width": self._width,
                "tick": self._tick,
                "evictions": self._evictions,
                "tables": {model: t.to_state() for model, t in self._tables.items()},
            }

    def from_state(self, state: dict[str, Any]) -> None:
        """Replace this index's content with :meth:`to_state`'s output (the capacity
        bound stays this backend's own, and is applied at once). Raises ValueError,
        leaving the index as it was, when the state does not fit together."""
        names = state["names"]
        width = int(state["width"])
        if not all(n is None or isinstance(n, str) for n in names) or len(names) > 64 * width:
            raise ValueError("member names do not fit the mask width")
        if any(n is not None and not 0 < len(n) <= MAX_MEMBER_CHARS for n in names):
            raise ValueError(f"a member name is empty or over {MAX_MEMBER_CHARS} characters")
        ids = {name: mid for mid, name in enumerate(names) if name is not None}
        if len(ids) != sum(n is not None for n in names):
            raise ValueError("a member name appears twice")
        if not 0 <= int(state["tick"]) <= STAMP_MAX or int(state["evictions"]) < 0:
            raise ValueError("the stamp clock or the eviction count is out of range")
        unnamed = np.ones(64 * width, np.bool_)
        unnamed[list(ids.values())] = False
        stamped = self._capacity is not None
        tables = {}
        for model, table_state in state["tables"].items():
            if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_CHARS:
                raise ValueError(f"a model name is empty or over {MAX_MODEL_CHARS} characters")
            table = BlockTable.from_state(table_state, stamped=stamped)
            if table.width != width or int(table.seed) != int(state["seed"]) & WORD:
                raise ValueError(f"table of model {model!r} does not match the index")
            if table.held[unnamed].any():  # a lookup would answer a member with no name
                raise ValueError(f"table of model {model!r} has blocks of unnamed members")
            tables[model] = table
        if self._zeros is not np.zeros:  # shared with other processes
            for table in tables.values():
                table.use_storage(self._zeros)
        with self._writer:
            with self._step, self._structural():
                self._seed = int(state["seed"]) & WORD
                self._tables = tables
                self._names = list(names)
                self._ids = ids
                self._free_ids = [mid for mid, name in enumerate(names) if name is None]
                heapq.heapify(self._free_ids)
                self._width = width
                self._tick = int(state["tick"])
                self._evictions = int(state["evictions"])
            self._maintain(set(ids.values()))

    # -- sharing the tables with other processes (shared_index.py) ------------------------

    def share(self, observer: SharedIndexWriter) -> None:
        """Keep every table's keys and masks where ``observer.arrays`` allocates them
        (shared memory), and tell ``observer`` of every structural change from now on
        (:mod:`kvindex.indexer.memory.shared_index` explains the protocol)."""
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

    # -- reads -----------------------------------------------------------------------------------

    def lookup(
        self, model: str, keys: Sequence[int], members: Collection[str] | None = None
    ) -> list[MemberMatch]:
        """Each member's longest consecutive prefix of ``keys`` held in any tier, best
        first: most blocks, then most GPU blocks, then member name. Members with no
        match (and, with ``members``, members not listed) are left out. Bad keys raise
        ValueError, whatever the model."""
        fast = compiled.probe is not None
        # The compiled walk reads a list of ints itself, without a conversion.
        chain = keys if fast and type(keys) is list else as_keys(keys)
        # The lock-free read rule (class docstring): a compiled walk need not wait for a
        # step; the numpy path reads the masks in several passes, so it waits.
        with self._lock if fast and self._walks_alone else self._both():
            table = self._tables.get(model)
            allowed = None if members is None else member_bits(self._ids, members)
            if table is not None and len(chain) and allowed != 0:
                return longest(table, chain, allowed, self._names)
        as_keys(chain)  # nothing to look up: the keys are still checked
        return []

    def presence(
        self, model: str, keys: Sequence[int], members: Collection[str] | None = None
    ) -> list[MemberPresence]:
        """Per member, which positions of ``keys`` it holds in each tier (see
        :meth:`IndexBackend.presence`); one vectorised probe of every key."""
        wanted = as_keys(keys)
        with self._both():  # several numpy passes over the masks: whole steps only
            target = self._read_target(model, wanted, members)
            if target is None:
                return []
            table, allowed = target
            found = table.presence(wanted, allowed)
            names = self._names
            out = [MemberPresence(names[mid], tuple(masks)) for mid, masks in found.items()]  # type: ignore[arg-type]
        out.sort(key=lambda p: p.member)
        return out

    @contextlib.contextmanager
    def _both(self) -> Iterator[None]:
        """The step lock, then the read lock (the writer's order)."""
        with self._step, self._lock:
            yield

    def _read_target(
        self, model: str, keys: U64s, members: Collection[str] | None
    ) -> tuple[BlockTable, np.ndarray | np.uint64 | None] | None:
        """The model's table and the member filter for a read (lock held), or None when
        the answer is empty: no such model, no keys, or none of ``members`` holds
        anything. The filter is None when every member counts."""
        table = self._tables.get(model)
        if table is None or not keys.size:
            return None
        if members is None:
            return table, None
        allowed = member_mask(self._ids, self._width, members)
        return None if allowed is None else (table, allowed)

    def member_stats(self, member: str) -> MemberStats | None:
        with self._step:  # whole steps: counters and records agree
            mid = self._ids.get(member)
            if mid is None:
                return None
            stats = MemberStats(member)
            for model, table in self._tables.items():
                per_tier = {t: int(table.counts[t, mid]) for t in TIERS if table.counts[t, mid]}
                if per_tier:
                    stats.blocks[model] = per_tier
            return stats if stats.blocks else None

    def member_keys(self, member: str, model: str, tier: Tier | None = None) -> list[int]:
        """Every key ``member`` holds for ``model`` (in ``tier``, or in any tier), sorted.
        Costs time proportional to that member's blocks in that model."""
        with self._step:  # whole steps: counters and records agree
            mid = self._ids.get(member)
            table = self._tables.get(model)
            if mid is None or table is None:
                return []
            return table.member_keys(mid, tier)

    def members(self) -> list[str]:
        with self._lock:
            return sorted(self._ids)

    def models(self) -> list[str]:
        with self._lock:
            return sorted(self._tables)

    def stats(self) -> IndexStats:
        with self._step:  # whole steps: counters and records agree
            tables = self._tables.values()
            blocks = {t: sum(int(tb.counts[t].sum()) for tb in tables) for t in TIERS}
            return IndexStats(
                members=len(self._ids),
                blocks=blocks,
                keys=self._live_keys(),
                evictions=self._evictions,
                capacity=self._capacity,
                extra={
                    "models": len(self._tables),
                    "table_slots": sum(t.keys.size for t in tables),
                    "dead_slots": sum(t.dead_slots() for t in tables),
                    "max_probe": max((t.max_disp for t in tables), default=0),
                    "rebuilds": sum(t.rebuilds for t in tables),
                    "mask_words": self._width,
                    "bytes": sum(t.nbytes for t in tables),
                },
            )

    def ping(self) -> None:
        """The memory backend is always reachable."""

    def close(self) -> None:
        """Drop all data; the backend stays usable (as an empty index)."""
        with self._writer, self._step, self._structural():
            self._tables.clear()
            self._ids.clear()
            self._names.clear()
            self._free_ids.clear()
            self._width = 1

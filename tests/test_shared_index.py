"""The memory backend's tables read from another process (``indexer/memory/shared_index.py``):
a reader in a real second process answers what the writer's own lookups answer, through
every structural change, and never attributes blocks to the wrong member while the
writer restructures under it.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvindex.indexer import compiled
from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.shared_index import (
    GENERATION,
    SharedIndexBusy,
    SharedIndexReader,
    SharedIndexWriter,
)

MODEL = "m"
# every test's pods: loopback addresses only
POD = "127.0.0.{}:{}".format


def _pod(n: int) -> str:
    return POD(n % 200 + 1, 8000 + n)


def _reader_loop(directory: str, numpy_path: bool, conn: Any) -> None:
    """The second process: answer (method, args) requests with a SharedIndexReader."""
    if numpy_path:
        compiled.probe = None
    reader = SharedIndexReader(directory)
    while True:
        request = conn.recv()
        if request is None:
            return
        method, args = request
        try:
            conn.send(("ok", getattr(reader, method)(*args)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class OtherProcess:
    """A SharedIndexReader in a spawned process, asked over a pipe."""

    def __init__(self, directory: str, numpy_path: bool) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._process = context.Process(
            target=_reader_loop, args=(directory, numpy_path, theirs), daemon=True
        )
        self._process.start()

    def ask(self, method: str, *args: Any) -> Any:
        status, value = self.try_ask(method, *args)
        assert status == "ok", value
        return value

    def try_ask(self, method: str, *args: Any) -> tuple[str, Any]:
        """("ok", the answer) or ("error", what it raised)."""
        self._conn.send((method, args))
        if not self._conn.poll(30):
            raise AssertionError("the reader process did not answer within 30 s")
        return self._conn.recv()  # type: ignore[no-any-return]

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(10)


@pytest.fixture(params=["compiled", "numpy"])
def shared(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[MemoryBackend, SharedIndexWriter, OtherProcess]]:
    numpy_path = request.param == "numpy"
    if not numpy_path and compiled.probe is None:
        pytest.skip("no compiled table in this build")
    saved = compiled.probe
    if numpy_path:
        compiled.probe = None
    backend = MemoryBackend(hash_seed=7)
    writer = SharedIndexWriter(backend)
    other = OtherProcess(writer.directory, numpy_path)
    try:
        yield backend, writer, other
    finally:
        other.close()
        writer.close()
        compiled.probe = saved


def _same(
    backend: MemoryBackend, other: OtherProcess, chain: list[int], members: Any = None
) -> None:
    assert other.ask("lookup", MODEL, chain, members) == backend.lookup(MODEL, chain, members)
    assert other.ask("presence", MODEL, chain, members) == backend.presence(MODEL, chain, members)


def test_a_reader_in_another_process_answers_as_the_writer_through_every_structural_change(
    shared: tuple[MemoryBackend, SharedIndexWriter, OtherProcess],
) -> None:
    backend, _writer, other = shared
    rng = random.Random(3)
    chains = [[rng.getrandbits(64) for _ in range(rng.randint(4, 48))] for _ in range(150)]
    holders: dict[int, str] = {}

    def check() -> None:
        for _ in range(4):
            chain = rng.choice(chains)
            cut = chain[: rng.randint(1, len(chain))]
            _same(backend, other, cut)
            _same(
                backend, other, cut, sorted(rng.sample(sorted(set(holders.values()) or {"x"}), 1))
            )

    # 1: members past 64 (the masks widen to two words), the CPU tier's first blocks
    for n, chain in enumerate(chains[:120]):
        tier = Tier.CPU if n % 7 == 0 else Tier.GPU
        holders[n] = _pod(n)
        backend.apply([Change(Op.STORE, _pod(n), MODEL, tier, chain[: rng.randint(1, len(chain))])])
        if n % 10 == 0:
            check()
    assert backend.stats().extra["mask_words"] == 2
    check()
    # 2: growth rebuilds (fresh keys until the table has doubled several times)
    before = backend.stats().extra["rebuilds"]
    for _ in range(300):
        backend.apply(
            [Change(Op.STORE, _pod(200), MODEL, Tier.GPU, [rng.getrandbits(64) for _ in range(64)])]
        )
    assert backend.stats().extra["rebuilds"] > before
    check()
    # 3: members cleared (ids freed, masks narrowed, members renumbered), then new ones
    #    taking the freed ids, and removals that leave dead slots
    for n in range(0, 120, 2):
        backend.clear_member(_pod(n))
        holders.pop(n)
    backend.clear_member(_pod(200))
    assert backend.stats().extra["mask_words"] == 1
    check()
    for n in range(130, 150):
        holders[n] = _pod(n)
        backend.apply([Change(Op.STORE, _pod(n), MODEL, Tier.GPU, chains[n])])
    for n in range(1, 60, 2):
        backend.apply(
            [Change(Op.REMOVE, _pod(n), MODEL, Tier.GPU, chains[n][len(chains[n]) // 2 :])]
        )
    check()
    # 4: the model's table dropped when nobody holds anything, then made again
    for member in backend.members():
        backend.clear_member(member)
    assert other.ask("models") == [] and other.ask("lookup", MODEL, chains[3], None) == []
    backend.apply([Change(Op.STORE, _pod(1), MODEL, Tier.GPU, chains[1])])
    _same(backend, other, chains[1])
    # 5: a snapshot restored into the shared backend
    state = backend.to_state()
    backend.from_state(state)
    _same(backend, other, chains[1])
    assert other.ask("members") == backend.members()


def test_dropped_arrays_leave_shared_memory_and_close_removes_everything() -> None:
    backend = MemoryBackend(hash_seed=1)
    writer = SharedIndexWriter(backend)
    rng = random.Random(1)
    for _ in range(200):
        backend.apply(
            [Change(Op.STORE, _pod(1), MODEL, Tier.GPU, [rng.getrandbits(64) for _ in range(64)])]
        )
    arrays = [n for n in os.listdir(writer.directory) if n.startswith("a")]
    assert len(arrays) == 2  # the current table's keys and GPU masks; older ones are gone
    assert backend.stats().extra["rebuilds"] >= 3
    writer.close()
    assert not os.path.exists(writer.directory)


def test_a_reader_gives_up_on_a_structure_that_stays_mid_change() -> None:
    backend = MemoryBackend(hash_seed=1)
    writer = SharedIndexWriter(backend)
    try:
        backend.apply([Change(Op.STORE, _pod(1), MODEL, Tier.GPU, [1, 2, 3])])
        reader = SharedIndexReader(writer.directory)
        assert reader.lookup(MODEL, [1, 2, 3])[0].matched_blocks == 3
        writer.begin()  # a writer that died, or hangs, in the middle of a change
        backend.apply([Change(Op.STORE, _pod(2), MODEL, Tier.GPU, [1, 2])])
        with pytest.raises(SharedIndexBusy):
            reader.lookup(MODEL, [1, 2, 3])
    finally:
        writer.close()


def _churn(backend: MemoryBackend, stop: threading.Event, seed: int) -> None:
    """Members come and go (ids given, freed, reused, renumbered; masks widen and
    narrow), and tables grow, as fast as the writer can."""
    rng = random.Random(seed)
    n = 0
    while not stop.is_set():
        n += 1
        batch = [
            Change(
                Op.STORE,
                _pod(1000 + rng.randrange(150)),
                MODEL,
                Tier.GPU,
                [rng.getrandbits(64) for _ in range(8)],
            )
            for _ in range(16)
        ]
        backend.apply(batch)
        if n % 3 == 0:
            for member in rng.sample(backend.members(), 20):
                if member.endswith(tuple(f":{9000 + i}" for i in range(8))):
                    continue
                backend.clear_member(member)


def test_stable_members_read_exact_while_the_writer_restructures_under_the_reader(
    shared: tuple[MemoryBackend, SharedIndexWriter, OtherProcess],
) -> None:
    backend, writer, other = shared
    rng = random.Random(5)
    stable = {f"127.0.0.250:{9000 + i}": [rng.getrandbits(64) for _ in range(40)] for i in range(8)}
    for i, (member, chain) in enumerate(stable.items()):
        backend.apply([Change(Op.STORE, member, MODEL, Tier.GPU, chain[: 5 * (i + 1)])])
    stop = threading.Event()
    writer_thread = threading.Thread(target=_churn, args=(backend, stop, 9), daemon=True)
    writer_thread.start()
    generations = set()
    answered = busy = 0
    try:
        # Reads until the structure changed under them 10 times and 50 were answered;
        # the deadline only bounds a writer that never gets the CPU.
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and (answered < 50 or len(generations) <= 10):
            i = rng.randrange(8)
            member, chain = list(stable.items())[i]
            status, found = other.try_ask("lookup", MODEL, chain, None)
            generations.add(int(writer.control.words[GENERATION]))
            if status != "ok":  # it may give up (the server then asks the writer) ...
                assert found.startswith("SharedIndexBusy"), found
                busy += 1
                continue
            # ... but what it answers is exact: the stable member's prefix, and nobody
            # else holds any of its keys (a stale name would show another member here)
            by_member = {m.member: m.matched_blocks for m in found}
            assert by_member == {member: 5 * (i + 1)}, (member, found)
            answered += 1
    finally:
        stop.set()
        writer_thread.join(10)
    assert len(generations) > 10  # the structure really changed while it was read
    print(f"answered {answered}, gave up {busy}, generations seen {len(generations)}")
    assert answered > busy, (answered, busy)


def test_the_writer_lock_order_holds_under_sharing() -> None:
    """Structural changes from the writer's steps (a new table, a tier's first masks, a
    new member) publish without deadlocking against lookups in this process."""
    backend = MemoryBackend(hash_seed=2)
    writer = SharedIndexWriter(backend)
    try:
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                backend.lookup(MODEL, [1, 2, 3])

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        for n in range(200):
            backend.apply([Change(Op.STORE, _pod(n), f"model-{n % 3}", Tier(n % 3), [1, 2, 3, n])])
        stop.set()
        reader.join(10)
        assert not reader.is_alive()
        view = SharedIndexReader(writer.directory)
        assert view.models() == ["model-0", "model-1", "model-2"]
        assert view.lookup("model-0", [1, 2, 3], None) == backend.lookup("model-0", [1, 2, 3])
    finally:
        writer.close()


def test_a_table_keeps_its_keys_in_the_allocator_it_was_given() -> None:
    backend = MemoryBackend(hash_seed=3)
    backend.apply([Change(Op.STORE, _pod(1), MODEL, Tier.GPU, [5, 6])])
    writer = SharedIndexWriter(backend)  # an index with content, shared afterwards
    try:
        table = backend._tables[MODEL]
        assert writer.arrays.name_of(table.keys)
        assert writer.arrays.name_of(table.masks[Tier.GPU])
        assert isinstance(table.keys, np.ndarray)
        assert (
            SharedIndexReader(writer.directory).lookup(MODEL, [5, 6], None)[0].matched_blocks == 2
        )
    finally:
        writer.close()


def test_a_walk_that_overlapped_a_structural_change_is_walked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race the generation check exists for: a member's id is freed and given to
    another member while a reader walks with the names it mapped before. Walked once, the
    new member's blocks read as the old member's; the reader must notice and walk again."""
    import kvindex.indexer.memory.shared_index as shared_index

    backend = MemoryBackend(hash_seed=4)
    writer = SharedIndexWriter(backend)
    try:
        old, new = _pod(1), _pod(2)
        backend.apply([Change(Op.STORE, old, MODEL, Tier.GPU, [11, 12])])
        backend.apply([Change(Op.STORE, _pod(3), MODEL, Tier.GPU, [31])])  # keeps the table
        reader = SharedIndexReader(writer.directory)
        assert reader.members() == sorted([old, _pod(3)])  # mapped: old has id 0
        walks = []
        real_longest = shared_index.longest

        def racing(table: Any, chain: Any, allowed: Any, names: Any) -> Any:
            if not walks:  # the writer restructures while this first walk runs
                backend.clear_member(old)  # id 0 freed ...
                backend.apply([Change(Op.STORE, new, MODEL, Tier.GPU, [21, 22, 23])])  # ... reused
            walks.append(list(names))
            return real_longest(table, chain, allowed, names)

        monkeypatch.setattr(shared_index, "longest", racing)
        found = reader.lookup(MODEL, [21, 22, 23])
        assert [(m.member, m.matched_blocks) for m in found] == [(new, 3)]
        assert len(walks) == 2 and walks[0][0] == old and walks[1][0] == new
    finally:
        writer.close()


def test_a_full_shared_memory_is_a_clear_error_not_a_crash(tmp_path: Any) -> None:
    """An array the directory cannot hold fails where it is allocated, with what to do,
    instead of a SIGBUS at some later write (files are capped here with RLIMIT_FSIZE, in
    a process of its own)."""
    import subprocess
    import sys

    script = (
        "import resource, signal, numpy as np\n"
        "from kvindex.indexer.memory.shared_arrays import SharedArrays, SharedMemoryFull\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))\n"
        f"arrays = SharedArrays({str(tmp_path)!r})\n"
        "small = arrays.zeros((1000,), np.uint64)\n"
        "try:\n"
        "    arrays.zeros((1 << 20,), np.uint64)\n"
        "except SharedMemoryFull as exc:\n"
        "    print('refused:', exc)\n"
        f"import os; print('left:', sorted(os.listdir({str(tmp_path)!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "refused: cannot hold 8,388,608 bytes" in done.stdout
    assert "--processes 1" in done.stdout
    assert "left: ['a0']" in done.stdout  # the refused file is not left behind

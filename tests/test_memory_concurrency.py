"""The memory backend's lock-free read rule (``MemoryBackend``'s docstring), tested.

A writer thread grows and shrinks nested prefixes of one chain while reader threads look
it up. The writer keeps an order every moment of the table obeys: ranked members hold
prefixes whose lengths never increase with rank (stores go rank by rank, each prefix in
chain order; removals go last rank first, each from the end), and the ranked members'
ids always share one mask word. Meanwhile filler members come and go, so member ids are
given, freed and renumbered and the masks widen and narrow, and background keys grow
the table and leave dead slots, so it is rebuilt: the structural changes a lock-free
walk must never see half done. Every answer must be one the table had at some moment:
lengths in rank order, no member that does not hold the chain.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator

import pytest

from kvindex.indexer import compiled
from kvindex.indexer.backend import Change, MemberMatch, Op, Tier
from kvindex.indexer.memory.backend import MemoryBackend

M = "model-a"
CHAIN = 96
PIECE = 8
RANKED = [f"10.0.0.{i}:8000" for i in range(1, 6)]
FILLERS = [f"10.1.0.{i}:8000" for i in range(1, 71)]  # with RANKED: two mask words
ROUNDS = 4
READERS = 2
MAX_LOOKUPS = 20_000  # per reader: bounds the test when the writer is slow to start
JOIN_S = 120


def store(member: str, keys: list[int]) -> list[Change]:
    return [Change(Op.STORE, member, M, Tier.GPU, keys)]


def remove(member: str, keys: list[int]) -> list[Change]:
    return [Change(Op.REMOVE, member, M, Tier.GPU, keys)]


def write(backend: MemoryBackend, chain: list[int], rng: random.Random) -> None:
    """ROUNDS rounds of: fillers arrive with fresh background keys (growth, new ids,
    wider masks), ranked prefixes grow, fillers leave (freed ids, renumbering, narrower
    masks, dead slots), ranked prefixes shrink."""
    for _ in range(ROUNDS):
        backend.apply(
            [
                c
                for member in FILLERS
                for c in store(member, [rng.getrandbits(64) for _ in range(40)])
            ]
        )
        for end in range(PIECE, CHAIN + 1, PIECE):
            for member in RANKED:  # rank by rank: a lower rank never holds more
                backend.apply(store(member, chain[end - PIECE : end]))
        for member in FILLERS:
            backend.clear_member(member)
        for end in range(CHAIN, 0, -PIECE):
            for member in reversed(RANKED):  # last rank first
                backend.apply(remove(member, chain[end - PIECE : end]))


def check(answer: list[MemberMatch], ranks: list[str]) -> None:
    lengths = {m.member: m.matched_blocks for m in answer}
    assert set(lengths) <= set(ranks), f"members that never held the chain: {answer}"
    for m in answer:
        assert 0 < m.matched_blocks <= CHAIN and m.by_tier == (m.matched_blocks, 0, 0), answer
    ranked = [lengths.get(member, 0) for member in ranks]
    assert ranked == sorted(ranked, reverse=True), f"prefix lengths out of rank order: {answer}"


@pytest.fixture(autouse=True)
def often_switching_threads() -> Iterator[None]:
    """Threads switch every few bytecodes instead of every few milliseconds, so the
    readers also run between the writer's Python steps, not only while it is in C."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def race(backend: MemoryBackend) -> int:
    """Run the writer beside READERS readers; return the lookups they made."""
    rng = random.Random(7)
    chain = [rng.getrandbits(64) for _ in range(CHAIN)]
    # The ranked members are interned together, after the fillers, so their ids share a
    # mask word whatever renumbering does to them (they move together).
    backend.apply([c for member in FILLERS for c in store(member, [rng.getrandbits(64)])])
    backend.apply([c for member in RANKED for c in store(member, chain[:1])])
    errors: list[BaseException] = []
    lookups = [0] * READERS
    done = threading.Event()

    def writer() -> None:
        try:
            write(backend, chain, random.Random(8))
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            done.set()

    def reader(index: int) -> None:
        try:
            while not done.is_set() and lookups[index] < MAX_LOOKUPS:
                check(backend.lookup(M, chain), RANKED)
                check(backend.lookup(M, chain, members=RANKED[:3] + FILLERS[:3]), RANKED[:3])
                lookups[index] += 2
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(READERS)]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in time"
    if errors:
        raise errors[0]
    assert backend.stats().extra["rebuilds"] > 0  # the race included table rebuilds
    return sum(lookups)


@pytest.mark.skipif(compiled.probe is None, reason="kvindex.indexer.memory._probe was not built")
def test_lock_free_compiled_lookups_see_only_moments_the_table_had() -> None:
    backend = MemoryBackend(hash_seed=3)
    assert backend._walks_alone  # this build has a GIL: the walks take the read lock only
    assert race(backend) > 0


def test_locked_numpy_lookups_see_only_whole_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled, "probe", None)
    assert race(MemoryBackend(hash_seed=3)) > 0


@pytest.mark.skipif(compiled.probe is None, reason="kvindex.indexer.memory._probe was not built")
def test_without_the_gil_compiled_lookups_wait_for_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Free-threaded CPython: the rule needs the GIL, so lookups take the step lock."""
    chain = list(range(1, 17))
    gil = MemoryBackend(hash_seed=3)
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    no_gil = MemoryBackend(hash_seed=3)
    for backend in (gil, no_gil):
        backend.apply(store(RANKED[0], chain))
    answers: dict[str, list[MemberMatch]] = {}

    def look(name: str, backend: MemoryBackend) -> None:
        answers[name] = backend.lookup(M, chain)

    for name, backend in (("gil", gil), ("no gil", no_gil)):
        with backend._step:  # as the writer holds it while it applies a step
            reader = threading.Thread(target=look, args=(name, backend))
            reader.start()
            reader.join(0.5 if name == "no gil" else JOIN_S)
            waited = reader.is_alive()
        reader.join(JOIN_S)
        assert waited == (name == "no gil"), name
        assert answers[name] == [MemberMatch(RANKED[0], 16, (16, 0, 0))]

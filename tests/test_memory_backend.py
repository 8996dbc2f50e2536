"""MemoryBackend beyond the shared contract: capacity eviction, table growth and
rebuilds, dead slots, member id reuse, probing past the first window, threads."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from kvindex.indexer import compiled
from kvindex.indexer.backend import BackendError, Change, MemberMatch, Op, Tier
from kvindex.indexer.memory import table as memory_table
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.table import CHUNK_KEYS, MIN_CAP, PAD

M = "model-a"
A, B = "127.10.0.1:8000", "127.10.0.2:8000"
GPU, CPU, STORAGE = Tier.GPU, Tier.CPU, Tier.STORAGE
SEED = 12345
_MULT = int(memory_table._MULT)  # white-box: tests craft keys that collide on purpose
_MULT_INV = pow(_MULT, -1, 2**64)


def store(member: str, keys, tier: Tier = GPU, model: str = M) -> Change:
    return Change(Op.STORE, member, model, tier, keys)


def remove(member: str, keys, tier: Tier = GPU, model: str = M) -> Change:
    return Change(Op.REMOVE, member, model, tier, keys)


def announce(member: str, keys, tier: Tier = GPU, model: str = M) -> Change:
    return Change(Op.ANNOUNCE, member, model, tier, keys)


def matches(backend: MemoryBackend, keys: list[int]) -> dict[str, tuple]:
    return {m.member: (m.matched_blocks, m.by_tier) for m in backend.lookup(M, keys)}


def keys_with_mix(mixed: list[int]) -> list[int]:
    """Keys whose seeded multiplicative mix (see memory_table._home) is exactly ``mixed``: the
    home slot in a table of 2**b slots is then ``mixed >> (64 - b)``."""
    return [((x * _MULT_INV) % 2**64) ^ SEED for x in mixed]


def slots_in_table(cap: int) -> int:
    return cap + PAD + 1


# -- capacity ------------------------------------------------------------------------------


def test_capacity_evicts_the_least_recently_stored_keys() -> None:
    backend = MemoryBackend(capacity_blocks=10)
    for key in range(1, 11):
        backend.apply([store(A, [key])])
    assert backend.stats().keys == 10
    assert backend.stats().evictions == 0
    backend.apply([store(B, [11])])  # 11 > 10: evict down to 9, the two oldest
    stats = backend.stats()
    assert (stats.keys, stats.evictions, stats.capacity) == (9, 2, 10)
    assert backend.lookup(M, [1]) == [] and backend.lookup(M, [2]) == []
    assert backend.lookup(M, [3]) == [MemberMatch(A, 1, (1, 0, 0))]
    # Storing refreshes a key, whoever stores it; a lookup does not.
    backend.apply([store(B, [3])])
    backend.lookup(M, [4])
    backend.apply([store(A, [12])])
    backend.apply([store(A, [13])])  # 11 keys again: 4 and 5 are now the oldest
    held = {k for k in range(1, 14) if backend.lookup(M, [k])}
    assert held == {3, *range(6, 14)}
    assert backend.stats().evictions == 4


def test_eviction_drops_every_member_tier_and_model_of_a_key() -> None:
    backend = MemoryBackend(capacity_blocks=4)
    backend.apply([store(A, [1]), store(B, [1], CPU)])
    backend.apply([store(B, [2], STORAGE, model="m2")])
    for key in (2, 3, 4):
        backend.apply([store(A, [key])])
    # 5 live (model, key) pairs > 4: the two oldest, (M, 1) and (m2, 2), go
    stats = backend.stats()
    assert (stats.keys, stats.evictions) == (3, 2)
    assert stats.blocks == {GPU: 3, CPU: 0, STORAGE: 0}
    assert backend.lookup(M, [1]) == [] and backend.lookup("m2", [2]) == []
    assert backend.lookup(M, [2, 3, 4]) == [MemberMatch(A, 3, (3, 0, 0))]
    assert backend.members() == [A]  # B held only evicted keys
    assert backend.member_stats(B) is None


def test_eviction_order_survives_stamp_overflow() -> None:
    backend = MemoryBackend(capacity_blocks=10)
    backend._tick = 2**32 - 4  # white-box: four chunks before the uint32 stamp wraps
    for key in range(1, 12):  # the counter overflows half-way; stamps are halved
        backend.apply([store(A, [key])])
    old, new = set(range(1, 6)), set(range(6, 12))
    held = {k for k in range(1, 12) if backend.lookup(M, [k])}
    assert new <= held and len(old - held) == 2


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        MemoryBackend(capacity_blocks=0)


# -- table growth, rebuilds, dead slots ------------------------------------------------------


def test_growth_keeps_everything() -> None:
    backend = MemoryBackend()
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 2**64 - 1, 60_000, dtype=np.uint64, endpoint=True)
    # one call larger than a chunk, then growth one small call at a time
    backend.apply([store(A, keys[:40_000]), store(B, keys[20_000:40_000], CPU)])
    for start in range(40_000, 60_000, 2_000):
        backend.apply([store(A, keys[start : start + 2_000].tolist())])
    stats = backend.stats()
    assert stats.keys == 60_000
    assert stats.blocks == {GPU: 60_000, CPU: 20_000, STORAGE: 0}
    assert stats.extra["rebuilds"] >= 2
    assert stats.extra["table_slots"] >= slots_in_table(131_072)
    assert backend.lookup(M, keys) == [MemberMatch(A, 60_000, (60_000, 0, 0))]
    assert backend.lookup(M, keys[20_000:]) == [
        MemberMatch(A, 40_000, (40_000, 0, 0)),
        MemberMatch(B, 20_000, (0, 20_000, 0)),
    ]
    assert backend.clear_member(B) == 20_000
    assert backend.clear_member(A) == 60_000
    assert backend.stats().keys == 0


def test_dead_slots_are_revived_then_reclaimed() -> None:
    backend = MemoryBackend()
    keys = list(range(1, 5001))
    backend.apply([store(A, keys)])
    big = backend.stats().extra["table_slots"]
    backend.apply([remove(A, keys[:50])])
    assert backend.stats().extra["dead_slots"] == 50  # kept in place...
    backend.apply([store(B, keys[:50])])
    assert backend.stats().extra["dead_slots"] == 0  # ... and revived by a store
    assert backend.lookup(M, keys[:3]) == [MemberMatch(B, 3, (3, 0, 0))]
    backend.apply([remove(A, keys[50:4900]), remove(B, keys[:50])])
    stats = backend.stats()
    # past a quarter of the table dead: rebuilt from live slots, here into a smaller table
    assert stats.extra["dead_slots"] == 0
    assert stats.extra["table_slots"] == slots_in_table(MIN_CAP) < big
    assert stats.keys == 100
    assert backend.lookup(M, keys[4900:]) == [MemberMatch(A, 100, (100, 0, 0))]
    assert backend.member_stats(A).total() == 100  # type: ignore[union-attr]


def test_an_emptied_model_frees_its_table() -> None:
    backend = MemoryBackend()
    backend.apply([store(A, [1, 2], model="m1"), store(A, [1], model="m2")])
    assert backend.stats().extra["models"] == 2
    backend.apply([remove(A, [1], model="m2")])
    assert backend.stats().extra["models"] == 1
    assert backend.lookup("m1", [1, 2]) == [MemberMatch(A, 2, (2, 0, 0))]


def test_colliding_keys_probe_past_the_first_window() -> None:
    backend = MemoryBackend(hash_seed=SEED)
    # 40 keys with one home slot (in a table of MIN_CAP slots), plus key 0
    same_home = keys_with_mix([(77 << 54) | (i + 1) for i in range(41)])
    stored, absent = same_home[:40], same_home[40]
    backend.apply([store(A, [*stored[:20], 0, *stored[20:]])])
    assert backend.stats().extra["max_probe"] >= 39
    assert backend.stats().extra["table_slots"] == slots_in_table(MIN_CAP)
    chain = [*stored[:20], 0, *stored[20:]]
    assert backend.lookup(M, chain) == [MemberMatch(A, 41, (41, 0, 0))]
    assert backend.lookup(M, [absent]) == []
    backend.apply([remove(A, stored[30:31]), store(B, [absent])])
    assert backend.lookup(M, chain) == [MemberMatch(A, 31, (31, 0, 0))]
    assert backend.lookup(M, [absent]) == [MemberMatch(B, 1, (1, 0, 0))]


def test_key_zero_when_its_home_slot_is_taken() -> None:
    """Key 0 marks empty slots, so it lives in a reserved slot; probing must never take
    an empty slot for it, stored or not."""
    backend = MemoryBackend(hash_seed=SEED)
    zero_home = ((SEED * _MULT) % 2**64) >> 54  # where key 0 would sit in MIN_CAP slots
    crowd = keys_with_mix([(zero_home << 54) | (i + 1) for i in range(12)])
    backend.apply([store(A, crowd)])
    assert backend.lookup(M, [0]) == []
    assert backend.lookup(M, [*crowd, 0, *crowd]) == [MemberMatch(A, 12, (12, 0, 0))]
    assert backend.lookup(M, [0, *crowd]) == []
    backend.apply([store(B, [0, *crowd[:3]])])
    assert backend.lookup(M, [0, *crowd]) == [MemberMatch(B, 4, (4, 0, 0))]
    backend.apply([remove(B, [0])])
    assert backend.lookup(M, [0, *crowd]) == []
    assert backend.stats().keys == 12


def test_probing_runs_past_the_last_home_slot_without_wrapping() -> None:
    backend = MemoryBackend(hash_seed=SEED)
    last = MIN_CAP - 1
    crowd = keys_with_mix([(last << 54) | (i + 1) for i in range(300)])
    backend.apply([store(A, crowd[:150])])
    backend.apply([store(A, [0, *crowd[150:]])])
    stats = backend.stats()
    assert stats.extra["table_slots"] == slots_in_table(MIN_CAP)
    assert stats.extra["max_probe"] == 299
    assert backend.lookup(M, [*crowd, 0]) == [MemberMatch(A, 301, (301, 0, 0))]
    backend.apply([remove(A, crowd[::2])])
    assert backend.lookup(M, crowd[1::2]) == [MemberMatch(A, 150, (150, 0, 0))]
    assert backend.stats().keys == 151


def test_a_cluster_too_long_grows_the_table() -> None:
    backend = MemoryBackend(hash_seed=SEED)
    # 520 keys with homes 100..107 at MIN_CAP: the last lands more than PAD - WINDOW
    # slots from home. Twice or four times the size spreads their homes enough.
    rng = random.Random(5)
    crowd = keys_with_mix([((100 + i % 8) << 54) | rng.getrandbits(54) for i in range(520)])
    backend.apply([store(A, crowd)])
    stats = backend.stats()
    assert stats.extra["table_slots"] > slots_in_table(MIN_CAP)
    assert stats.extra["max_probe"] <= PAD - 8
    assert stats.keys == 520
    assert backend.lookup(M, crowd) == [MemberMatch(A, 520, (520, 0, 0))]


def test_pathological_keys_raise_and_leave_the_index_intact() -> None:
    backend = MemoryBackend(hash_seed=SEED)
    backend.apply([store(A, [1, 2, 3])])
    crowd = keys_with_mix([(5 << 54) | i for i in range(600)])  # one home at any size
    with pytest.raises(BackendError):
        backend.apply([store(B, crowd)])
    assert backend.lookup(M, [1, 2, 3]) == [MemberMatch(A, 3, (3, 0, 0))]
    assert backend.stats().blocks[GPU] == 3
    backend.apply([store(B, [4])])
    assert backend.lookup(M, [1, 2, 3, 4], members=[B]) == []
    assert backend.lookup(M, [4]) == [MemberMatch(B, 1, (1, 0, 0))]


# -- members ---------------------------------------------------------------------------------


def test_member_ids_are_reused_without_stale_bits() -> None:
    backend = MemoryBackend()
    backend.apply([store(f"pod-{i}:1", [i]) for i in range(64)])
    assert backend.stats().extra["mask_words"] == 1
    backend.clear_member("pod-5:1")
    backend.apply([remove("pod-6:1", [6])])  # holds nothing now: released too
    backend.apply([store("new-a:1", [1000]), store("new-b:1", [1001])])
    assert backend.stats().extra["mask_words"] == 1  # took the ids of pod-5 and pod-6
    assert backend.lookup(M, [5]) == [] and backend.lookup(M, [6]) == []
    assert backend.lookup(M, [1000]) == [MemberMatch("new-a:1", 1, (1, 0, 0))]
    backend.apply([store("one-more:1", [2000])])
    assert backend.stats().extra["mask_words"] == 2
    assert backend.stats().members == 65


def test_member_slots_are_reused_and_masks_narrow_when_members_go() -> None:
    """Thousands of one-block members come and go (a flood of short-lived streams):
    their ids are reused and the masks narrow back, so memory returns; survivors that
    held high ids move, keeping their blocks, tiers and copies."""
    backend = MemoryBackend()
    backend.apply([store("keeper-a:1", [1, 2]), store("keeper-a:1", [2])])
    for wave in range(3):
        pods = [f"127.19.{wave}.{i}:8000" for i in range(2000)]
        backend.apply([store(pod, [10_000 + i]) for i, pod in enumerate(pods)])
        if wave == 0:  # a survivor with a high id, in two tiers, with a second copy
            backend.apply([store("keeper-b:1", [1, 2, 3]), store("keeper-b:1", [3], CPU)])
            backend.apply([store("keeper-b:1", [3])])
        assert backend.stats().extra["mask_words"] >= 2000 // 64
        for pod in pods[::2]:
            backend.clear_member(pod)
        backend.apply([remove(pod, [10_000 + i]) for i, pod in enumerate(pods) if i % 2])
        stats = backend.stats()
        assert stats.members == 2 and stats.extra["mask_words"] == 1
        assert len(backend._names) <= 64  # white-box: no id past the one mask word
    assert matches(backend, [1, 2, 3]) == {
        "keeper-b:1": (3, (3, 0, 0)),
        "keeper-a:1": (2, (2, 0, 0)),
    }
    backend.apply([remove("keeper-b:1", [3]), remove("keeper-a:1", [2])])  # copies moved too
    assert backend.member_keys("keeper-b:1", M) == [1, 2, 3]
    assert backend.member_keys("keeper-b:1", M, CPU) == [3]
    assert backend.member_keys("keeper-a:1", M) == [1, 2]
    assert backend.lookup(M, [10_001]) == []
    assert backend.stats().extra["bytes"] < 200_000


def test_reverse_records_stay_bounded() -> None:
    """Store/remove cycles append to a member's record; compaction keeps it near the
    member's live blocks, so clear_member cost follows what the member holds."""
    backend = MemoryBackend()
    backend.apply([store(B, [10**6])])  # keeps the table alive
    survivors: list[int] = []
    for i in range(200):
        keys = list(range(i * 300, i * 300 + 300))
        backend.apply([store(A, keys)])
        backend.apply([remove(A, keys[:-5] + survivors)])
        survivors = keys[-5:]
    log = backend._tables[M].logs[backend._ids[A]]  # white-box
    assert log.n < 1000  # not 200 * 300
    assert backend.clear_member(A) == 5  # each round removed the previous round's last 5


def test_keys_of_a_huge_change_are_applied_in_chunks_in_order() -> None:
    backend = MemoryBackend()
    keys = np.arange(1, 3 * CHUNK_KEYS + 2, dtype=np.uint64)
    backend.apply([store(A, keys), remove(A, keys[CHUNK_KEYS:]), store(A, keys[-1:])])
    assert backend.lookup(M, keys) == [MemberMatch(A, CHUNK_KEYS, (CHUNK_KEYS, 0, 0))]
    assert backend.stats().blocks[GPU] == CHUNK_KEYS + 1


def test_close_empties_the_index() -> None:
    backend = MemoryBackend()
    backend.apply([store(A, [1])])
    backend.close()
    assert backend.lookup(M, [1]) == [] and backend.members() == []
    backend.apply([store(A, [1])])
    assert backend.lookup(M, [1]) == [MemberMatch(A, 1, (1, 0, 0))]


# -- threads ---------------------------------------------------------------------------------


def test_readers_during_writes_see_whole_changes() -> None:
    """One writer, three readers. Each write call is smaller than a chunk, so readers
    see it entirely or not at all: member A always holds a prefix it was given."""
    backend = MemoryBackend()
    rng = random.Random(1)
    chain = [rng.getrandbits(64) for _ in range(256)]
    lengths = [1 + (i * 37) % 256 for i in range(300)]
    backend.apply([store(A, chain[: lengths[0]]), store(B, chain)])
    done = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        # ANNOUNCE, not STORE: each write says what is held (one copy), whatever before
        try:
            for i, n in enumerate(lengths):
                backend.apply([announce(A, chain[:n]), remove(A, chain[n:])])
                tier = CPU if i % 2 else STORAGE
                backend.apply(
                    [announce(B, chain[: n // 2], tier), remove(B, chain[n // 2 :], tier)]
                )
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    def read() -> None:
        try:
            for _ in range(5000):
                found = {m.member: m for m in backend.lookup(M, chain)}
                assert set(found) == {A, B}
                assert found[A].matched_blocks in lengths
                assert found[A].by_tier == (found[A].matched_blocks, 0, 0)
                assert found[B].matched_blocks == 256
                assert sum(found[B].by_tier) == 256 and found[B].by_tier[0] == 256
                stats = backend.stats()
                assert stats.members == 2 and stats.keys == 256
                if done.is_set():
                    return
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[0]
    assert backend.lookup(M, chain, members=[A]) == [
        MemberMatch(A, lengths[-1], (lengths[-1], 0, 0))
    ]


def test_readers_during_growth_and_rebuilds() -> None:
    """Rebuilds are built outside the lock and swapped in: readers never see a table
    half moved. B churns through fresh keys (growth, dead-slot rebuilds) while A's
    chain must always read whole."""
    backend = MemoryBackend()
    rng = np.random.default_rng(4)
    chain = rng.integers(1, 2**64 - 1, 300, dtype=np.uint64)
    backend.apply([store(A, chain)])
    done = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            previous = None
            for _ in range(40):
                fresh = rng.integers(1, 2**64 - 1, 3000, dtype=np.uint64)
                changes = [store(B, fresh)]
                if previous is not None:
                    changes.append(remove(B, previous))
                backend.apply(changes)
                previous = fresh
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    def read() -> None:
        try:
            while not done.is_set():
                assert backend.lookup(M, chain, members=[A]) == [MemberMatch(A, 300, (300, 0, 0))]
                assert backend.member_stats(A).total() == 300  # type: ignore[union-attr]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[0]
    stats = backend.stats()
    assert stats.extra["rebuilds"] >= 3
    assert stats.keys == 300 + 3000


@pytest.mark.skipif(compiled.probe is None, reason="the compiled walk was not built")
def test_a_compiled_lookup_does_not_wait_for_a_writers_step() -> None:
    """The writer holds ``_step`` while it applies a step; a compiled lookup takes only
    the read lock, so it answers meanwhile (the numpy path waits: it reads the masks in
    several passes)."""
    backend = MemoryBackend()
    backend.apply([store(A, [1, 2, 3])])
    answers: list[list[MemberMatch]] = []
    with backend._step:  # a writer in the middle of a step
        reader = threading.Thread(target=lambda: answers.append(backend.lookup(M, [1, 2, 3])))
        reader.start()
        reader.join(timeout=30)
        finished = not reader.is_alive()
    reader.join(timeout=30)
    assert finished
    assert answers == [[MemberMatch(A, 3, (3, 0, 0))]]


def test_lookups_beside_large_steps_read_only_states_between_before_and_after() -> None:
    """Steps of thousands of keys, where numpy releases the GIL mid-write, and tier moves
    (B's blocks from GPU to CPU and back, A's prefix stored and removed): a lookup that
    reads a step half done still answers sanely: known members only, A's prefix within
    what it held before and after, tier counts adding up, B's prefix whole (it holds
    every block in one tier or the other at every step boundary, so at worst it reads
    shorter while a block moves)."""
    backend = MemoryBackend()
    rng = np.random.default_rng(8)
    chain = rng.integers(1, 2**64 - 1, 3000, dtype=np.uint64)
    backend.apply([store(B, chain)])
    done = threading.Event()
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for i in range(30):
                backend.apply([store(A, chain)] if i % 2 == 0 else [remove(A, chain)])
                src, dst = (GPU, CPU) if i % 2 == 0 else (CPU, GPU)
                backend.apply([store(B, chain, dst), remove(B, chain, src)])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    def read() -> None:
        keys = chain.tolist()
        try:
            while not done.is_set():
                for found in backend.lookup(M, keys):
                    assert found.member in (A, B)
                    assert 0 < found.matched_blocks <= 3000
                    assert sum(found.by_tier) == found.matched_blocks
                    assert min(found.by_tier) >= 0
                    if found.member == A:
                        assert found.by_tier[0] == found.matched_blocks
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert backend.lookup(M, chain) == [MemberMatch(B, 3000, (3000, 0, 0))]

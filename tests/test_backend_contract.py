"""The IndexBackend contract, one suite for every backend.

To add a backend, add a factory to ``BACKENDS``: it takes the pytest request and returns
a fresh, empty backend (register cleanup with ``request.addfinalizer``, e.g. deleting a
Redis key prefix unique to the call). The ``make_backend`` fixture closes whatever it
made. Every test here must pass unchanged for every backend.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.indexer.backend import (
    TIERS,
    Change,
    IndexBackend,
    MemberMatch,
    MemberStats,
    Op,
    Tier,
)
from kvindex.indexer.memory.backend import MemoryBackend
from tests.redis_fixtures import cluster_backend_factory, redis_backend_factory

BackendFactory = Callable[[pytest.FixtureRequest], IndexBackend]

BACKENDS: dict[str, BackendFactory] = {
    "memory": lambda request: MemoryBackend(),
}

# Redis: the shared test server (KVTEST_REDIS_URL) and a 3-master cluster the
# session starts on loopback ports (tests/redis_fixtures.py).
BACKENDS["redis"] = redis_backend_factory
BACKENDS["redis-cluster"] = cluster_backend_factory


@pytest.fixture(params=sorted(BACKENDS))
def make_backend(request: pytest.FixtureRequest) -> Iterator[Callable[[], IndexBackend]]:
    """A function returning a fresh, empty backend of the parametrised kind."""
    made: list[IndexBackend] = []

    def make() -> IndexBackend:
        backend = BACKENDS[request.param](request)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def backend(make_backend: Callable[[], IndexBackend]) -> IndexBackend:
    return make_backend()


M = "model-a"
A, B, C = "127.10.0.1:8000", "127.10.0.2:8000", "127.10.0.3:8000"
GPU, CPU, STORAGE = Tier.GPU, Tier.CPU, Tier.STORAGE
BIG = [2**63, 2**63 + 1, 2**64 - 1, 2**64 - 2]


def store(member: str, keys: list[int], tier: Tier = GPU, model: str = M) -> Change:
    return Change(Op.STORE, member, model, tier, keys)


def remove(member: str, keys: list[int], tier: Tier = GPU, model: str = M) -> Change:
    return Change(Op.REMOVE, member, model, tier, keys)


def clear(member: str, tier: Tier | None = None) -> Change:
    return Change(Op.CLEAR, member, "", tier)


def matches(backend: IndexBackend, keys: list[int], model: str = M, **kw) -> dict[str, tuple]:
    return {m.member: (m.matched_blocks, m.by_tier) for m in backend.lookup(model, keys, **kw)}


# -- store and remove ----------------------------------------------------------------------


def test_store_then_lookup(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2, 3])])
    assert backend.lookup(M, [1, 2, 3]) == [MemberMatch(A, 3, (3, 0, 0))]
    assert backend.lookup(M, [1, 2]) == [MemberMatch(A, 2, (2, 0, 0))]
    assert backend.lookup(M, [1, 2, 3, 4, 5]) == [MemberMatch(A, 3, (3, 0, 0))]


def test_remove_from_one_member_keeps_the_block_for_others(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2, 3]), store(B, [1, 2, 3])])
    backend.apply([remove(A, [2])])
    assert matches(backend, [1, 2, 3]) == {A: (1, (1, 0, 0)), B: (3, (3, 0, 0))}


def test_remove_in_one_tier_keeps_the_other_tiers(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2], GPU), store(A, [1, 2], CPU)])
    backend.apply([remove(A, [1, 2], CPU)])
    assert backend.lookup(M, [1, 2]) == [MemberMatch(A, 2, (2, 0, 0))]
    backend.apply([store(A, [1, 2], CPU), remove(A, [1], GPU)])
    assert backend.lookup(M, [1, 2]) == [MemberMatch(A, 2, (1, 1, 0))]


def test_remove_of_what_is_not_held_does_nothing(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2])])
    backend.apply(
        [
            remove(A, [7, 8]),  # keys never stored
            remove(B, [1, 2]),  # a member that never stored
            remove(A, [1, 2], STORAGE),  # a tier it does not hold them in
            remove(A, [1, 2], model="other-model"),  # a model it does not hold them in
        ]
    )
    assert backend.lookup(M, [1, 2]) == [MemberMatch(A, 2, (2, 0, 0))]
    assert backend.members() == [A]


def test_member_leaves_when_its_last_entry_goes(backend: IndexBackend) -> None:
    backend.apply([store(A, [1], GPU), store(A, [1], CPU), store(B, [1])])
    backend.apply([remove(A, [1], GPU)])
    assert backend.members() == [A, B]
    backend.apply([remove(A, [1], CPU)])
    assert backend.members() == [B]
    assert backend.member_stats(A) is None
    assert backend.stats().members == 1


def test_store_twice_counts_two_copies_of_one_entry(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2, 3])])
    backend.apply([store(A, [1, 2, 3]), store(A, [3, 3, 2])])  # copies: 2, 3, 4
    assert backend.stats().blocks[GPU] == 3  # entries, not copies
    assert backend.member_stats(A) == MemberStats(A, {M: {GPU: 3}})
    backend.apply([remove(A, [1, 2, 3])])
    assert backend.lookup(M, [1, 2, 3]) == [MemberMatch(A, 3, (3, 0, 0))]
    backend.apply([remove(A, [1, 3, 3]), remove(A, [2])])
    assert backend.lookup(M, [1]) == []
    assert matches(backend, [2, 3]) == {A: (2, (2, 0, 0))}  # one copy of each left
    backend.apply([remove(A, [2, 3])])
    assert backend.member_stats(A) is None


# -- copies: vLLM (0.33) keeps one hash in several physical blocks, one event per copy --


def test_two_stores_and_one_remove_keep_the_key(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2])])
    backend.apply([store(A, [2]), store(B, [1, 2])])  # a second copy of 2 on A
    backend.apply([remove(A, [2])])  # one copy evicted, the other still cached
    assert matches(backend, [1, 2]) == {A: (2, (2, 0, 0)), B: (2, (2, 0, 0))}
    assert backend.member_keys(A, M) == [1, 2]


def test_two_removes_drop_the_key(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2]), store(A, [2])])
    backend.apply([remove(A, [2])])
    backend.apply([remove(A, [2])])
    assert matches(backend, [1, 2]) == {A: (1, (1, 0, 0))}
    assert backend.stats().blocks[GPU] == 1


def test_copies_are_counted_per_tier(backend: IndexBackend) -> None:
    backend.apply([store(A, [1]), store(A, [1]), store(A, [1], CPU)])
    backend.apply([remove(A, [1], CPU), remove(A, [1], CPU)])  # the second: nothing left
    assert backend.member_keys(A, M, CPU) == []
    backend.apply([remove(A, [1])])
    assert backend.member_keys(A, M, GPU) == [1]
    backend.apply([store(A, [1], CPU), remove(A, [1])])
    assert backend.member_keys(A, M, GPU) == [] and backend.member_keys(A, M, CPU) == [1]


def test_remove_of_an_unknown_key_never_goes_negative(backend: IndexBackend) -> None:
    backend.apply([store(A, [5])])
    backend.apply([remove(A, [1, 1, 1]), remove(B, [1])])  # never stored: no-ops
    backend.apply([store(A, [1])])
    assert matches(backend, [1]) == {A: (1, (1, 0, 0))}
    backend.apply([remove(A, [1])])  # one store, one remove: gone (no debt was kept)
    assert backend.lookup(M, [1]) == []
    assert backend.stats().blocks[GPU] == 1


def test_clear_member_drops_every_copy(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2]), store(A, [1, 2]), store(A, [1], CPU), store(A, [1], CPU)])
    backend.apply([store(B, [1, 2])])
    assert backend.clear_member(A) == 3  # entries: (1, GPU), (2, GPU), (1, CPU)
    assert matches(backend, [1, 2]) == {B: (2, (2, 0, 0))}
    backend.apply([store(A, [1, 2])])
    backend.apply([remove(A, [1, 2])])  # one copy since the clear: gone
    assert matches(backend, [1, 2]) == {B: (2, (2, 0, 0))}


def test_clear_change_drops_every_copy_of_that_tier(backend: IndexBackend) -> None:
    backend.apply([store(A, [1]), store(A, [1]), store(A, [1], CPU), store(A, [1], CPU)])
    backend.apply([clear(A, GPU)])
    backend.apply([store(A, [1]), remove(A, [1])])
    assert backend.member_keys(A, M, GPU) == []
    backend.apply([remove(A, [1], CPU)])
    assert backend.member_keys(A, M, CPU) == [1]  # the CPU copies survived the clear


def test_announce_holds_one_copy_without_adding_one(backend: IndexBackend) -> None:
    """ANNOUNCE (a re-announced, already cached block) never adds a copy to a held
    key, so no number of announcements outlives the removals of the real copies."""
    backend.apply([Change(Op.ANNOUNCE, A, M, GPU, [1, 2])])  # not held: one copy
    assert matches(backend, [1, 2]) == {A: (2, (2, 0, 0))}
    backend.apply([store(A, [2])])
    for _ in range(3):
        backend.apply([Change(Op.ANNOUNCE, A, M, GPU, [1, 2])])
    backend.apply([remove(A, [1, 2])])
    assert matches(backend, [1, 2]) == {}  # 1: its one copy went
    assert backend.member_keys(A, M) == [2]
    backend.apply([remove(A, [2])])
    assert backend.members() == []


def test_order_of_copies_within_one_apply_call(backend: IndexBackend) -> None:
    backend.apply(
        [
            remove(A, [1]),  # nothing to remove yet
            store(A, [1]),
            store(A, [1]),
            remove(A, [1]),
            Change(Op.ANNOUNCE, A, M, GPU, [1]),  # held: no copy added
            store(B, [1]),
            remove(B, [1]),
            Change(Op.ANNOUNCE, B, M, GPU, [1]),  # not held: one copy
        ]
    )
    backend.apply([remove(A, [1]), remove(B, [1])])
    assert backend.lookup(M, [1]) == []


def test_store_again_after_remove(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2, 3])])
    backend.apply([remove(A, [1, 2, 3])])
    assert backend.lookup(M, [1, 2, 3]) == []
    backend.apply([store(A, [1, 2, 3])])
    assert backend.lookup(M, [1, 2, 3]) == [MemberMatch(A, 3, (3, 0, 0))]
    assert backend.stats().keys == 3


def test_order_within_one_apply_call(backend: IndexBackend) -> None:
    backend.apply(
        [
            store(A, [1, 2]),
            remove(A, [2]),  # store then remove: absent
            remove(B, [5]),
            store(B, [5]),  # remove then store: present
            store(C, [1, 2]),
            remove(C, [1, 2]),
            store(C, [1]),
        ]
    )
    assert matches(backend, [1, 2]) == {A: (1, (1, 0, 0)), C: (1, (1, 0, 0))}
    assert matches(backend, [5]) == {B: (1, (1, 0, 0))}
    assert backend.stats().blocks[GPU] == 3


def test_keys_at_the_top_of_the_range_and_zero(backend: IndexBackend) -> None:
    chain = [0, *BIG, 2**63 - 1]
    backend.apply([store(A, chain)])
    assert backend.lookup(M, chain) == [MemberMatch(A, 6, (6, 0, 0))]
    backend.apply([remove(A, [2**64 - 1])])
    assert backend.lookup(M, chain) == [MemberMatch(A, 3, (3, 0, 0))]
    assert backend.lookup(M, [2**63 + 1]) == [MemberMatch(A, 1, (1, 0, 0))]
    assert backend.stats().keys == 5


def test_numpy_key_arrays_are_accepted(backend: IndexBackend) -> None:
    keys = np.array(BIG, dtype=np.uint64)
    backend.apply([Change(Op.STORE, A, M, GPU, keys)])  # type: ignore[arg-type]
    assert backend.lookup(M, keys) == [MemberMatch(A, 4, (4, 0, 0))]  # type: ignore[arg-type]
    assert backend.lookup(M, BIG) == [MemberMatch(A, 4, (4, 0, 0))]


@pytest.mark.parametrize("keys", [[-1], [2**64], [1, 2**70]])
def test_keys_out_of_range_are_rejected(backend: IndexBackend, keys: list[int]) -> None:
    with pytest.raises(ValueError):
        backend.apply([store(A, keys)])
    backend.apply([store(A, [1])])
    assert backend.lookup(M, [1]) == [MemberMatch(A, 1, (1, 0, 0))]


def test_store_without_a_tier_is_rejected(backend: IndexBackend) -> None:
    with pytest.raises(ValueError):
        backend.apply([Change(Op.STORE, A, M, None, [1])])


def test_models_are_isolated(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2], model="m1"), store(B, [1, 2], model="m2")])
    assert backend.lookup("m1", [1, 2]) == [MemberMatch(A, 2, (2, 0, 0))]
    assert backend.lookup("m2", [1, 2]) == [MemberMatch(B, 2, (2, 0, 0))]
    assert backend.lookup("m3", [1, 2]) == []
    backend.apply([remove(A, [1], model="m2"), remove(B, [2], model="m2")])
    assert backend.lookup("m1", [1, 2]) == [MemberMatch(A, 2, (2, 0, 0))]
    assert backend.lookup("m2", [1, 2]) == [MemberMatch(B, 1, (1, 0, 0))]
    assert backend.member_stats(A) == MemberStats(A, {"m1": {GPU: 2}})
    assert backend.stats().keys == 3


# -- clearing ------------------------------------------------------------------------------


def test_clear_without_tier_drops_everything_of_that_member(backend: IndexBackend) -> None:
    backend.apply(
        [
            store(A, [1, 2], GPU),
            store(A, [3], CPU, model="m2"),
            store(B, [1, 2], GPU),
        ]
    )
    backend.apply([clear(A)])
    assert matches(backend, [1, 2]) == {B: (2, (2, 0, 0))}
    assert backend.lookup("m2", [3]) == []
    assert backend.members() == [B]
    assert backend.member_stats(A) is None


def test_clear_with_tier_keeps_other_tiers(backend: IndexBackend) -> None:
    backend.apply(
        [
            store(A, [1, 2], GPU),
            store(A, [2, 3], CPU),
            store(A, [4], CPU, model="m2"),
            store(B, [1, 2, 3], CPU),
        ]
    )
    backend.apply([clear(A, CPU)])
    assert matches(backend, [1, 2, 3]) == {A: (2, (2, 0, 0)), B: (3, (0, 3, 0))}
    assert backend.lookup("m2", [4]) == []
    assert backend.member_stats(A) == MemberStats(A, {M: {GPU: 2}})


def test_clear_then_store_in_one_call(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2])])
    backend.apply([store(A, [3]), clear(A), store(A, [4])])
    assert backend.member_stats(A) == MemberStats(A, {M: {GPU: 1}})
    assert backend.lookup(M, [4]) == [MemberMatch(A, 1, (1, 0, 0))]


def test_clear_member_returns_entries_dropped(backend: IndexBackend) -> None:
    backend.apply(
        [
            store(A, [1, 2, 3], GPU),
            store(A, [3, 4], CPU),
            store(A, [1], STORAGE, model="m2"),
            store(B, [1, 2, 3, 4], GPU),
        ]
    )
    assert backend.clear_member(A) == 6  # a block held in two tiers is two entries
    assert backend.clear_member(A) == 0
    assert backend.clear_member("never-seen:1") == 0
    assert matches(backend, [1, 2, 3, 4]) == {B: (4, (4, 0, 0))}
    assert backend.members() == [B]
    stats = backend.stats()
    assert (stats.members, stats.keys, stats.blocks) == (1, 4, {GPU: 4, CPU: 0, STORAGE: 0})


def test_clear_of_an_unknown_member_does_nothing(backend: IndexBackend) -> None:
    backend.apply([store(A, [1])])
    backend.apply([clear(B), clear(B, GPU)])
    assert backend.lookup(M, [1]) == [MemberMatch(A, 1, (1, 0, 0))]


# -- lookups -------------------------------------------------------------------------------


def test_match_is_the_longest_consecutive_prefix(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2, 4, 5, 6]), store(B, [2, 3, 4])])
    # A misses block 3: the blocks it holds after the hole do not count.
    assert matches(backend, [1, 2, 3, 4, 5, 6]) == {A: (2, (2, 0, 0))}
    # B misses block 1, the first: no match at all, though it holds 2, 3 and 4.
    assert backend.lookup(M, [1, 2, 3]) == [MemberMatch(A, 2, (2, 0, 0))]
    assert backend.lookup(M, [2, 3, 4]) == [
        MemberMatch(B, 3, (3, 0, 0)),
        MemberMatch(A, 1, (1, 0, 0)),
    ]
    assert backend.lookup(M, [9, 1, 2]) == []


def test_prefix_may_span_tiers(backend: IndexBackend) -> None:
    backend.apply([store(A, [1], GPU), store(A, [2], CPU), store(A, [3], STORAGE)])
    assert backend.lookup(M, [1, 2, 3, 4]) == [MemberMatch(A, 3, (1, 1, 1))]


def test_by_tier_counts_each_block_in_its_best_tier(backend: IndexBackend) -> None:
    backend.apply(
        [
            store(A, [1, 2, 3, 4], STORAGE),
            store(A, [2, 3], CPU),
            store(A, [3], GPU),
            store(B, [1, 2, 3, 4, 5], CPU),
            store(B, [1, 2], STORAGE),
        ]
    )
    assert backend.lookup(M, [1, 2, 3, 4, 5]) == [
        MemberMatch(B, 5, (0, 5, 0)),
        MemberMatch(A, 4, (1, 1, 2)),
    ]
    # by_tier only counts the matched prefix
    assert matches(backend, [1, 2]) == {A: (2, (0, 1, 1)), B: (2, (0, 2, 0))}


def test_members_filter(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2]), store(B, [1]), store(C, [1, 2, 3])])
    assert matches(backend, [1, 2, 3], members=[A, B]) == {A: (2, (2, 0, 0)), B: (1, (1, 0, 0))}
    assert matches(backend, [1, 2, 3], members={B, "unknown:1"}) == {B: (1, (1, 0, 0))}
    assert backend.lookup(M, [1, 2, 3], members=["unknown:1"]) == []
    assert backend.lookup(M, [1, 2, 3], members=[]) == []


def test_results_are_sorted_best_first(backend: IndexBackend) -> None:
    chain = [1, 2, 3]
    backend.apply(
        [
            store("e:1", chain[:1], GPU),
            store("d:1", chain, CPU),
            store("c:1", chain, GPU),
            store("b:1", chain[:2], GPU),
            store("b:1", chain[2:], CPU),
            store("a:1", chain[:2], GPU),
            store("a:1", chain[2:], CPU),
            store("f:1", chain[:1], GPU),
        ]
    )
    assert [m.member for m in backend.lookup(M, chain)] == [
        "c:1",  # 3 blocks, 3 on GPU
        "a:1",  # 3 blocks, 2 on GPU; ties broken by member id
        "b:1",
        "d:1",  # 3 blocks, none on GPU
        "e:1",  # 1 block
        "f:1",
    ]


def test_empty_chain_and_unknown_model(backend: IndexBackend) -> None:
    backend.apply([store(A, [1])])
    assert backend.lookup(M, []) == []
    assert backend.lookup("unknown-model", [1]) == []


def test_lookup_repeats_a_key(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2])])
    assert backend.lookup(M, [1, 1, 2, 1, 3]) == [MemberMatch(A, 4, (4, 0, 0))]


def test_many_members(backend: IndexBackend) -> None:
    """More members than one 64-bit word: every member keeps its own prefix length."""
    members = [f"127.10.{i // 250}.{i % 250}:8000" for i in range(150)]
    chain = list(range(1000, 1200))
    backend.apply([store(m, chain[: i + 1]) for i, m in enumerate(members)])
    found = backend.lookup(M, chain)
    assert [(m.member, m.matched_blocks) for m in found] == [
        (m, i + 1) for i, m in reversed(list(enumerate(members)))
    ]
    backend.apply([remove(m, [chain[0]]) for m in members[::2]])
    assert matches(backend, chain) == {
        m: (i + 1, (i + 1, 0, 0)) for i, m in enumerate(members) if i % 2
    }
    picked = [members[3], members[99], members[149]]
    assert matches(backend, chain, members=picked) == {
        members[3]: (4, (4, 0, 0)),
        members[99]: (100, (100, 0, 0)),
        members[149]: (150, (150, 0, 0)),
    }
    assert backend.stats().members == 149  # members[0] held only the removed block
    assert backend.stats().blocks[GPU] == sum(range(1, 151)) - 75
    assert backend.clear_member(members[149]) == 150
    assert backend.members() == sorted(members[1:149])


# -- stats ---------------------------------------------------------------------------------


def test_stats_and_member_stats_after_mixed_operations(backend: IndexBackend) -> None:
    empty = backend.stats()
    assert (empty.members, empty.blocks, empty.keys) == (0, {GPU: 0, CPU: 0, STORAGE: 0}, 0)
    backend.apply(
        [
            store(A, [1, 2, 3]),
            store(A, [3, 4], CPU),
            store(B, [1, 2], model="m2"),
            store(C, [9]),
            remove(C, [9]),
            remove(A, [1]),
            store(B, BIG, STORAGE),
        ]
    )
    stats = backend.stats()
    assert stats.members == 2
    assert stats.blocks == {GPU: 4, CPU: 2, STORAGE: 4}
    assert stats.keys == 3 + 4 + 2  # M: 2, 3, 4 and BIG; m2: 1, 2
    assert backend.members() == [A, B]
    assert backend.member_stats(A) == MemberStats(A, {M: {GPU: 2, CPU: 2}})
    assert backend.member_stats(B) == MemberStats(B, {"m2": {GPU: 2}, M: {STORAGE: 4}})
    assert backend.member_stats(C) is None
    assert backend.member_stats("unknown:1") is None
    assert backend.member_stats(A).total() == 4  # type: ignore[union-attr]


def test_member_keys(backend: IndexBackend) -> None:
    backend.apply(
        [
            store(A, [5, 2**64 - 1, 0, 3], GPU),
            store(A, [3, 9], CPU),
            store(A, [7], GPU, model="m2"),
            store(B, [5, 6], GPU),
            remove(A, [5], GPU),
        ]
    )
    assert backend.member_keys(A, M) == [0, 3, 9, 2**64 - 1]
    assert backend.member_keys(A, M, GPU) == [0, 3, 2**64 - 1]
    assert backend.member_keys(A, M, CPU) == [3, 9]
    assert backend.member_keys(A, M, STORAGE) == []
    assert backend.member_keys(A, "m2") == [7]
    assert backend.member_keys(B, M) == [5, 6]
    assert backend.member_keys(B, "m2") == []
    assert backend.member_keys("unknown:1", M) == []
    assert backend.member_keys(A, "unknown-model") == []


def test_models_lists_what_was_stored(backend: IndexBackend) -> None:
    assert backend.models() == []
    backend.apply([store(A, [1], model="m2"), store(B, [2]), store(A, [3], CPU, model="m3")])
    assert backend.models() == sorted([M, "m2", "m3"])


def test_ping_answers(backend: IndexBackend) -> None:
    backend.ping()


# -- randomised comparison with a reference model ------------------------------------------


class Reference:
    """The contract, written as plainly as possible."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str, Tier], set[int]] = {}
        self.copies: Counter[tuple[str, str, Tier, int]] = Counter()

    def apply(self, changes: list[Change]) -> None:
        for c in changes:
            if c.op is Op.CLEAR:
                for member, model, tier in list(self.held):
                    if member == c.member and c.tier in (None, tier):
                        del self.held[(member, model, tier)]
                for entry in list(self.copies):
                    if entry[0] == c.member and c.tier in (None, entry[2]):
                        del self.copies[entry]
                continue
            assert c.tier is not None
            entry = self.held.setdefault((c.member, c.model, c.tier), set())
            for key in c.keys:
                at = (c.member, c.model, c.tier, key)
                n = self.copies[at]
                if c.op is Op.STORE:
                    n += 1
                elif c.op is Op.ANNOUNCE:
                    n = max(n, 1)
                else:
                    n = max(n - 1, 0)
                self.copies[at] = n
                if n:
                    entry.add(key)
                else:
                    entry.discard(key)

    def clear_member(self, member: str) -> int:
        mine = [k for k in self.held if k[0] == member]
        for entry in [e for e in self.copies if e[0] == member]:
            del self.copies[entry]
        return sum(len(self.held.pop(k)) for k in mine)

    def tiers_of(self, member: str, model: str, key: int) -> list[Tier]:
        return [t for t in TIERS if key in self.held.get((member, model, t), ())]

    def lookup(self, model: str, keys: list[int], members: list[str] | None) -> list[MemberMatch]:
        out = []
        for member in self.members():
            if members is not None and member not in members:
                continue
            by_tier = [0, 0, 0]
            n = 0
            for key in keys:
                tiers = self.tiers_of(member, model, key)
                if not tiers:
                    break
                by_tier[min(tiers)] += 1
                n += 1
            if n:
                out.append(MemberMatch(member, n, (by_tier[0], by_tier[1], by_tier[2])))
        return sorted(out, key=lambda m: (-m.matched_blocks, -m.by_tier[0], m.member))

    def members(self) -> list[str]:
        return sorted({member for (member, _, _), keys in self.held.items() if keys})

    def member_stats(self, member: str) -> MemberStats | None:
        stats = MemberStats(member)
        for (m, model, tier), keys in sorted(self.held.items()):
            if m == member and keys:
                stats.blocks.setdefault(model, {})[tier] = len(keys)
        return stats if stats.blocks else None

    def member_keys(self, member: str, model: str, tier: Tier | None = None) -> list[int]:
        tiers = TIERS if tier is None else (tier,)
        return sorted(set().union(*(self.held.get((member, model, t), ()) for t in tiers)))

    def blocks(self) -> dict[Tier, int]:
        return {t: sum(len(k) for (_, _, tt), k in self.held.items() if tt == t) for t in TIERS}

    def keys(self) -> int:
        return len({(model, k) for (_, model, _), keys in self.held.items() for k in keys})


# Small pools, so random sequences often revisit the same (member, model, tier, key).
KEY_POOL = [0, 1, 2, 3, 2**63 - 1, *BIG[:3]]
MEMBER_POOL = [A, B, f"{A}/dp1"]
MODEL_POOL = ["m1", "m2"]

key_lists = st.lists(st.sampled_from(KEY_POOL), min_size=1, max_size=6)
stores_and_removes = st.builds(
    Change,
    st.sampled_from([Op.STORE, Op.STORE, Op.STORE, Op.ANNOUNCE, Op.REMOVE, Op.REMOVE]),
    st.sampled_from(MEMBER_POOL),
    st.sampled_from(MODEL_POOL),
    st.sampled_from([GPU, GPU, CPU, STORAGE]),
    key_lists,
)
clears = st.builds(
    Change,
    st.just(Op.CLEAR),
    st.sampled_from(MEMBER_POOL),
    st.just(""),
    st.sampled_from([None, *TIERS]),
)
# one_of picks its branches evenly: repeat the common one so clears stay rare
changes = st.one_of(*[stores_and_removes] * 9, clears)
apply_calls = st.lists(changes, min_size=1, max_size=8)
steps = st.lists(
    st.one_of(*[apply_calls] * 9, st.sampled_from(MEMBER_POOL)),  # or one clear_member
    min_size=1,
    max_size=10,
)
chains = st.lists(st.sampled_from(KEY_POOL), min_size=1, max_size=10)


def _check_same(backend: IndexBackend, ref: Reference, probes: list[list[int]]) -> None:
    for model in MODEL_POOL:
        for chain in probes:
            assert backend.lookup(model, chain) == ref.lookup(model, chain, None), chain
            some = MEMBER_POOL[::2]
            assert backend.lookup(model, chain, members=some) == ref.lookup(model, chain, some)
    assert backend.members() == ref.members()
    for member in MEMBER_POOL:
        assert backend.member_stats(member) == ref.member_stats(member)
        for model in MODEL_POOL:
            assert backend.member_keys(member, model) == ref.member_keys(member, model)
            assert backend.member_keys(member, model, CPU) == ref.member_keys(member, model, CPU)
    stats = backend.stats()
    assert stats.blocks == ref.blocks()
    assert stats.keys == ref.keys()
    assert stats.members == len(ref.members())


# 300 examples of a dozen round trips each: ~2.5 min on the Redis Cluster when the
# machine is shared, past the suite's default 120 s limit.
@pytest.mark.timeout(360)
@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=steps, probes=st.lists(chains, min_size=1, max_size=4), wide=st.booleans())
def test_matches_reference_model(
    make_backend: Callable[[], IndexBackend],
    steps: list[list[Change] | str],
    probes: list[list[int]],
    wide: bool,
) -> None:
    backend, ref = make_backend(), Reference()
    if wide:  # 64 members elsewhere first, so the members under test sit past bit 63
        filler = [store(f"filler-{i}:1", [i], model="filler") for i in range(64)]
        backend.apply(filler)
        ref.apply(filler)
    probes = [*probes, KEY_POOL, KEY_POOL[::-1]]
    for step in steps:
        if isinstance(step, str):
            assert backend.clear_member(step) == ref.clear_member(step)
        else:
            backend.apply(step)
            ref.apply(step)
        _check_same(backend, ref, probes)


def test_larger_random_batches_match_reference(make_backend: Callable[[], IndexBackend]) -> None:
    """Bigger, seeded batches than the property test: many members (more than 64),
    repeated keys across members in one call, thousands of keys, with mixed tiers."""
    rng = random.Random(7)
    backend, ref = make_backend(), Reference()
    members = [f"127.11.{i // 100}.{i % 100}:8000" for i in range(80)]
    pool = [rng.getrandbits(64) for _ in range(3000)] + [0, 2**64 - 1, 2**63]
    models = ["m1", "m2"]
    for round_no in range(20):
        batch: list[Change] = []
        active = members[: 20 + 3 * round_no]
        for _ in range(40):
            roll = rng.random()
            member = rng.choice(active)
            if roll < 0.03:
                batch.append(clear(member, rng.choice([None, *TIERS])))
                continue
            start = rng.randrange(len(pool))
            keys = pool[start : start + rng.randint(1, 120)] + rng.sample(pool, 2)
            tier = rng.choice([GPU, GPU, GPU, CPU, STORAGE])
            op = Op.STORE if roll < 0.6 else Op.ANNOUNCE if roll < 0.7 else Op.REMOVE
            batch.append(Change(op, member, rng.choice(models), tier, keys))
        backend.apply(batch)
        ref.apply(batch)
        if round_no % 5 == 4:
            member = rng.choice(active)
            assert backend.clear_member(member) == ref.clear_member(member)
        stats = backend.stats()
        assert (stats.members, stats.keys, stats.blocks) == (
            len(ref.members()),
            ref.keys(),
            ref.blocks(),
        )
        assert backend.members() == ref.members()
        for member in active:
            assert backend.member_stats(member) == ref.member_stats(member)
        member = rng.choice(active)
        for model in models:
            assert backend.member_keys(member, model) == ref.member_keys(member, model)
        for _ in range(4):
            start = rng.randrange(len(pool))
            chain = pool[start : start + 150]
            model = rng.choice(models)
            assert backend.lookup(model, chain) == ref.lookup(model, chain, None)
            some = rng.sample(active, 10)
            assert backend.lookup(model, chain, some) == ref.lookup(model, chain, some)

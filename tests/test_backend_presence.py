"""The ``presence`` query of the IndexBackend contract, for every backend.

Kept apart from ``test_backend_contract.py`` (same backends, same fixtures) because it
serves one feature: hybrid KV groups, whose hit rule needs blocks past a hole.
"""

from __future__ import annotations

import random

from kvindex.indexer.backend import Change, IndexBackend, MemberPresence, Op, Tier
from tests import test_backend_contract as contract
from tests.test_backend_contract import BIG, A, B, C, M, remove, store

# The contract suite's fixtures: every backend it knows, fresh and empty per test.
make_backend = contract.make_backend
backend = contract.backend

GPU, CPU, STORAGE = Tier.GPU, Tier.CPU, Tier.STORAGE


def bits(*positions: int) -> int:
    return sum(1 << p for p in positions)


def test_presence_reports_every_held_position_past_holes(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2, 3, 7]), store(B, [2, 9], CPU), store(C, [9], STORAGE)])
    assert backend.presence(M, [1, 5, 3, 9, 7, 2]) == [
        MemberPresence(A, (bits(0, 2, 4, 5), 0, 0)),
        MemberPresence(B, (0, bits(3, 5), 0)),
        MemberPresence(C, (0, 0, bits(3))),
    ]
    found = backend.presence(M, [1, 5, 3, 9, 7, 2])
    assert [p.held for p in found] == [bits(0, 2, 4, 5), bits(3, 5), bits(3)]


def test_presence_one_member_in_several_tiers(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2]), store(A, [2, 3], CPU), store(A, [3], STORAGE)])
    assert backend.presence(M, [1, 2, 3, 4]) == [
        MemberPresence(A, (bits(0, 1), bits(1, 2), bits(2)))
    ]


def test_presence_filters_members_models_and_empty_input(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2]), store(B, [2]), store(A, [1], model="other")])
    assert backend.presence(M, [1, 2], members=[B, "unknown:1"]) == [
        MemberPresence(B, (bits(1), 0, 0))
    ]
    assert backend.presence(M, [1, 2], members=["unknown:1"]) == []
    assert backend.presence(M, [1, 2], members=[]) == []
    assert backend.presence(M, []) == []
    assert backend.presence("unknown-model", [1]) == []
    assert backend.presence("other", [2, 1]) == [MemberPresence(A, (bits(1), 0, 0))]
    assert backend.presence(M, [5, 6]) == []


def test_presence_follows_removes_and_clears(backend: IndexBackend) -> None:
    backend.apply([store(A, [1, 2, 3, *BIG]), store(B, [1])])
    backend.apply([remove(A, [2]), Change(Op.CLEAR, B, "", None)])
    assert backend.presence(M, [1, 2, 3, *BIG]) == [
        MemberPresence(A, (bits(0, 2, 3, 4, 5, 6), 0, 0))
    ]
    backend.clear_member(A)
    assert backend.presence(M, [1, 2, 3]) == []


def test_presence_repeated_keys_and_long_lists(backend: IndexBackend) -> None:
    keys = list(range(1, 3001))
    backend.apply([store(A, keys[::3]), store(B, [5])])
    probe = [5, 5, *keys]
    found = {p.member: p.by_tier for p in backend.presence(M, probe)}
    want_a = bits(*(i for i, k in enumerate(probe) if k % 3 == 1))
    assert found == {A: (want_a, 0, 0), B: (bits(0, 1, 2 + 4), 0, 0)}


def test_presence_matches_a_plain_reference(backend: IndexBackend) -> None:
    rng = random.Random(7)
    members = [A, B, C]
    copies: dict[tuple[str, Tier, int], int] = {}  # the backend counts copies
    for _ in range(30):
        member, tier = rng.choice(members), rng.choice([GPU, GPU, CPU, STORAGE])
        keys = rng.sample(range(1, 40), rng.randint(1, 8))
        op = rng.choice([Op.STORE, Op.STORE, Op.REMOVE])
        backend.apply([Change(op, member, M, tier, keys)])
        for key in keys:
            n = copies.get((member, tier, key), 0)
            copies[(member, tier, key)] = n + 1 if op is Op.STORE else max(0, n - 1)
        probe = rng.sample(range(1, 45), 20)
        want = []
        for m in members:
            masks = tuple(
                bits(*(i for i, k in enumerate(probe) if copies.get((m, t, k), 0)))
                for t in (GPU, CPU, STORAGE)
            )
            if any(masks):
                want.append(MemberPresence(m, masks))  # type: ignore[arg-type]
        assert backend.presence(M, probe) == want
        assert backend.presence(M, probe, members=[A, C]) == [p for p in want if p.member in (A, C)]

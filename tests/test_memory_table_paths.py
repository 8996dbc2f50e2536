"""The compiled probing kernels (indexer/memory/_probe.c) against the pure-numpy path.

Both paths must keep the table's invariants (every key within ``max_disp`` slots after
its home slot, no empty slot in between) and give the same answers for the same
changes, even though the slots they pick for a batch of racing keys may differ. The
differential test drives two MemoryBackends, one per path, through the same random
stores, removals, announcements and clears (key 0, colliding keys, table growth and
rebuilds included) and compares every lookup and every member's keys after each step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvindex.indexer import compiled
from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.memory import table as memory_table
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.table_layout import MAX_DISPLACEMENT, PAD, _shift_for

pytestmark = pytest.mark.skipif(
    compiled.probe is None, reason="kvindex.indexer.memory._probe was not built (no C compiler)"
)

M = "model-a"
MEMBERS = [f"127.0.0.{i}:8000" for i in range(1, 6)]
SEED = 99
_MULT = int(memory_table._MULT)
_MULT_INV = pow(_MULT, -1, 2**64)


def colliding(count: int, rng: random.Random) -> list[int]:
    """Keys whose home slots crowd a few places in any table size (top bits equal)."""
    tops = [rng.getrandbits(6) << 58 for _ in range(3)]
    mixed = [rng.choice(tops) | rng.getrandbits(20) for _ in range(count)]
    return [(x * _MULT_INV % 2**64) ^ SEED for x in mixed]


def valid(table: memory_table.BlockTable) -> None:
    """Every stored key lies within max_disp after its home, with no empty slot between."""
    keys = table.keys[: table.zero_slot]
    used = np.flatnonzero(keys)
    home = memory_table._home(keys[used], table.seed, table.shift)
    disp = used - home
    assert (disp >= 0).all() and disp.max(initial=0) <= table.max_disp
    occupied = np.concatenate(([0], np.cumsum(keys != 0)))
    # slots home..slot all occupied: the count of occupied slots in [home, slot] is disp+1
    assert ((occupied[used + 1] - occupied[home]) == disp + 1).all()


def random_changes(rng: random.Random, pool: list[int]) -> list[Change]:
    changes = []
    for _ in range(rng.randint(1, 6)):
        member = rng.choice(MEMBERS)
        kind = rng.random()
        if kind < 0.04:
            changes.append(Change(Op.CLEAR, member, M, None, []))
            continue
        keys = rng.sample(pool, rng.randint(1, 300))
        if rng.random() < 0.3:
            keys = keys + keys[: rng.randint(1, len(keys))]  # repeats within a change
        op = Op.STORE if kind < 0.6 else Op.REMOVE if kind < 0.9 else Op.ANNOUNCE
        tier = Tier.GPU if rng.random() < 0.85 else Tier.CPU
        changes.append(Change(op, member, M, tier, keys))
    return changes


def facts(backend: MemoryBackend) -> tuple:
    """The table's counters and copy counts, by key rather than by slot (the two paths
    may place racing keys in different slots)."""
    table = backend._tables.get(M)
    if table is None:
        return ()
    copies = {}
    for slot, mid, tier, n in table.copies.entries():
        copies[(int(table.keys[slot]), mid, tier)] = n
    stats = backend.stats()
    return (
        table.n_live,
        table.n_used,
        table.counts.tolist(),
        table.held.tolist(),
        copies,
        stats.keys,
        stats.blocks,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_and_numpy_paths_answer_alike(seed: int, monkeypatch) -> None:
    rng = random.Random(seed)
    pool = [0] + [rng.getrandbits(64) for _ in range(6000)] + colliding(600, rng)
    fast = MemoryBackend(hash_seed=SEED)
    with monkeypatch.context() as numpy_only:
        numpy_only.setattr(compiled, "probe", None)
        slow = MemoryBackend(hash_seed=SEED)
    probes = [rng.sample(pool, 40) for _ in range(20)]
    for step in range(120):
        changes = random_changes(rng, pool)
        fast.apply(changes)
        with monkeypatch.context() as numpy_only:
            numpy_only.setattr(compiled, "probe", None)
            slow.apply(changes)
            expected = [slow.lookup(M, keys) for keys in probes]
            expected_keys = {m: sorted(slow.member_keys(m, M)) for m in MEMBERS}
            expected_facts = facts(slow)
        assert [fast.lookup(M, keys) for keys in probes] == expected, f"step {step}"
        assert {m: sorted(fast.member_keys(m, M)) for m in MEMBERS} == expected_keys
        assert facts(fast) == expected_facts, f"step {step}"
    table = fast._tables[M]
    valid(table)
    assert table.rebuilds > 0  # the run grew the table through the compiled layout


def test_layout_kernel_keeps_the_invariants() -> None:
    rng = np.random.default_rng(5)
    distinct = np.unique(rng.integers(1, 2**63, 50_000, dtype=np.uint64))
    keys = np.concatenate((np.zeros(1, np.uint64), distinct))
    cap = 1 << 17
    table = memory_table.BlockTable(1, seed=SEED, stamped=False)
    slots = np.empty(keys.size, np.intp)
    scratch = np.zeros(cap + PAD + 1, np.uint64)
    shift = int(_shift_for(cap))
    disp = compiled.probe.layout(scratch, keys, SEED, shift, MAX_DISPLACEMENT, cap + PAD, slots)
    assert disp >= 0
    assert slots[0] == cap + PAD
    assert (scratch[slots] == keys).all()
    table.keys, table.cap, table.shift, table.max_disp = scratch, cap, np.uint64(shift), disp
    table.zero_slot = cap + PAD
    valid(table)


def test_kernels_report_a_full_table_instead_of_overflowing() -> None:
    cap = 1024
    shift = int(_shift_for(cap))
    # every key has the same home slot: only MAX_DISPLACEMENT + 1 of them fit
    top = 7 << 58
    keys = np.array([((top | i) * _MULT_INV % 2**64) ^ SEED for i in range(1, 2000)], np.uint64)
    slots = np.empty(keys.size, np.intp)
    scratch = np.zeros(cap + PAD + 1, np.uint64)
    assert compiled.probe.layout(scratch, keys, SEED, shift, MAX_DISPLACEMENT, -1, slots) == -1
    table = np.zeros(cap + PAD + 1, np.uint64)
    cursors = np.full(keys.size, top >> shift, np.intp)
    full = compiled.probe.insert(table, keys, cursors, SEED, shift, MAX_DISPLACEMENT, -1, slots)
    assert full == -1
    assert np.count_nonzero(table) == MAX_DISPLACEMENT + 1
    with pytest.raises(TypeError):
        compiled.probe.find(table, keys.astype(np.uint32), SEED, shift, 0, 0, -1, slots, None)
    with pytest.raises(ValueError):
        compiled.probe.find(table, keys, SEED, shift, 0, 0, -1, slots[:3], None)
    # an absent key past max_disp with no gap within MAX_DISPLACEMENT: no cursor
    status = compiled.probe.find(
        table, keys[-3:], SEED, shift, MAX_DISPLACEMENT, MAX_DISPLACEMENT, -1, slots[:3], slots[3:6]
    )
    assert status == -1


def test_distinct_kernel_finds_any_repeat() -> None:
    rng = np.random.default_rng(9)
    for n in (0, 1, 2, 17, 64, 65, 4096):
        values = rng.permutation(10 * n + 1)[:n].astype(np.intp)
        assert compiled.probe.distinct(values)
        if n >= 2:
            values[-1] = values[rng.integers(n - 1)]
            assert not compiled.probe.distinct(values)
    assert not compiled.probe.distinct(np.array([0, 5, 0], np.intp))  # 0 is a value too
    assert compiled.probe.distinct(np.array([0, 1, 2**62], np.intp))


def test_move_rows_kernel_matches_numpy_and_checks_bounds() -> None:
    rng = np.random.default_rng(11)
    for dtype, width in ((np.uint64, 1), (np.uint64, 3), (np.uint32, 1)):
        src = rng.integers(0, 2**31, (500, width)).astype(dtype)
        src_rows = rng.permutation(500)[:300].astype(np.intp)
        dst_rows = rng.permutation(800)[:300].astype(np.intp)
        want = np.zeros((800, width), dtype)
        want[dst_rows] = src[src_rows]
        got = np.zeros((800, width), dtype)
        compiled.probe.move_rows(src, got, src_rows, dst_rows, src.strides[0])
        assert (got == want).all()
    with pytest.raises(IndexError):
        compiled.probe.move_rows(src, got, np.array([500], np.intp), np.array([0], np.intp), 4)
    with pytest.raises(ValueError):
        compiled.probe.move_rows(src, got, src_rows, dst_rows[:5], 4)


def prefix_changes(rng: random.Random, chain: list[int], members: list[str]) -> list[Change]:
    """Members holding prefixes of ``chain`` (many of equal length, so ties are ordered
    by name), some of it off the GPU, with holes past the prefix."""
    changes = []
    for member in members:
        n = rng.choice([0, 1, 5, 5, 17, len(chain) // 2, len(chain)])
        tiers = rng.choice(["gpu", "gpu", "cpu half", "storage tail", "all three"])
        held = chain[:n]
        if tiers == "gpu":
            changes.append(Change(Op.STORE, member, M, Tier.GPU, held))
        elif tiers == "cpu half":
            changes.append(Change(Op.STORE, member, M, Tier.GPU, held[: n // 2]))
            changes.append(Change(Op.STORE, member, M, Tier.CPU, held[n // 2 :]))
        elif tiers == "storage tail":
            changes.append(Change(Op.STORE, member, M, Tier.GPU, held[: n - 3]))
            changes.append(Change(Op.STORE, member, M, Tier.STORAGE, held[n - 3 :]))
        else:  # a block in two tiers counts in the better one
            changes.append(Change(Op.STORE, member, M, Tier.CPU, held))
            changes.append(Change(Op.STORE, member, M, Tier.STORAGE, held[::2]))
            changes.append(Change(Op.STORE, member, M, Tier.GPU, held[::3]))
        if rng.random() < 0.3:  # blocks past a hole do not count
            changes.append(Change(Op.STORE, member, M, Tier.GPU, chain[n + 1 : n + 9]))
    return changes


@pytest.mark.parametrize("members", [5, 64, 150])
def test_compiled_walk_answers_as_the_numpy_path(members: int, monkeypatch) -> None:
    """The compiled lookup walk (one C call: probe, running mask, tier counts, answer
    objects in order) against the numpy probe and answer(), over one and several mask
    words, every tier, ties of length and the member filter."""
    rng = random.Random(members)
    names = [f"10.0.{i % 7}.{i}:8000" for i in range(members)]
    rng.shuffle(names)  # ids in another order than names
    chain = [0] + [rng.getrandbits(64) for _ in range(300)] + colliding(40, rng)
    changes = prefix_changes(rng, chain, names)
    fast = MemoryBackend(hash_seed=SEED)
    fast.apply(changes)
    with monkeypatch.context() as numpy_only:
        numpy_only.setattr(compiled, "probe", None)
        slow = MemoryBackend(hash_seed=SEED)
        slow.apply(changes)
    queries = [
        (chain, None),
        (chain[1:], None),
        (chain[:9], None),
        (chain, names[::3]),
        (chain, [*names[-1:], "10.9.9.9:8000"]),
        (np.array(chain, np.uint64), None),
        ([np.uint64(k) for k in chain[:50]], None),  # not ints: converted first
        ([*chain, rng.getrandbits(64)], rng.sample(names, min(20, members))),
    ]
    for keys, allowed in queries:
        with monkeypatch.context() as numpy_only:
            numpy_only.setattr(compiled, "probe", None)
            expected = slow.lookup(M, keys, allowed)
        got = fast.lookup(M, keys, allowed)
        assert got == expected
    assert fast.lookup(M, chain) and fast._width == -(-members // 64)
    tiered = [m for m in fast.lookup(M, chain) if m.by_tier[0] != m.matched_blocks]
    assert tiered  # the tier counts were exercised
    for bad in ([1, -1], [1, 2**64], [1, "x"]):
        with pytest.raises(ValueError, match="block keys must be integers"):
            fast.lookup(M, bad)
        with pytest.raises(ValueError, match="block keys must be integers"):
            fast.lookup("no-such-model", bad)

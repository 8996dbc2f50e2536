"""Scorer.score_keys's answer rows (scoring/scorer.py): one PodScore per matched pod,
best first by score, then matched blocks, then pod; candidates without a match last.

The scorer skips the sort when the lookup's own order (blocks, GPU blocks, member) is
already the answer's, and takes GPU-only scores from a table: checked here against the
rule written out plainly, over ties of length, names in another order than member ids,
tiers, and weights that tie different block counts after rounding."""

from __future__ import annotations

import random

import pytest

from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import ModelCatalog
from kvindex.scoring.scorer import PodScore, Scorer, TierWeights

M = "m"
BLOCK = 16


def filled(rng: random.Random, tiers: bool) -> tuple[MemoryBackend, list[int], list[str]]:
    backend = MemoryBackend()
    chain = [rng.getrandbits(64) for _ in range(200)]
    pods = [f"127.0.{rng.randrange(9)}.{i}:8000" for i in range(70)]
    rng.shuffle(pods)  # member ids in another order than the names
    changes = []
    for pod in pods:
        n = rng.choice([0, 3, 3, 3, 40, 199, 200])
        if tiers and rng.random() < 0.4:
            changes.append(Change(Op.STORE, pod, M, Tier.GPU, chain[: n // 2]))
            changes.append(Change(Op.STORE, pod, M, Tier.CPU, chain[n // 2 : n]))
        else:
            changes.append(Change(Op.STORE, pod, M, Tier.GPU, chain[:n]))
    backend.apply(changes)
    return backend, chain, pods


def expected(backend: MemoryBackend, chain: list[int], weights: TierWeights, candidates):
    rows = [
        PodScore(
            m.member,
            m.matched_blocks,
            m.matched_blocks * BLOCK,
            *m.by_tier,
            round(
                m.by_tier[0] * weights.gpu
                + m.by_tier[1] * weights.cpu
                + m.by_tier[2] * weights.storage,
                6,
            ),
        )
        for m in backend.lookup(M, chain, candidates)
    ]
    rows.sort(key=lambda p: (-p.score, -p.matched_blocks, p.pod))
    listed = {p.pod for p in rows}
    rows += [PodScore(p, 0, 0, 0, 0, 0, 0.0) for p in sorted(set(candidates or ()) - listed)]
    return rows


@pytest.mark.parametrize("tiers", [False, True])
@pytest.mark.parametrize(
    "weights",
    [TierWeights(), TierWeights(gpu=0.3, cpu=0.9), TierWeights(gpu=1e-7), TierWeights(gpu=0.0)],
)
def test_rows_follow_the_answer_order(tiers: bool, weights: TierWeights) -> None:
    rng = random.Random(7 + tiers)
    backend, chain, pods = filled(rng, tiers)
    scorer = Scorer(backend, ModelCatalog(), weights)
    for candidates in (None, pods[::5], [*pods[:3], "127.9.9.9:8000"]):
        for keys in (chain, chain[:3], chain[:100]):
            result = scorer.score_keys(M, keys, candidates=candidates)
            want = expected(backend, keys, weights, candidates)
            assert result.pods == want
            assert result.best_matched_blocks == max((p.matched_blocks for p in want), default=0)


def test_gpu_scores_beyond_the_first_table_are_added() -> None:
    """The table of GPU-only scores grows when a longer match comes."""
    backend = MemoryBackend()
    chain = list(range(1, 3001))
    backend.apply([Change(Op.STORE, "127.0.0.1:8000", M, Tier.GPU, chain[:10])])
    scorer = Scorer(backend, ModelCatalog(), TierWeights(gpu=0.7))
    assert [p.score for p in scorer.score_keys(M, chain).pods] == [7.0]
    backend.apply([Change(Op.STORE, "127.0.0.2:8000", M, Tier.GPU, chain)])
    assert [p.score for p in scorer.score_keys(M, chain).pods] == [round(3000 * 0.7, 6), 7.0]


class _Reordered(MemoryBackend):
    """A memory backend whose lookups come in another order (the contract says best
    first; the scorer checks rather than trusts it): shuffled, or by blocks but with
    ties in reverse name order."""

    def __init__(self, shuffle: bool) -> None:
        super().__init__()
        self.shuffle = shuffle

    def lookup(self, model, keys, members=None):  # type: ignore[no-untyped-def]
        out = super().lookup(model, keys, members)
        if self.shuffle:
            random.Random(len(out)).shuffle(out)
        else:
            out.sort(key=lambda m: m.member, reverse=True)
            out.sort(key=lambda m: -m.matched_blocks)  # stable: ties stay reversed
        return out


@pytest.mark.parametrize("shuffle", [True, False])
def test_rows_are_ordered_whatever_order_the_backend_answers_in(shuffle: bool) -> None:
    rng = random.Random(3)
    backend, chain, _ = filled(rng, tiers=False)
    reordered = _Reordered(shuffle)
    reordered.from_state(backend.to_state())
    result = Scorer(reordered, ModelCatalog()).score_keys(M, chain)
    assert result.pods == expected(backend, chain, TierWeights(), None)

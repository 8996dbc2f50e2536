"""The routing cost model and decision rules, as pure functions (no network)."""

from __future__ import annotations

from collections import Counter

import pytest

from kvindex.scoring.route_cost import CostWeights, PodInputs, pod_cost, usable_blocks
from kvindex.scoring.router import Admission, Reason, Router

BS = 16
W = CostWeights()


def pod(name: str, matched: int = 0, waiting: int | None = 0, kv: float | None = 0.0, flying=0):
    return PodInputs(name, matched, float(matched), waiting, kv, flying)


def test_reuse_is_capped_at_all_tokens_but_the_last_like_vllm() -> None:
    assert usable_blocks(32, 32 * BS, BS) == 31  # the last token is always computed
    assert usable_blocks(32, 32 * BS + 1, BS) == 32
    assert usable_blocks(5, 32 * BS, BS) == 5
    assert usable_blocks(3, 0, BS) == 0
    full = pod_cost(pod("a", 32), 32 * BS, BS, W)
    assert full.usable_blocks == 31 and full.uncached_blocks == 1.0
    assert full.prefix == pytest.approx(2.0 / 32)


def test_cpu_tier_blocks_save_less_prefill_than_gpu_blocks() -> None:
    gpu = PodInputs("g", 16, 16.0, 0, 0.0, 0)
    cpu = PodInputs("c", 16, 16 * 0.8, 0, 0.0, 0)
    tokens = 32 * BS + 1
    assert pod_cost(gpu, tokens, BS, W).total < pod_cost(cpu, tokens, BS, W).total


def test_terms_grow_with_queue_in_flight_and_kv_usage() -> None:
    idle = pod_cost(pod("a"), 64, BS, W)
    assert (idle.queue, idle.kv) == (0.0, 0.0)
    assert pod_cost(pod("a", waiting=4), 64, BS, W).queue == pytest.approx(1.0)
    assert pod_cost(pod("a", flying=4), 64, BS, W).queue == pytest.approx(1.0)
    assert pod_cost(pod("a", waiting=2, flying=4), 64, BS, W).queue == pytest.approx(1.5)


def test_a_deep_queue_outweighs_a_full_prefix_hit() -> None:
    """The queue term is unbounded: a prefix pod far busier than a cold idle one loses
    (a saturating term let long shared prefixes pile onto one pod at any queue depth)."""
    tokens = 32 * BS + 1
    hot = PodInputs("hot", 32, 32.0, 9, 0.0, 0)  # the whole prompt cached, 9 waiting
    cold = PodInputs("cold", 0, 0.0, 0, 0.0, 0)
    assert pod_cost(hot, tokens, BS, W).total > pod_cost(cold, tokens, BS, W).total
    busy = PodInputs("hot", 32, 32.0, 3, 0.0, 0)  # at a short queue the prefix still wins
    assert pod_cost(busy, tokens, BS, W).total < pod_cost(cold, tokens, BS, W).total
    assert pod_cost(pod("a", kv=0.25), 64, BS, W).kv == pytest.approx(0.25)


def test_unknown_load_is_never_idle_and_grows_with_in_flight() -> None:
    idle = pod_cost(pod("a"), 64, BS, W)
    unknown = pod_cost(pod("a", waiting=None, kv=None), 64, BS, W)
    assert unknown.load == pytest.approx(2.0) and unknown.load > idle.load
    busier = pod_cost(pod("a", waiting=None, kv=None, flying=3), 64, BS, W)
    assert busier.load > unknown.load


def test_weights_are_validated() -> None:
    with pytest.raises(ValueError):
        CostWeights(prefix=-1)
    with pytest.raises(ValueError):
        CostWeights(queue_unit=0)


def decide(router: Router, pods, tokens=32 * BS + 1, fallback=None, kv_max=None):
    kv = kv_max if kv_max is not None else {p.pod: p.kv_usage for p in pods}
    return router.decide(pods, kv, tokens, BS, fallback)


def test_prefix_wins_at_equal_load_and_load_wins_on_a_busy_prefix_pod() -> None:
    router = Router(seed=1)
    chosen = decide(router, [pod("a", matched=16), pod("b"), pod("c")])
    assert (chosen.pod, chosen.reason) == ("a", Reason.PREFIX)
    busy = decide(router, [pod("a", matched=16, waiting=20, kv=0.8), pod("b"), pod("c", kv=0.1)])
    assert (busy.pod, busy.reason) == ("b", Reason.LOAD)
    assert [c.terms.usable_blocks for c in busy.candidates] == [16, 0, 0]


def test_the_longest_match_among_busy_pods_is_still_a_prefix_decision() -> None:
    # a's 8 extra blocks (a quarter of the prompt) outweigh its one waiting request
    pods = [pod("a", matched=12, waiting=1), pod("b", matched=4)]
    decision = decide(Router(seed=0), pods)
    assert (decision.pod, decision.reason) == ("a", Reason.PREFIX)


def test_admission_refuses_full_and_queued_pods_and_none_left_is_no_capacity() -> None:
    router = Router(admission=Admission(max_kv_usage=0.9, max_waiting=10), seed=0)
    pods = [pod("a", matched=32, kv=0.95), pod("b", waiting=11), pod("c", kv=0.5)]
    decision = decide(router, pods)
    assert decision.pod == "c"
    assert [c.refused is None for c in decision.candidates] == [False, False, True]
    assert "max-kv-usage" in decision.candidates[0].refused
    assert "max-waiting" in decision.candidates[1].refused
    none = decide(router, pods[:2])
    assert (none.pod, none.reason) == (None, Reason.NO_CAPACITY)


def test_admission_uses_the_fullest_engine_and_admits_unknown_load() -> None:
    router = Router(admission=Admission(max_kv_usage=0.9), seed=0)
    pods = [pod("a", kv=0.5), pod("b", waiting=None, kv=None)]
    decision = decide(router, pods, kv_max={"a": 0.95, "b": None})
    assert decision.pod == "b" and decision.candidates[1].refused is None


def test_ties_are_broken_at_random_and_reproducibly_per_seed() -> None:
    pods = [pod("a"), pod("b"), pod("c")]
    router = Router(seed=7)
    sequence = [decide(router, pods).pod for _ in range(300)]
    again = Router(seed=7)
    assert [decide(again, pods).pod for _ in range(300)] == sequence
    counts = Counter(sequence)
    assert set(counts) == {"a", "b", "c"} and min(counts.values()) > 50


def test_fallback_ignores_the_index_and_takes_the_least_loaded_in_turn() -> None:
    router = Router(seed=0)
    pods = [pod("a", matched=32), pod("b"), pod("c"), pod("d", waiting=3)]
    picks = [decide(router, pods, fallback=Reason.FALLBACK_STALE_INDEX) for _ in range(6)]
    assert {d.reason for d in picks} == {Reason.FALLBACK_STALE_INDEX}
    assert [d.pod for d in picks] == ["a", "b", "c", "a", "b", "c"]
    assert all(c.terms.prefix == 0 for c in picks[0].candidates)

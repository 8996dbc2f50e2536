"""The routing cost model and decision rules, as pure functions (no network)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from kvindex.scoring.route.cost import CostWeights, PodInputs, pod_cost, usable_blocks
from kvindex.scoring.route.decision import Admission, Reason, Router

BS = 16
W = CostWeights()


def pod(
    name: str,
    matched: int = 0,
    waiting: int | None = 0,
    kv: float | None = 0.0,
    flying: int = 0,
    running: int | None = 0,
    prefilling: int = 0,
    queued: int = 0,
) -> PodInputs:
    if waiting is None:
        running = None
    return PodInputs(
        name, matched, float(matched), running, waiting, kv, flying, prefilling, queued
    )


def test_reuse_is_capped_at_all_tokens_but_the_last_like_vllm() -> None:
    assert usable_blocks(32, 32 * BS, BS) == 31  # the last token is always computed
    assert usable_blocks(32, 32 * BS + 1, BS) == 32
    assert usable_blocks(5, 32 * BS, BS) == 5
    assert usable_blocks(3, 0, BS) == 0
    full = pod_cost(pod("a", 32), 32 * BS, BS, W)
    assert full.usable_blocks == 31 and full.uncached_blocks == 1.0
    assert full.prefix == pytest.approx(2 / 32)  # one block of 32 to compute, weight 2


def test_cpu_tier_blocks_save_less_prefill_than_gpu_blocks() -> None:
    gpu = PodInputs("g", 16, 16.0, 0, 0, 0.0, 0)
    cpu = PodInputs("c", 16, 16 * 0.8, 0, 0, 0.0, 0)
    tokens = 32 * BS + 1
    assert pod_cost(gpu, tokens, BS, W).total < pod_cost(cpu, tokens, BS, W).total


def test_terms_are_work_in_units_of_the_prompts_prefill() -> None:
    tokens = 4 * BS
    idle = pod_cost(pod("a"), tokens, BS, W)
    assert (idle.prefix, idle.queue, idle.decode, idle.kv) == (2.0, 0.0, 0.0, 0.0)
    # Queue: the ledger's predicted prefill tokens, and one prompt per waiting request
    # the ledger does not account for (traffic kvindex did not route).
    ours = pod("a", waiting=1, flying=1, prefilling=1, queued=2 * tokens)
    assert pod_cost(ours, tokens, BS, W).queue == pytest.approx(2.0)
    assert pod_cost(pod("a", waiting=3), tokens, BS, W).queue == pytest.approx(3.0)
    # Decode: every request on the pod waits while this prompt's uncached tokens compute.
    assert pod_cost(pod("a", running=3), tokens, BS, W).decode == pytest.approx(3.0)
    assert pod_cost(pod("a", running=3, flying=5), tokens, BS, W).decode == pytest.approx(5.0)
    half = pod_cost(pod("a", matched=2, running=3), tokens, BS, W)
    assert (half.prefix, half.decode) == (pytest.approx(1.0), pytest.approx(1.5))
    assert pod_cost(pod("a", kv=0.25), tokens, BS, W).kv == pytest.approx(0.25)


def test_queued_work_counts_tokens_not_requests() -> None:
    """Three 5,000-token prefills queued weigh far more than three 50-token turns."""
    tokens = 3000
    long_ones = pod("a", waiting=3, flying=3, prefilling=3, queued=15_000)
    short_ones = pod("b", waiting=3, flying=3, prefilling=3, queued=150)
    decision = decide(Router(seed=0), [long_ones, short_ones], tokens=tokens)
    assert decision.pod == "b"
    costs = [c.terms.queue for c in decision.candidates]
    assert costs == [pytest.approx(5.0), pytest.approx(0.05)]


def test_a_shared_preamble_stops_drawing_new_sessions_to_a_busy_pod() -> None:
    """An agent's 4,500-token preamble cached on one pod, a new task of 8,500 tokens:
    the preamble pod wins while quiet, a cold pod once the decodes the task's 4,000-token
    prefill would stall there (3 running) outweigh the 4,500 tokens it saves. A
    session's next turn (1,700 uncached tokens of 10,200) stays with its cache until the
    stall it causes there outweighs recomputing the whole prompt on an idle pod (10
    running)."""
    tokens, preamble = 8500, 4500 // BS
    hot, cold = pod("hot", matched=preamble, running=2), pod("cold")
    assert decide(Router(seed=0), [hot, cold], tokens=tokens).pod == "hot"
    hot_busy = pod("hot", matched=preamble, running=3)
    assert decide(Router(seed=0), [hot_busy, cold], tokens=tokens).pod == "cold"
    turn, history = 10_200, 8_500 // BS
    home = pod("home", matched=history, running=9)
    assert decide(Router(seed=0), [home, pod("idle")], tokens=turn).pod == "home"
    home = pod("home", matched=history, running=11)
    assert decide(Router(seed=0), [home, pod("idle")], tokens=turn).pod == "idle"


def test_a_new_task_spreads_once_its_later_turns_would_stall_the_tasks_there() -> None:
    """The agent case of claim 2 (bench/README.md, "Routing comparison"): a 4,800-token
    new task whose 4,500-token preamble is cached on a pod running one task. Priced on
    its first prefill alone it joins that task; with the nine ~1,500-token tool results
    its session is expected to bring (F), each stalling the task there, it goes to the
    idle pod. F is the same on every pod: where the pods' R are equal it moves nothing,
    and a later turn stays with its history."""
    tokens, preamble = 4800, 4500 // BS
    hot, cold = pod("hot", matched=preamble, running=1), pod("cold")
    future = 9 * 1500.0
    assert decide(Router(seed=0), [hot, cold], tokens=tokens).pod == "hot"
    assert decide(Router(seed=0), [hot, cold], tokens=tokens, future=future).pod == "cold"
    terms = pod_cost(hot, tokens, BS, W, future_tokens=future)
    u = tokens - preamble * BS
    assert terms.decode == pytest.approx(1 * (u + future) / tokens)
    turn, history = 10_200, 8_500 // BS
    home, other = pod("home", matched=history, running=2), pod("other", running=2)
    assert decide(Router(seed=0), [home, other], tokens=turn, future=future).pod == "home"


def test_unknown_load_is_never_idle_and_grows_with_in_flight() -> None:
    idle = pod_cost(pod("a"), 64, BS, W)
    unknown = pod_cost(pod("a", waiting=None, kv=None), 64, BS, W)
    # a full cache, one prompt queued and one request running that the prefill stalls
    assert unknown.load == pytest.approx(3.0) and unknown.load > idle.load
    busier = pod_cost(pod("a", waiting=None, kv=None, flying=3), 64, BS, W)
    assert busier.load > unknown.load


def test_weights_are_validated() -> None:
    with pytest.raises(ValueError):
        CostWeights(prefix=-1)
    with pytest.raises(ValueError):
        CostWeights(decode=-0.5)


def decide(router: Router, pods, tokens=32 * BS + 1, fallback=None, kv_max=None, future=0.0):
    kv = kv_max if kv_max is not None else {p.pod: p.kv_usage for p in pods}
    return router.decide(pods, kv, tokens, BS, fallback, future)


def test_prefix_wins_at_equal_load_and_load_wins_on_a_busy_prefix_pod() -> None:
    router = Router(seed=1)
    chosen = decide(router, [pod("a", matched=16), pod("b"), pod("c")])
    assert (chosen.pod, chosen.reason) == ("a", Reason.PREFIX)
    busy = decide(router, [pod("a", matched=16, waiting=3, kv=0.8), pod("b"), pod("c", kv=0.1)])
    assert (busy.pod, busy.reason) == ("b", Reason.LOAD)
    assert [c.terms.usable_blocks for c in busy.candidates] == [16, 0, 0]


def test_the_longest_match_among_busy_pods_is_still_a_prefix_decision() -> None:
    # a's 8 extra blocks (a quarter of the prompt) win between two equally busy pods
    pods = [pod("a", matched=12, running=2), pod("b", matched=4, running=2)]
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
    assert not decision.saturated  # c has room
    none = decide(router, [pods[1], pod("d", kv=0.2, waiting=12)])
    assert (none.pod, none.reason) == (None, Reason.NO_CAPACITY)


def test_kv_usage_refuses_only_while_another_candidate_has_room() -> None:
    """Issue 28: at twice the cache-oblivious knee every pod's KV cache is full of
    running requests and vLLM queues what it cannot run. Refusing every pod then answered
    429s, and the caller's cache-blind fallback collapsed the hit ratio. With no KV room
    anywhere, every pod is admitted and the cost (the prefix) decides."""
    router = Router(admission=Admission(max_kv_usage=0.9, max_waiting=10), seed=0)
    full = [pod("a", matched=32, kv=0.99), pod("b", kv=0.97), pod("c", kv=0.95)]
    decision = decide(router, full)
    assert (decision.pod, decision.reason, decision.saturated) == ("a", Reason.PREFIX, True)
    assert all(c.refused is None for c in decision.candidates)
    # a pod with room: the full ones are refused as before
    roomy = decide(router, [*full, pod("d", kv=0.5)])
    assert (roomy.pod, roomy.saturated) == ("d", False)
    assert [c.refused is None for c in roomy.candidates] == [False, False, False, True]
    # room means under both limits: a pod over --max-waiting has none; an unknown load
    # is not room either (nothing says it has any)
    queued = decide(router, [*full, pod("d", kv=0.5, waiting=11), pod("e", waiting=None)])
    assert (queued.pod, queued.saturated) == ("a", True)
    assert "max-waiting" in queued.candidates[3].refused
    assert Admission(max_kv_usage=0.9).kv_limit([(None, 0), (0.95, 0)]) == math.inf
    # the default: KV usage refuses nobody, it only costs; nothing is "saturated"
    default = Router(admission=Admission(max_waiting=10), seed=0)
    off = decide(default, [pod("a", matched=32, kv=0.99), pod("b", kv=0.2)])
    assert (off.pod, off.reason, off.saturated) == ("a", Reason.PREFIX, False)
    assert all(c.refused is None for c in off.candidates)
    assert Admission().kv_limit([(0.2, 0)]) == math.inf and not Admission().saturated(math.inf)
    assert Admission(max_kv_usage=0.9).kv_limit([(0.95, 0), (0.9, 0)]) == 0.9


def test_admission_uses_the_fullest_engine_and_admits_unknown_load() -> None:
    router = Router(admission=Admission(max_kv_usage=0.9), seed=0)
    pods = [pod("a", kv=0.5), pod("b", waiting=None, kv=None), pod("c", kv=0.3)]
    decision = decide(router, pods, kv_max={"a": 0.95, "b": None, "c": 0.3})
    assert decision.pod == "c" and decision.candidates[1].refused is None
    assert "max-kv-usage" in decision.candidates[0].refused
    # without c no known pod has room: a is not refused, and the unknown pod, costed
    # busy, does not draw every request for want of an admitted rival
    decision = decide(router, pods[:2], kv_max={"a": 0.95, "b": None})
    assert (decision.pod, decision.saturated) == ("a", True)


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
    picks = [decide(router, pods, fallback=Reason.FALLBACK_BACKEND_DOWN) for _ in range(6)]
    assert {d.reason for d in picks} == {Reason.FALLBACK_BACKEND_DOWN}
    assert [d.pod for d in picks] == ["a", "b", "c", "a", "b", "c"]
    assert all(c.terms.prefix == 0 for c in picks[0].candidates)

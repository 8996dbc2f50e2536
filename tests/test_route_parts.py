"""/route's pure parts (no network): speculative entries, event lag, least-bad admission,
targets per data-parallel rank, and the P/D decision."""

from __future__ import annotations

import pytest

from kvindex.scoring.load import PodLoad, Unknown
from kvindex.scoring.load_metrics import EngineLoad
from kvindex.scoring.route.cost import PodInputs
from kvindex.scoring.route.decision import Admission, Reason, Router
from kvindex.scoring.route.event_lag import EventLag
from kvindex.scoring.route.inflight import InFlight
from kvindex.scoring.route.pd import Role, decide_pd, disaggregated, parse_role
from kvindex.scoring.route.speculative import SpeculativeIndex, annotate
from kvindex.scoring.route.targets import build_targets, member_rank
from kvindex.scoring.scorer import PodScore, ScoreResult
from tests.test_load import FakeClock

BS = 16
CHAIN = list(range(100, 140))  # 40 block keys of one prompt
OTHER = [7, 8, 9]  # a different chain


def test_speculative_prefix_is_the_routed_chain_until_its_ttl() -> None:
    clock = FakeClock()
    spec = SpeculativeIndex(ttl_s=2.0, clock=clock)
    spec.add("m", "a", CHAIN[:20])
    assert spec.prefixes("m", CHAIN, {}) == {"a": 20}
    assert spec.prefixes("m", CHAIN[:5], {}) == {"a": 5}  # a shorter prompt on the chain
    assert spec.prefixes("m", OTHER, {}) == {}
    assert spec.prefixes("other-model", CHAIN, {}) == {}
    clock.now += 2.0
    assert spec.prefixes("m", CHAIN, {}) == {}
    assert spec.outcomes() == {**zero(), "added": 1, "expired": 1}
    assert len(spec) == 0 and spec.blocks() == 0


def zero() -> dict[str, int]:
    return dict.fromkeys(("added", "confirmed", "superseded", "expired", "evicted"), 0)


def test_speculation_counts_only_past_the_confirmed_prefix_and_confirms() -> None:
    clock = FakeClock()
    spec = SpeculativeIndex(ttl_s=2.0, clock=clock)
    spec.add("m", "a", CHAIN[:20])
    assert spec.prefixes("m", CHAIN, {"a": 8}) == {"a": 12}  # events for 8 blocks so far
    # The events covered all 20 blocks: nothing is speculative any more.
    assert spec.prefixes("m", CHAIN, {"a": 20}) == {}
    assert spec.prefixes("m", CHAIN, {}) == {}  # the confirmed keys left the structure
    clock.now += 2.0
    assert spec.outcomes()["confirmed"] == 1 and spec.outcomes()["expired"] == 0


def test_a_longer_route_keeps_counting_past_a_confirmed_part() -> None:
    spec = SpeculativeIndex(ttl_s=2.0, clock=FakeClock())
    spec.add("m", "a", CHAIN[:10])
    spec.add("m", "a", CHAIN[:30])  # the conversation's next turn, routed again
    assert spec.prefixes("m", CHAIN, {"a": 10}) == {"a": 20}


def test_a_renewed_entry_is_superseded_and_the_bound_evicts_the_oldest() -> None:
    clock = FakeClock()
    spec = SpeculativeIndex(ttl_s=2.0, max_blocks=25, clock=clock)
    spec.add("m", "a", CHAIN[:10])
    clock.now += 1.0
    spec.add("m", "a", CHAIN[:10])  # a burst: the same prefix, same pod
    clock.now += 1.0  # the first entry's TTL ends; the second renewed its keys
    assert spec.prefixes("m", CHAIN, {}) == {"a": 10}
    assert spec.outcomes()["superseded"] == 1
    spec.add("m", "b", CHAIN[:20])  # 10 + 20 > 25: the oldest entry goes
    assert spec.outcomes()["evicted"] == 1
    assert spec.prefixes("m", CHAIN, {}) == {"b": 20}
    assert spec.blocks() == 20
    with pytest.raises(ValueError):
        SpeculativeIndex(ttl_s=-1)
    off = SpeculativeIndex(ttl_s=0)
    off.add("m", "a", CHAIN)
    assert off.prefixes("m", CHAIN, {}) == {} and off.outcomes()["added"] == 0


def test_annotate_shows_speculation_apart_from_confirmed_counts() -> None:
    spec = SpeculativeIndex(ttl_s=2.0, clock=FakeClock())
    spec.add("m", "a", CHAIN[:20])
    spec.add("m", "c", CHAIN[:4])
    result = ScoreResult("m", BS, 40 * BS, 40, [PodScore("a", 5, 80, 5, 0, 0, 5.0)], keys=CHAIN)
    extra = annotate(result, spec, ["a", "b"])
    assert extra == {"a": 15}  # c is not a candidate
    (a,) = result.pods
    assert (a.matched_blocks, a.score, a.speculative_blocks) == (5, 5.0, 15)
    result = ScoreResult("m", BS, 40 * BS, 40, [], keys=CHAIN)
    annotate(result, spec)
    # a's first 5 blocks were confirmed above and left the structure: a pod that no
    # longer holds them (evicted since) is not credited with them again.
    assert [(p.pod, p.matched_blocks, p.speculative_blocks) for p in result.pods] == [("c", 0, 4)]


def test_event_lag_counts_while_recent_and_per_pod() -> None:
    clock = FakeClock()
    lag = EventLag(window_s=10.0, clock=clock)
    lag.record("p:1", 0.2)
    lag.record("q:1/dp1", 12.0)
    assert lag.lagging(["p:1", "q:1"], 5.0) == {"q:1": 12.0}
    assert lag.lagging(["p:1", "q:1"], 0.0) == {}  # 0: off
    assert lag.lagging(["p:1"], 5.0) == {}
    clock.now += 11.0  # quiet since: caught up
    assert lag.lagging(["q:1"], 5.0) == {} and lag.current() == {}
    lag.record("q:1/dp1", 12.0)
    lag.forget("q:1/dp1")
    assert lag.current() == {}


def inputs(name: str, matched: int = 0, waiting: int | None = 0, kv: float | None = 0.0):
    return PodInputs(name, matched, float(matched), 0, waiting, kv, 0)


def test_least_bad_chooses_the_cheapest_when_none_is_admitted() -> None:
    pods = [inputs("a", 16, waiting=12, kv=0.99), inputs("b", waiting=11, kv=0.97)]
    kv_max = {"a": 0.99, "b": 0.97}
    admission = Admission(max_kv_usage=0.9, max_waiting=10)
    strict = Router(admission=admission, seed=0)
    assert strict.decide(pods, kv_max, 32 * BS + 1, BS).reason is Reason.NO_CAPACITY
    lenient = Router(admission=admission, seed=0, least_bad=True)
    decision = lenient.decide(pods, kv_max, 32 * BS + 1, BS)
    assert (decision.pod, decision.reason) == ("a", Reason.LEAST_BAD)
    assert all(c.refused for c in decision.candidates)
    fallback = lenient.decide(pods, kv_max, 32 * BS + 1, BS, Reason.FALLBACK_BACKEND_DOWN)
    assert (fallback.pod, fallback.reason) == ("b", Reason.LEAST_BAD)  # load only: b


def pod_load(pod: str, engines: dict[str, EngineLoad]) -> PodLoad:
    waiting = sum(e.waiting for e in engines.values())
    usage = [e.kv_usage for e in engines.values() if e.kv_usage is not None]
    mean = sum(usage) / len(usage) if usage else None
    return PodLoad(pod, 0, waiting, mean, max(usage, default=None), engines, 0.1)


def test_each_data_parallel_rank_is_costed_on_its_own_prefix_and_load() -> None:
    loads = {
        "p:1": pod_load("p:1", {"0": EngineLoad(0, 9, 0.7), "1": EngineLoad(0, 0, 0.1)}),
        "q:1": Unknown("q:1", "not_scraped", None, None),
    }
    matches = {"p:1/dp2": PodScore("p:1/dp2", 6, 96, 6, 0, 0, 6.0)}
    targets = build_targets(["p:1", "q:1"], matches, {"q:1": 3}, loads, {"p:1/dp1": InFlight(2)})
    got = [
        (t.member, t.rank, t.inputs.waiting, t.inputs.kv_usage, t.inputs.in_flight) for t in targets
    ]
    assert got == [
        ("p:1", 0, 9, 0.7, 0),
        ("p:1/dp1", 1, 0, 0.1, 2),
        ("p:1/dp2", 2, 9, pytest.approx(0.4), 0),  # no engine 2 on the page: the pod's totals
        ("q:1", 0, None, None, 0),
    ]
    q = targets[-1]
    assert (q.confirmed_blocks, q.speculative_blocks, q.inputs.matched_blocks) == (0, 3, 3)
    assert member_rank("p:1/dp12") == 12 and member_rank("p:1") == 0
    router = Router(seed=0)
    decision = router.decide(
        [t.inputs for t in targets[:2]], {t.member: t.kv_usage_max for t in targets}, 64, BS
    )
    assert decision.pod == "p:1/dp1"  # the idle rank of the same pod


def test_pd_skips_the_prefill_pod_when_little_is_uncached() -> None:
    idle = {"0": EngineLoad(0, 0, 0.0)}
    pods = ["d:1", "p:1", "p:2"]
    loads = {p: pod_load(p, idle) for p in pods}
    roles = {"d:1": Role.DECODE, "p:1": Role.PREFILL, "p:2": Role.PREFILL}
    assert disaggregated(roles, pods) and not disaggregated({"d:1": Role.BOTH}, pods)
    tokens = 40 * BS + 1
    matches = {"p:2": PodScore("p:2", 30, 480, 30, 0, 0, 30.0)}
    targets = build_targets(pods, matches, {}, loads, {})
    router = Router(seed=0)
    pd = decide_pd(router, targets, roles, tokens, BS, None, threshold_tokens=256)
    assert pd.decode.pod == "d:1" and pd.prefill is not None and pd.prefill.pod == "p:2"
    assert pd.prefill.reason is Reason.PREFIX and pd.local_why is None
    # The decode pod holds all but 10 blocks' worth: it prefills the rest itself.
    matches["d:1"] = PodScore("d:1", 38, 608, 38, 0, 0, 38.0)
    targets = build_targets(pods, matches, {}, loads, {})
    pd = decide_pd(router, targets, roles, tokens, BS, None, threshold_tokens=256)
    assert pd.decode.pod == "d:1" and pd.prefill is None and "pd-threshold" in pd.local_why
    with pytest.raises(ValueError, match="prefill, decode or both"):
        parse_role("prefil")
    assert parse_role(" Decode") is Role.DECODE

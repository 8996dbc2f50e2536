"""Faulty pods stop drawing traffic (issue 27): the ejection rules of
scoring/route/outlier.py as pure functions, the detector's percentage bound and probes, the
router's preference for pods not ejected, and the cost of a pod whose load is unknown
(never lighter than the busiest known candidate's). The same rules through a running
``kvindex serve --gateway`` with faulty pods: tests/test_gateway_faulty.py."""

from __future__ import annotations

import pytest

from kvindex.scoring.route.cost import CostWeights, PodInputs, pod_costs
from kvindex.scoring.route.decision import Reason, Router
from kvindex.scoring.route.outlier import (
    HEALTHY,
    MAX_EJECTION_S,
    EjectionPolicy,
    Outcome,
    OutlierDetector,
    judge,
    standing,
)

POLICY = EjectionPolicy(eject_after=2, base_s=10.0, max_percent=50.0)


def test_consecutive_failures_eject_and_a_good_answer_forgets_them() -> None:
    once = judge(HEALTHY, Outcome.HTTP_5XX, 0.0, POLICY)
    assert standing(once, 0.0) is None and once.failures == 1
    assert judge(once, Outcome.OK, 1.0, POLICY) is HEALTHY
    twice = judge(once, Outcome.CONNECT_ERROR, 1.0, POLICY)
    assert standing(twice, 1.0) == "ejected" and twice.ejected_until == 11.0
    assert twice.last_failure == "connect_error"


def test_late_answers_of_requests_sent_before_the_ejection_change_nothing() -> None:
    out = judge(judge(HEALTHY, Outcome.TIMEOUT, 0.0, POLICY), Outcome.TIMEOUT, 0.0, POLICY)
    assert judge(out, Outcome.OK, 5.0, POLICY) is out
    assert judge(out, Outcome.HTTP_5XX, 5.0, POLICY) is out


def test_a_failed_probe_ejects_again_for_longer_up_to_the_cap() -> None:
    health, now = HEALTHY, 0.0
    lengths = []
    for _ in range(40):
        health = judge(health, Outcome.CONNECT_ERROR, now, POLICY)
        if standing(health, now) == "ejected":
            lengths.append(health.ejected_until - now)
            now = health.ejected_until  # the ejection ends: the next request is a probe
            assert standing(health, now) is None
    assert lengths[:3] == [10.0, 20.0, 30.0]  # one failure on probation is enough
    assert max(lengths) == MAX_EJECTION_S
    assert judge(health, Outcome.OK, now, POLICY) is HEALTHY  # the probe answered


def test_zero_never_ejects() -> None:
    never = EjectionPolicy(eject_after=0)
    health = HEALTHY
    for _ in range(10):
        health = judge(health, Outcome.HTTP_5XX, 0.0, never)
    assert standing(health, 0.0) is None


def test_the_detector_grants_one_probe_and_bounds_the_ejected_share() -> None:
    now = [0.0]
    detector = OutlierDetector(EjectionPolicy(1, 10.0, 50.0), clock=lambda: now[0])
    pods = ["a", "b", "c", "d"]
    detector.report("a", Outcome.CONNECT_ERROR)
    assert list(detector.excluded(pods)) == ["a"]
    assert "connect_error" in detector.excluded(pods)["a"]
    now[0] = 1.0
    for pod in ("b", "c"):
        detector.report(pod, Outcome.HTTP_5XX)
    assert set(detector.excluded(pods)) == {"b", "c"}  # 50% of 4: the latest two
    assert detector.excluded(["c"]) == {"c": detector.excluded(["c"])["c"]}  # at least one
    now[0] = 10.5  # a's ejection is over: one decision may send it a probe
    assert "a" not in detector.excluded(["a"])
    assert "probing" in detector.excluded(["a"])["a"]  # the next ones wait for its answer
    detector.report("a", Outcome.OK)
    assert "a" not in detector.excluded(["a"])
    assert detector.ejections == 3


def inputs(pod: str, waiting: int | None, running: int | None = 0, matched: int = 0):
    return PodInputs(pod, matched, float(matched), running, waiting, 0.5, 0)


def test_the_router_chooses_an_ejected_pod_only_when_every_admitted_one_is() -> None:
    router = Router(seed=1)
    pods = [inputs("cache", 0, matched=30), inputs("other", 3)]
    assert router.decide(pods, {}, 32 * 16 + 1, 16).pod == "cache"
    assert router.decide(pods, {}, 32 * 16 + 1, 16, excluded={"cache"}).pod == "other"
    chosen = router.decide(pods, {}, 32 * 16 + 1, 16, excluded={"cache", "other"})
    assert chosen.pod == "cache" and chosen.reason is Reason.PREFIX


@pytest.mark.parametrize("tokens", [1, 17, 2_000])
def test_unknown_load_is_never_lighter_than_the_busiest_known_pod(tokens: int) -> None:
    pods = [inputs("idle", 0), inputs("busy", 40, running=60), inputs("dead", None, None)]
    idle, busy, dead = pod_costs(pods, tokens, 16, CostWeights())
    assert dead.load >= busy.load > idle.load
    assert dead.total >= busy.total

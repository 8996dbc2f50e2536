"""The /route decision and its state without HTTP (scoring/route/routing.py): a decision enters
its route in the ledger and its prompt's blocks as speculative entries, a route's first
token and end release them, a failed answer reaches the pod's record, and the counts
/metrics exports follow the decisions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pytest

from kvindex.scoring.load import PodLoad, Unknown
from kvindex.scoring.route.decision import Admission, Reason, Router
from kvindex.scoring.route.event_lag import EventLag
from kvindex.scoring.route.inflight import InFlightLedger
from kvindex.scoring.route.outlier import EjectionPolicy, Outcome, OutlierDetector
from kvindex.scoring.route.pd import Role
from kvindex.scoring.route.routing import IndexView, NoRoom, Routing
from kvindex.scoring.route.speculative import SpeculativeIndex
from kvindex.scoring.scorer import PodScore

BS = 16


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Ask:
    model: str = "m"
    request_id: str | None = None
    max_tokens: int | None = None
    role: str | None = None
    session_id: str | None = None


class FixedLoads:
    """Scraped loads, as a LoadView's snapshot gives them."""

    def __init__(self, loads: Mapping[str, PodLoad | Unknown]) -> None:
        self._loads = loads

    def snapshot(self, pods: Iterable[str]) -> dict[str, PodLoad | Unknown]:
        return {pod: self._loads[pod] for pod in pods}


def idle(pod: str, waiting: int = 0) -> PodLoad:
    return PodLoad(pod, 0, waiting, 0.1, 0.1, {}, 100.0)


def make_routing(
    loads: Mapping[str, PodLoad | Unknown],
    *,
    router: Router | None = None,
    roles: Mapping[str, Role] | None = None,
    sessions: Mapping[str, str] | None = None,
    event_lag: EventLag | None = None,
) -> Routing:
    clock = FakeClock()
    where = dict(sessions or {})  # session id -> member, for model "m"
    return Routing(
        router or Router(seed=0),
        FixedLoads(loads),  # type: ignore[arg-type]
        InFlightLedger(clock),
        SpeculativeIndex(ttl_s=2.0, clock=clock),
        OutlierDetector(EjectionPolicy(), clock),
        event_lag or EventLag(clock=clock),
        lambda: roles or {},
        route_ttl=60.0,
        pd_threshold=0,
        sessions=lambda model, session: where.get(session) if model == "m" else None,
    )


def row(*fields: object) -> tuple[object, ...]:
    return fields


def view_of(keys: list[int], matches: dict[str, int]) -> IndexView:
    scores = {pod: PodScore(pod, n, n * BS, n, 0, 0, float(n)) for pod, n in matches.items()}
    return IndexView(len(keys) * BS, list(keys), scores)


def test_a_decision_is_entered_and_its_route_released() -> None:
    routing = make_routing({"a": idle("a"), "b": idle("b")})
    keys = [11, 12, 13, 14]
    routed = routing.decide(Ask(request_id="r1"), ["a", "b"], view_of(keys, {"a": 2}), BS, row)
    assert (routed.route_id, routed.pod, routed.reason) == ("r1", "a", Reason.PREFIX)
    assert [r[0] for r in routed.rows] == ["a", "b"] and not routed.pd
    # In flight on a, with the prompt past its 2 reusable blocks queued as prefill.
    flying = routing.ledger.all()["a"]
    assert (flying.requests, flying.prefilling, flying.prefill_tokens) == (1, 1, 2 * BS)
    # Its blocks past the confirmed prefix count on a until a's events confirm them.
    assert routing.speculative.prefixes("m", keys, {"a": 2}) == {"a": 2}
    assert routing.first_token("r1") == "a"
    assert routing.ledger.all()["a"].prefill_tokens == 0
    assert routing.done("r1", Outcome.HTTP_5XX) == "a"
    assert routing.ledger.all() == {}
    assert "a" in routing.outliers.excluded(["a", "b"])  # the failure ejected it
    assert routing.done("r1") is None and routing.first_token("r1") is None
    assert routing.decision_counts() == {Reason.PREFIX: 1}


def test_no_admissible_pod_is_no_room_counted_and_not_entered() -> None:
    router = Router(admission=Admission(max_waiting=2), seed=0)
    routing = make_routing({"a": idle("a", 5), "b": idle("b", 9)}, router=router)
    with pytest.raises(NoRoom) as refused:
        routing.decide(Ask(), ["a", "b"], view_of([1, 2], {}), BS, row)
    assert "a: 5 waiting, more than --max-waiting 2" in refused.value.refused
    assert routing.ledger.all() == {} and len(routing.speculative) == 0
    assert routing.decision_counts() == {Reason.NO_CAPACITY: 1}


def test_pd_enters_both_legs_and_the_first_token_ends_the_prefill_leg() -> None:
    roles = {"p": Role.PREFILL, "d": Role.DECODE}
    routing = make_routing({"p": idle("p"), "d": idle("d")}, roles=roles)
    routed = routing.decide(Ask(request_id="r"), ["p", "d"], view_of([1, 2, 3, 4], {}), BS, row)
    assert routed.pd and (routed.pod, routed.prefill_pod) == ("d", "p")
    assert set(routing.ledger.all()) == {"d", "p"}
    assert routing.prefill_counts() == {"remote": 1}
    assert routing.first_token("r") == "d"
    assert set(routing.ledger.all()) == {"d"}  # the prefill pod's share ended
    assert routing.done("r") == "d" and routing.ledger.all() == {}


def unscored(reason: Reason = Reason.FALLBACK_MULTIMODAL, **doubts: str) -> IndexView:
    return IndexView(0, fallback=reason, doubts=doubts)


def busy(pod: str, kv_usage: float = 0.6) -> PodLoad:
    return PodLoad(pod, 0, 0, kv_usage, kv_usage, {}, 100.0)


def test_an_unscored_turn_goes_to_its_sessions_pod() -> None:
    """A load-only decision would take the idle pod b; the session last ran on a."""
    routing = make_routing({"a": busy("a"), "b": idle("b")}, sessions={"chat": "a"})
    for fallback in (
        Reason.FALLBACK_MULTIMODAL,
        Reason.FALLBACK_UNTOKENIZABLE,
        Reason.FALLBACK_TOKENIZER_UNAVAILABLE,
    ):
        routed = routing.decide(Ask(session_id="chat"), ["a", "b"], unscored(fallback), BS, row)
        assert (routed.pod, routed.reason) == ("a", Reason.SESSION)
    # No session id, an unknown one, or a fallback where the prompt was never the issue
    routed = routing.decide(Ask(), ["a", "b"], unscored(), BS, row)
    assert (routed.pod, routed.reason) == ("b", Reason.FALLBACK_MULTIMODAL)
    routed = routing.decide(Ask(session_id="other"), ["a", "b"], unscored(), BS, row)
    assert (routed.pod, routed.reason) == ("b", Reason.FALLBACK_MULTIMODAL)
    down = unscored(Reason.FALLBACK_BACKEND_DOWN)
    routed = routing.decide(Ask(session_id="chat"), ["a", "b"], down, BS, row)
    assert (routed.pod, routed.reason) == ("b", Reason.FALLBACK_BACKEND_DOWN)
    assert routing.decision_counts()[Reason.SESSION] == 3
    # A doubt that keeps a pod's prefix credit keeps its session: late events still say
    # truly where the session ran.
    routed = routing.decide(Ask(session_id="chat"), ["a", "b"], unscored(a="lagging"), BS, row)
    assert (routed.pod, routed.reason) == ("a", Reason.SESSION)


def test_a_session_never_outweighs_a_prefix() -> None:
    """A prompt the index can read is decided by its cost: b holds its prefix."""
    routing = make_routing({"a": idle("a"), "b": idle("b")}, sessions={"chat": "a"})
    view = view_of([1, 2, 3, 4], {"b": 3})
    routed = routing.decide(Ask(session_id="chat"), ["a", "b"], view, BS, row)
    assert (routed.pod, routed.reason) == ("b", Reason.PREFIX)


@pytest.mark.parametrize("case", ["doubted", "ejected", "unknown_load", "restarted", "refused",
                                  "saturated", "not_a_candidate"])  # fmt: skip
def test_the_sessions_pod_is_not_taken_when_it_cannot_be_trusted_or_serve(case: str) -> None:
    loads: dict[str, PodLoad | Unknown] = {"a": busy("a"), "b": idle("b"), "c": idle("c")}
    router, view, lag = Router(seed=0), unscored(), EventLag()
    pods = ["a", "b"]
    if case == "doubted":  # its entries earn no credit: lost batches may have cleared it
        view = unscored(a="gapped")
    elif case == "unknown_load":
        loads["a"] = Unknown("a", "not_scraped", "refused", None)
    elif case == "restarted":  # its server started after the last batch heard from it
        lag.record("a", 0.0, ts=50.0)
        loads["a"] = PodLoad("a", 0, 0, 0.6, 0.6, {}, 100.0, started=60.0)
    elif case == "refused":
        router = Router(admission=Admission(max_kv_usage=0.5), seed=0)
    elif case == "saturated":  # no pod has KV room: the session is no reason to add to a
        router = Router(admission=Admission(max_kv_usage=0.5), seed=0, least_bad=True)
        loads["b"] = busy("b", 0.7)
    elif case == "not_a_candidate":
        pods = ["b", "c"]
    routing = make_routing(loads, router=router, sessions={"chat": "a"}, event_lag=lag)
    if case == "ejected":
        routing.decide(Ask(request_id="failed"), ["a"], unscored(), BS, row)
        routing.done("failed", Outcome.HTTP_5XX)
    routed = routing.decide(Ask(session_id="chat"), pods, view, BS, row)
    assert routed.reason is Reason.FALLBACK_MULTIMODAL
    assert routed.pod != "a" or case == "saturated"

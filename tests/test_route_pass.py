"""The one-pass /route decision (scoring/route/one_pass.py) against the general path
(routing targets, Router.decide, then the answer rows), over random fleets.

Both paths must choose the same pod for the same reason and give the same rows, float
for float, request after request: two routers with the same seed, one per path, so a
tie broken differently, or drawn from the RNG a different number of times, shows up in
a later decision too. The fleets mix every load state (known, pending, not scraped,
stale), KV usage past the admission limit, long queues, tier-weighted matches,
speculative blocks, in-flight routes, tiny prompts, load-only fallbacks and least-bad
routing, and pods that restarted unheard (their server started after the last batch
the index applied from them: the one-pass loop leaves their entries out, the general
path is given them already left out, as ``scoring/route/routing.py`` does). Fleets with
data-parallel ranks must be left to the general path. The candidate loop runs both
compiled (``scoring/route/_route_pass.c``) and in Python.
"""

from __future__ import annotations

import random

import msgspec
import pytest

from kvindex.api.http.schemas import RouteCandidate
from kvindex.scoring.load import PodLoad, Unknown
from kvindex.scoring.load_metrics import EngineLoad
from kvindex.scoring.route import one_pass as route_pass
from kvindex.scoring.route.cost import CostWeights
from kvindex.scoring.route.decision import Admission, Reason, Router
from kvindex.scoring.route.event_lag import Lag
from kvindex.scoring.route.inflight import InFlight
from kvindex.scoring.route.one_pass import one_pass
from kvindex.scoring.route.routing import target_rows
from kvindex.scoring.route.targets import build_targets
from kvindex.scoring.scorer import PodScore

BS = 16


LOOPS = ["compiled", "python"]


@pytest.fixture(params=LOOPS)
def loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The candidate loop under test: the compiled one, or the Python one."""
    if request.param == "python":
        monkeypatch.setattr(route_pass, "compiled", None)
    elif route_pass.compiled is None:
        pytest.skip("scoring/route/_route_pass.c was not built (no C compiler)")
    return request.param


def fleet(rng: random.Random, pods: list[str], prompt_blocks: int):
    """Loads, matches, speculative blocks, in-flight routes and the index's last batch
    per pod (its engine timestamp) for ``pods``."""
    loads: dict[str, PodLoad | Unknown] = {}
    matches: dict[str, PodScore] = {}
    speculative: dict[str, int] = {}
    in_flight: dict[str, InFlight] = {}
    heard: dict[str, Lag] = {}
    for pod in pods:
        requests = rng.choice([0, 0, 1, 3])
        prefilling = rng.randrange(requests + 1)
        sessions = rng.choice([0.0, 0.0, 0.75, 2.5, 7.0])  # homed between turns
        flying = InFlight(requests, rng.randrange(100), prefilling, prefilling * 700, sessions)
        if flying.requests or flying.sessions:
            in_flight[pod] = flying
        kind = rng.random()
        if kind < 0.6:
            kv = rng.choice([None, 0.0, 0.3, 0.3, 0.96, 1.2, -0.1])
            waiting = rng.choice([0, 0, 2, 9, 40])
            engines = {"0": EngineLoad(1, waiting, kv)} if rng.random() < 0.5 else {}
            kv_max = None if kv is None else max(kv, rng.choice([kv, 0.97]))
            started = rng.choice([None, 1000.0])
            loads[pod] = PodLoad(pod, rng.randrange(5), waiting, kv, kv_max, engines, 0.2, started)
        else:
            reason = rng.choice(["pending", "not_scraped", "stale"])
            loads[pod] = Unknown(pod, reason, None, None if reason == "pending" else 4.0)
        if rng.random() < 0.7:
            n = rng.choice([1, 5, prompt_blocks // 2, prompt_blocks, prompt_blocks + 3])
            n = max(1, n)
            gpu = rng.randrange(n + 1)
            score = round(gpu + (n - gpu) * 0.8, 6)
            matches[pod] = PodScore(pod, n, n * BS, gpu, n - gpu, 0, score)
        if rng.random() < 0.2:
            speculative[pod] = rng.randrange(1, 20)
        if rng.random() < 0.8:  # before the server started (restarted unheard) or after
            heard[pod] = Lag(0.01, 5.0, rng.choice([None, 990.0, 1000.0, 1010.0]))
    return loads, matches, speculative, in_flight, heard


def unheard(loads, heard, matches, speculative) -> set[str]:
    """The pods that restarted unheard, left out of ``matches`` and ``speculative`` as
    ``scoring/route/routing.py`` leaves them out before the general path."""
    out = set()
    for pod, load in loads.items():
        lag = heard.get(pod)
        started = load.started if isinstance(load, PodLoad) else None
        if started is None or lag is None or lag.ts is None or lag.ts >= started:
            continue
        if pod in matches or pod in speculative:
            out.add(pod)
            matches.pop(pod, None)
            speculative.pop(pod, None)
    return out


def general(
    router: Router, pods, loads, matches, speculative, in_flight, tokens, fallback, future,
    excluded=frozenset(),
):  # fmt: skip
    """What the general path (scoring/route/routing.py) decides and answers (no P/D, no role)."""
    targets = build_targets(pods, matches, speculative, loads, in_flight)
    decision = router.decide(
        [t.inputs for t in targets],
        {t.member: t.kv_usage_max for t in targets},
        tokens,
        BS,
        fallback,
        future,
        excluded,
    )
    rows = target_rows(decision, None, {t.member: t for t in targets}, {}, RouteCandidate)
    return decision.pod, decision.reason, rows, decision.saturated


@pytest.mark.parametrize("seed", range(6))
def test_one_pass_decides_and_answers_as_the_general_path(seed: int, loop: str) -> None:
    rng = random.Random(seed)
    # every pairing of a waiting limit (or none) with least_bad or 429
    admission = Admission(max_kv_usage=0.95, max_waiting=(0, 10)[seed // 2 % 2])
    weights = CostWeights(*rng.choice([(1.0, 1.0, 1.0, 1.0), (0.0, 1.0, 0.5, 2.0)]))
    least_bad = seed % 2 == 1
    fast = Router(weights, admission, seed=seed, least_bad=least_bad)
    slow = Router(weights, admission, seed=seed, least_bad=least_bad)
    reasons = set()
    restarted = saturated = 0
    for step in range(150):
        pods = [f"10.0.{step % 3}.{i}:8000" for i in range(rng.choice([1, 2, 7, 64]))]
        prompt_blocks = rng.choice([1, 4, 32, 512])
        tokens = prompt_blocks * BS + rng.choice([0, 1, -BS + 1])
        loads, matches, speculative, in_flight, heard = fleet(rng, pods, prompt_blocks)
        if rng.random() < 0.3:  # equal pods: ties, broken by the RNG
            loads = {p: PodLoad(p, 0, 0, 0.1, 0.1, {}, 0.1) for p in pods}
            matches, speculative, in_flight = {}, {}, {}
        fallback = rng.choice([None, None, None, Reason.FALLBACK_BACKEND_DOWN])
        future = rng.choice([0.0, 0.0, 1.0, 733.25, 13_500.0])  # later turns' prefill
        # pods ejected after failures (scoring/route/outlier.py): all, some or none
        excluded = set(rng.sample(pods, rng.choice([0, 0, 1, len(pods)])))
        done = one_pass(
            fast, pods, dict(matches), dict(speculative), loads, in_flight, tokens, BS,
            fallback, RouteCandidate, heard, future, excluded,
        )  # fmt: skip
        dropped = unheard(loads, heard, matches, speculative)
        want = general(
            slow, pods, loads, matches, speculative, in_flight, tokens, fallback, future, excluded
        )
        assert done is not None
        assert set(done.dropped) == dropped, f"step {step}"
        pod = None if done.chosen is None else pods[done.chosen]
        assert (pod, done.reason, done.rows, done.saturated) == want, f"step {step}"
        saturated += done.saturated
        if done.chosen is not None:
            assert done.confirmed == (matches[pod].matched_blocks if pod in matches else 0)
            assert done.usable == done.rows[done.chosen].usable_blocks
        assert done.refused == [f"{r.pod}: {r.refused}" for r in done.rows if r.refused]
        reasons.add(done.reason)
        restarted += len(dropped)
    assert Reason.PREFIX in reasons and Reason.LOAD in reasons  # both kinds were decided
    assert restarted  # some pods restarted unheard
    assert saturated  # some decisions found no KV room and admitted every pod
    if admission.max_waiting:
        assert (Reason.LEAST_BAD if least_bad else Reason.NO_CAPACITY) in reasons
    else:  # KV usage alone never leaves no pod admissible
        assert not {Reason.LEAST_BAD, Reason.NO_CAPACITY} & reasons


def test_pods_with_data_parallel_ranks_take_the_general_path(loop: str) -> None:
    router = Router(seed=1)
    pod = "10.0.0.1:8000"
    two_engines = PodLoad(
        pod, 0, 0, 0.1, 0.1, {"0": EngineLoad(0, 0, 0.1), "1": EngineLoad(0, 0, 0.1)}, 0.1
    )
    one_engine = PodLoad(pod, 0, 0, 0.1, 0.1, {}, 0.1)
    rank = PodScore(f"{pod}/dp1", 3, 48, 3, 0, 0, 3.0)
    cases = [
        ({pod: two_engines}, {}, {}),  # ranks from the metrics page
        ({pod: one_engine}, {rank.pod: rank}, {}),  # a rank's index entries
        ({pod: one_engine}, {}, {f"{pod}/dp2": 4}),  # a rank's speculative entries
    ]
    for loads, matches, speculative in cases:
        args = ([pod], matches, speculative, loads, {}, 64, BS, None, RouteCandidate)
        assert one_pass(router, *args) is None


BIG = route_pass.COUNT_MAX
EXTREME_COUNTS = [0, 3, BIG, BIG + 1, 2**63, 2**64 + 5, 10**30, -5]


def extreme_fleet(rng: random.Random, pods: list[str]):
    """A fleet whose counts are far past anything real (2^63, 10^30, negative): what a
    figure that got past the scraper's and the request's checks would look like."""
    loads: dict[str, PodLoad | Unknown] = {}
    matches: dict[str, PodScore] = {}
    speculative: dict[str, int] = {}
    in_flight: dict[str, InFlight] = {}
    for pod in pods:
        count = lambda: rng.choice(EXTREME_COUNTS)  # noqa: E731
        kv = rng.choice([None, 0.5, 1e30, -1e30, float("inf")])
        if rng.random() < 0.8:
            loads[pod] = PodLoad(pod, count(), count(), kv, kv, {}, 0.2, None)
        else:
            loads[pod] = Unknown(pod, rng.choice(["pending", "stale"]), None, None)
        if rng.random() < 0.7:
            matches[pod] = PodScore(pod, count(), 0, 0, 0, 0, float(rng.choice([0, 3, 1e30])))
        if rng.random() < 0.3:
            speculative[pod] = count()
        if rng.random() < 0.7:
            in_flight[pod] = InFlight(count(), count(), count(), count(), rng.choice([0.0, 1e30]))
    return loads, matches, speculative, in_flight


@pytest.mark.parametrize("seed", range(4))
def test_extreme_counts_neither_overflow_nor_split_the_compiled_and_python_loops(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26: a pod page saying 1e30 requests running made the compiled loop raise
    OverflowError (a 500 for every /route naming the pod). Both loops clamp a count to
    0..COUNT_MAX, so neither raises and both still give the same rows."""
    if route_pass.compiled is None:
        pytest.skip("scoring/route/_route_pass.c was not built (no C compiler)")
    rng = random.Random(seed)
    admission = Admission(max_kv_usage=0.95, max_waiting=rng.choice([0, 10]))
    compiled_router = Router(CostWeights(), admission, seed=seed, least_bad=True)
    python_router = Router(CostWeights(), admission, seed=seed, least_bad=True)
    for step in range(60):
        pods = [f"10.0.0.{i}:8000" for i in range(rng.choice([1, 3, 9]))]
        tokens = rng.choice([0, 1, 17, 262_144])
        loads, matches, speculative, in_flight = extreme_fleet(rng, pods)
        fallback = rng.choice([None, Reason.FALLBACK_BACKEND_DOWN])
        args = (pods, matches, speculative, loads, in_flight, tokens, BS, fallback, RouteCandidate)
        fast = one_pass(compiled_router, *args, {}, 1e30)
        with monkeypatch.context() as patch:
            patch.setattr(route_pass, "compiled", None)
            slow = one_pass(python_router, *args, {}, 1e30)
        assert fast is not None and slow is not None
        assert (fast.chosen, fast.reason, fast.refused) == (slow.chosen, slow.reason, slow.refused)
        for mine, theirs in zip(fast.rows, slow.rows, strict=True):
            assert msgspec.json.encode(mine) == msgspec.json.encode(theirs), f"step {step}"
        for row in fast.rows:
            assert all(
                0 <= getattr(row, name) <= route_pass.COUNT_MAX
                for name in ("matched_blocks", "speculative_blocks", "in_flight", "queued_tokens")
            )

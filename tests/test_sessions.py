"""Sessions between turns (``scoring/route/sessions.py``) and how the in-flight ledger counts
them: a finished route homes its session on its pod, the session's next prompt claims
the home, and a pod's count is its homes times the share of sessions seen to return."""

from __future__ import annotations

import pytest

from kvindex.indexer.keys import BlockHasher, HashConfig
from kvindex.scoring.route import sessions
from kvindex.scoring.route.inflight import InFlight, InFlightLedger
from kvindex.scoring.route.sessions import SessionHomes

HASHER = BlockHasher(HashConfig())


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def turns(session: int, count: int) -> list[list[int]]:
    """The block keys of ``count`` turns of one chat: each turn's prompt is the previous
    prompt, its answer and a new message (vLLM's hash chain, real keys)."""
    history: list[int] = []
    out = []
    for turn in range(count):
        history += [session * 100_000 + turn * 1_000 + i for i in range(40)]  # 2.5 blocks
        out.append(HASHER.keys(history))
    return out


def serve(
    ledger: InFlightLedger, pod: str, route_id: str, keys: list[int], prefill: int = 0
) -> None:
    """One request through the ledger as ``/route`` enters it: arrive, begin, done."""
    continues = ledger.arrive(keys)
    ledger.begin(pod, route_id, len(keys), 60, prefill, keys[-1], continues=continues)
    ledger.done(route_id)


def test_a_later_turn_holds_the_earlier_prompts_last_block() -> None:
    first, second, third = turns(1, 3)
    assert first[-1] in second and second[-1] in third
    assert not set(turns(2, 1)[0]) & set(first)


def test_a_finished_route_homes_its_session_until_the_next_turn_claims_it() -> None:
    clock = Clock()
    ledger = InFlightLedger(clock)
    a1, a2, a3 = turns(1, 3)
    serve(ledger, "p", "a1", a1)
    # A home counts as the share of homes seen to return: none seen yet, so 0.
    assert len(ledger.homes) == 1 and ledger.of("p") == InFlight()
    clock.now += 2.0
    serve(ledger, "p", "a2", a2)  # claims a1's home, leaves its own
    assert ledger.homes.returning == 1.0  # one gap seen: too few to shorten the wait
    assert ledger.homes.wait_s == sessions.FIRST_WAIT_S
    assert ledger.of("p") == InFlight(sessions=1.0)
    # The next turn is routed to another pod: the home on p is claimed before the
    # decision (it must not count against the pod the session returns to).
    ledger.arrive(a3)
    assert ledger.all() == {}
    ledger.begin("q", "a3", len(a3), ttl_s=60, tail=a3[-1])
    assert ledger.all() == {"q": InFlight(1, len(a3), 1)}
    ledger.done("a3")
    assert ledger.all() == {"q": InFlight(sessions=1.0)}


def test_a_session_that_never_returns_is_forgotten_and_lowers_the_returning_share() -> None:
    clock = Clock()
    ledger = InFlightLedger(clock)
    first, second = turns(1, 2)
    serve(ledger, "p", "t1", first)
    clock.now += 1.0
    serve(ledger, "p", "t2", second)  # one return seen: the wait stays the first one
    other = turns(2, 1)[0]
    serve(ledger, "q", "u1", other)  # a one-shot prompt: never continued
    assert ledger.of("q") == InFlight(sessions=1.0)
    clock.now += sessions.FIRST_WAIT_S + 0.5  # past the wait: both homes forgotten
    assert ledger.all() == {} and len(ledger.homes) == 0
    assert ledger.homes.returning == 1 / 3  # one claimed of three outcomes
    serve(ledger, "q", "u2", turns(3, 1)[0])
    assert ledger.of("q") == InFlight(sessions=1 / 3)


def test_traffic_without_sessions_counts_no_homes() -> None:
    """One-shot prompts (a shared system prompt, distinct questions) never claim a home,
    so the returning share stays 0 and the ledger counts requests only."""
    clock = Clock()
    ledger = InFlightLedger(clock)
    for i in range(50):
        serve(ledger, f"p{i % 4}", f"r{i}", turns(i, 1)[0])
        clock.now += 0.1
    assert len(ledger.homes) == 50 and ledger.homes.returning == 0.0
    assert ledger.all() == {}
    assert ledger.future_prefill() == 0.0  # no later turns to price


def test_a_sessions_later_turns_are_priced_from_the_continuations_seen() -> None:
    """``future_prefill``: the returning share p gives p / (1 - p) later turns, each
    the mean uncached prefill of the turns that continued a session; a first turn's
    prefill (a new session's whole prompt) is not a continuation's."""
    clock = Clock()
    ledger = InFlightLedger(clock)
    t1, t2, t3 = turns(1, 3)
    serve(ledger, "p", "t1", t1, prefill=4_000)  # a new session: not a continuation
    assert ledger.future_prefill() == 0.0
    clock.now += 1.0
    serve(ledger, "p", "t2", t2, prefill=300)  # continues: share 1, capped at 0.9
    assert ledger.homes.returning == 1.0
    assert ledger.future_prefill() == pytest.approx(0.9 / 0.1 * 300)
    clock.now += 1.0
    serve(ledger, "p", "t3", t3, prefill=500)  # the mean moves a tenth of the way
    assert ledger.homes.turn_tokens == pytest.approx(320.0)
    assert ledger.future_prefill() == pytest.approx(9 * 320.0)
    for i in range(2):  # two one-shot prompts, never continued
        serve(ledger, "q", f"o{i}", turns(10 + i, 1)[0], prefill=9_000)
    clock.now += sessions.FIRST_WAIT_S + 1.0  # past the wait: t3's home and the
    # one-shots' are forgotten
    ledger.all()
    assert ledger.homes.returning == 2 / 5  # two claimed of five outcomes
    assert ledger.future_prefill() == pytest.approx((0.4 / 0.6) * 320.0)


def test_the_wait_adapts_to_the_return_gaps_seen() -> None:
    homes = SessionHomes()
    assert homes.wait_s == sessions.FIRST_WAIT_S
    now = 0.0
    for i in range(40):  # agents back after ~1 s, one straggler in five at 5 s
        homes.leave("p", i, now)
        gap = 5.0 if i % 5 == 4 else 1.0
        assert homes.claim([7_000_000, i], now + gap) == ["p"]
    assert homes.wait_s == 2.0 * 5.0
    assert homes.claim([i], now) == []  # claimed already


def test_one_quick_return_does_not_shorten_the_wait() -> None:
    """A 90th percentile of a handful of gaps is noise: a first return 2 ms after its
    route finished must not make every session slower than 4 ms forgotten. The wait
    falls only once :data:`sessions.MIN_GAPS` gaps are behind it; it may grow before."""
    homes = SessionHomes()
    for i in range(sessions.MIN_GAPS - 1):
        homes.leave("p", i, 0.0)
        assert homes.claim([i], 0.002) == ["p"]
        assert homes.wait_s == sessions.FIRST_WAIT_S
    homes.leave("p", 100, 0.0)
    assert homes.claim([100], 0.002) == ["p"]  # the sample is large enough now
    assert homes.wait_s == sessions.MIN_WAIT_S
    homes.leave("p", 999, 0.0)
    assert homes.expire(1.0) == ["p"]  # a session gone a second is forgotten

    slow = SessionHomes()
    for i in range(2):  # people reading for 40 s: the wait grows at once
        slow.leave("p", i, 0.0)
        slow.claim([i], 40.0)
    assert slow.wait_s == 80.0


def test_a_session_id_claims_its_home_when_the_prompt_was_rewritten() -> None:
    """An agent that compacted its context sends a prompt without the previous prompt's
    last block: its session id still claims the home, so the pod's count of sessions
    between turns stays right."""
    clock = Clock()
    ledger = InFlightLedger(clock)
    first = turns(1, 1)[0]
    ledger.begin("p", "t1", len(first), 60, tail=first[-1], session="agent")
    ledger.done("t1")
    serve(ledger, "q", "x1", turns(9, 1)[0])  # another session: claims nothing of agent's
    assert ledger.homes.returning == 0.0
    rewritten = turns(2, 1)[0]
    assert first[-1] not in rewritten
    assert ledger.arrive(rewritten, "agent")  # it continues a session
    assert ledger.homes.returning == 1.0 and len(ledger.homes) == 1  # q's home stays
    assert ledger.arrive(rewritten, "agent") is False  # claimed once
    assert ledger.arrive(rewritten) is False  # a prompt alone does not claim it either


def test_a_turn_without_a_full_block_is_homed_by_its_session_id() -> None:
    """An image chat's turn has no block keys (kvindex cannot read it): with a session
    id its route still leaves a home, claimed by the session's next turn."""
    clock = Clock()
    ledger = InFlightLedger(clock)
    ledger.arrive([], "chat")
    ledger.begin("p", "i1", 4, 60, session="chat")
    ledger.done("i1")
    assert len(ledger.homes) == 1
    clock.now += 1.0
    assert ledger.arrive([], "chat")
    assert len(ledger.homes) == 0
    ledger.begin("p", "i2", 4, 60)  # no session id, no block: no home
    ledger.done("i2")
    assert len(ledger.homes) == 0


def test_a_session_ids_claim_follows_its_latest_home_only() -> None:
    homes = SessionHomes()
    homes.leave("p", 11, 1.0, "s")
    homes.leave("q", 22, 2.0, "s")  # the session's next turn ended elsewhere
    homes.leave("r", 11, 3.0)  # another request ends in the same block: that home is r's
    assert homes.claim([], 4.0, "s") == ["q"]
    assert homes.claim([], 4.0, "s") == []
    assert homes.claim([11], 4.0) == ["r"]
    homes.leave("p", None, 5.0, "t")
    homes.wait_s = 1.0
    assert homes.expire(10.0) == ["p"]  # forgotten with its claim by session id
    assert homes.claim([], 10.0, "t") == []

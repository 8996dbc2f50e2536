"""The simulator's workloads (bench/sim/workloads.py, bench/sim/mooncake.py): the
Mooncake-like trace keeps the statistics it was built from, inference-perf's
shared_prefix cycles its fixed prompts, and the command line's workload flags combine
with the load factor instead of replacing it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.sim.__main__ import build_parser, scenario_for
from bench.sim.mooncake import TARGETS, MooncakeSpec, trace_stats
from bench.sim.plan import Cell
from bench.sim.workloads import ChatSpec, SharedPrefixSpec, Tokens


@pytest.fixture(scope="module")
def trace() -> tuple[MooncakeSpec, dict[str, float]]:
    spec = MooncakeSpec(duration_s=600.0)
    return spec, trace_stats(spec.build(1), spec.duration_s, spec.tick_s)


def test_mooncake_trace_is_deterministic() -> None:
    spec = MooncakeSpec(duration_s=60.0, warmup_s=300.0)
    a, b = spec.build(3), spec.build(3)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    assert [r.start_s for r in a.requests] == sorted(r.start_s for r in a.requests)
    assert all(r.start_s % spec.tick_s == 0 for r in a.requests)  # 3 s arrival ticks
    assert all(r.prompt[:512] == a.requests[0].prompt[:512] for r in a.requests)


@pytest.mark.parametrize(
    ("name", "tolerance"),
    [
        ("requests_per_s", 0.15),
        ("per_tick_mean", 0.15),
        ("input_p50", 0.15),
        ("input_p90", 0.15),
        ("output_mean", 0.1),
        ("output_p50", 0.1),
        ("output_p90", 0.1),
    ],
)
def test_mooncake_trace_matches_the_real_traces_statistics(trace, name: str, tolerance: float):
    _, measured = trace
    assert measured[name] == pytest.approx(TARGETS[name], rel=tolerance)


def test_mooncake_trace_reuses_what_the_real_trace_does_once_warm(trace) -> None:
    """Counting turns that arrived before the window (the stream is stationary), the
    continuation share and the reusable share match the trace's; as sent, the window
    starts cold and reuses less."""
    _, m = trace
    assert m["stationary_continuation_share"] == pytest.approx(0.387, abs=0.05)
    assert m["stationary_reuse_ratio"] == pytest.approx(0.374, abs=0.06)
    assert m["reuse_ratio"] < m["stationary_reuse_ratio"]


def test_tokens_view_slices_like_the_concatenation() -> None:
    prompt, output = list(range(10)), list(range(100, 105))
    view, whole = Tokens(prompt, output), prompt + output
    for span in (slice(0, 4), slice(8, 12), slice(10, 15), slice(3, 15), slice(0, 99)):
        assert view[span] == whole[span]
    assert len(view) == len(whole)


def test_shared_prefix_sends_its_fixed_prompts_again_in_the_same_order() -> None:
    spec = SharedPrefixSpec(
        groups=3, prompts=2, system_tokens=40, question_tokens=8, output_tokens=5, passes=2,
        exact=True,
    )  # fmt: skip
    reqs = spec.build(0).requests
    assert len(reqs) == 12
    first, second = reqs[:6], reqs[6:]
    assert [r.prompt for r in first] == [r.prompt for r in second]
    assert len({tuple(r.prompt) for r in first}) == 6
    assert all(len(r.prompt) == 48 and len(r.output) == 5 for r in reqs)
    assert len({tuple(r.prompt[:40]) for r in reqs}) == 3


def test_chat_context_is_the_conversations_own_after_the_shared_system_prompt() -> None:
    spec = ChatSpec(users=3, turns=2, system_tokens=20, context_tokens=30, user_tokens=5)
    reqs = spec.build(0).requests
    firsts = [r for r in reqs if r.after is None]
    assert len({tuple(r.prompt[:20]) for r in firsts}) == 1
    assert len({tuple(r.prompt[20:35]) for r in firsts}) == 3


def test_workload_flags_set_the_base_and_the_load_factor_still_applies() -> None:
    args = build_parser().parse_args(["--chat-users", "40", "--chat-sessions-per-s", "2"])
    base = scenario_for(Cell("sweep", "chat-load", "round-robin", load=1.0), args)
    doubled = scenario_for(Cell("sweep", "chat-load", "round-robin", load=2.0), args)
    assert (base.spec.users, base.spec.sessions_per_s) == (40, 2.0)  # type: ignore[attr-defined]
    assert (doubled.spec.users, doubled.spec.sessions_per_s) == (80, 4.0)  # type: ignore[attr-defined]

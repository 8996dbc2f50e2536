"""The eviction study's workloads (bench/sim/tenants.py, catalog.py, workloads.py):
working sets past one pod's cache, forks that resend an earlier conversation, sessions
without ids, Zipf popularity and bursts - checked on the generators, without a run."""

from __future__ import annotations

import itertools
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.sim.__main__ import build_parser, main, plan_spec
from bench.sim.catalog import CatalogSpec
from bench.sim.policies import POLICY_NAMES
from bench.sim.scenarios import eviction_study, loaded, scaled
from bench.sim.tenants import TenantChatSpec
from bench.sim.workloads import (
    SimRequest,
    Workload,
    _Source,
    bursty_starts,
    prepare,
    working_set,
    zipf_weights,
)
from kvindex.indexer.keys import BlockHasher, HashConfig

HASHER = BlockHasher(HashConfig(block_size=16))


@pytest.mark.parametrize("scenario", eviction_study(), ids=lambda s: s.name)
def test_eviction_scenarios_need_1_5_to_3_pods_of_cache(scenario) -> None:
    peak, mean = working_set(prepare(scenario.spec.build(0, scenario.name), HASHER))
    pod = scenario.cluster.blocks_per_pod
    assert 1.5 <= peak / pod <= 3.0, (peak / pod, mean / pod)
    assert peak <= scenario.cluster.pods * pod  # the cluster holds it, partitioned
    assert scenario.regime == "eviction"


def test_working_set_counts_blocks_between_their_first_and_last_use() -> None:
    a, b, c = ([n] * 16 for n in (1, 2, 3))
    requests = [
        SimRequest(0, 0, "g", a + b + [9], [], 1, start_s=0.0),  # blocks A, AB
        SimRequest(1, 1, "g", a + c + [9], [], 1, start_s=1.0),  # A again, AC once
        SimRequest(2, 2, "g", a + b + [9], [], 1, start_s=2.0),  # A, AB again
    ]
    peak, mean = working_set(prepare(Workload("t", "t", {}, requests, 3), HASHER))
    # A lives over [0, 2] and AB over [0, 2]; AC is used once, never live.
    assert peak == 2 and mean == pytest.approx((2 + 2 + 0) / 3)


def test_zipf_popularity_and_bursts() -> None:
    assert zipf_weights(3, 0.0) == [1.0, 1.0, 1.0]
    assert zipf_weights(3, 1.0) == pytest.approx([1.0, 0.5, 1 / 3])
    src = _Source(1)
    starts = bursty_starts(src, 400, rate=4.0, burst=8, gap_s=0.01)
    assert len(starts) == 400 and starts == sorted(starts)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    # 7 of every 8 gaps are within a burst (mean 10 ms), one between bursts (mean 2 s).
    assert statistics.median(gaps) < 0.05
    assert starts[-1] == pytest.approx(400 / 4.0, rel=0.35)  # the mean rate holds
    workload = CatalogSpec(items=20, zipf=1.2, requests=2000).build(0)
    counts = Counter(r.group for r in workload.requests)
    assert counts["doc0"] > 3 * counts["doc5"] > 0  # rank 1 vs rank 6: 6^1.2 = 8.6x


def test_forks_resend_an_earlier_conversation_of_their_tenant() -> None:
    spec = TenantChatSpec(tenants=3, system_tokens=64, users=60, turns=3, fork_p=1.0)
    workload = spec.build(0)
    assert workload.stats["forks"] > 10
    by_session: dict[int, list[SimRequest]] = {}
    for r in workload.requests:
        by_session.setdefault(r.session, []).append(r)
    histories = {r.rid: r.prompt + r.output for r in workload.requests}
    forked = 0
    for session, reqs in by_session.items():
        first = reqs[0]
        system_only = len(first.prompt) - first.fresh_tokens == spec.system_tokens
        if system_only:
            continue
        # The first prompt is an earlier turn's prompt + answer of the same tenant, then
        # the fork's own turn.
        context = first.prompt[: len(first.prompt) - first.fresh_tokens]
        parents = [
            rid for rid, history in histories.items() if history == context and rid < first.rid
        ]
        assert parents, f"session {session}: no earlier turn ends with its context"
        assert workload.requests[parents[0]].group == first.group
        forked += 1
    assert forked == workload.stats["forks"]


def test_sessions_without_ids_look_like_separate_requests() -> None:
    spec = TenantChatSpec(tenants=2, system_tokens=32, users=5, turns=3, session_ids=False)
    workload = spec.build(0)
    assert len({r.session for r in workload.requests}) == len(workload.requests)
    # They are still conversations: every later turn follows the previous one.
    assert sum(r.after is not None for r in workload.requests) == 5 * 2


def test_load_and_scale_apply_to_the_new_shapes() -> None:
    tenants, catalog = eviction_study()[0], eviction_study()[2]
    assert loaded(tenants, 2).spec.users == 2 * tenants.spec.users
    assert loaded(tenants, 2).spec.sessions_per_s == 2 * tenants.spec.sessions_per_s
    assert loaded(catalog, 2).spec.rate == 2 * catalog.spec.rate
    assert scaled(catalog, 0.5).spec.requests == catalog.spec.requests // 2


def test_list_prints_each_eviction_scenarios_working_set(capsys) -> None:
    assert main(["--study", "eviction", "--list"]) == 0
    out = capsys.readouterr().out
    for scenario in eviction_study():
        assert f"{scenario.name} (" in out
    assert out.count("one pod's cache at its peak") == len(eviction_study())


def test_the_eviction_study_sweeps_its_scenarios_past_twice_the_knee_with_every_policy() -> None:
    spec = plan_spec(build_parser().parse_args(["--study", "eviction", "--seeds", "3"]))
    assert spec.sweep == [s.name for s in eviction_study()]
    assert spec.standard == [] and spec.replica_counts == []
    assert spec.loads[0] <= 0.25 and spec.loads[-1] >= 2.0  # base load ~ the knee
    assert set(spec.policies) == set(POLICY_NAMES)
    assert spec.study_scenario == "tenants" and spec.seeds == 3
    assert {"greedy-perfect", "kvindex-route"} <= set(spec.study_policies)
    quick = plan_spec(build_parser().parse_args(["--study", "eviction", "--quick"]))
    assert set(quick.policies) == set(POLICY_NAMES)  # --quick runs every baseline
    assert quick.loads == [0.5, 2.0]

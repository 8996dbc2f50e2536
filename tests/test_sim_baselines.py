"""The simulator's baselines as their routers decide (bench/sim/cache_policies.py):
Dynamo counts a worker's active blocks once each, llm-d's precise profile normalises
and weighs its scorers as its guide configures them, and kvindex-route is sent the
client's max_tokens unless told the true length."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.sim.cache_policies import (
    ActiveBlocks,
    KvindexRoute,
    LlmDPrecise,
    dynamo_cost,
    llmd_precise_scores,
)
from bench.sim.policies import parse_policy, uses_index
from bench.sim.workloads import SharedPrefixSpec, SimRequest

BS = 16


def test_dynamo_counts_only_the_blocks_a_request_adds_to_a_worker() -> None:
    worker = ActiveBlocks()
    shared = [1, 2, 3, 4]
    worker.add([*shared, 10], prefill_tokens=80)
    assert worker.blocks == 5
    # A second request with the same 4-block prefix adds one block, not five.
    assert worker.new_blocks([*shared, 11]) == 1
    assert dynamo_cost(worker, [*shared, 11], 16, BS) == (80 + 16) / BS + 5 + 1
    worker.add([*shared, 11], prefill_tokens=16)
    assert worker.blocks == 6
    worker.prefilled(80)
    worker.remove([*shared, 10])
    assert worker.blocks == 5 and worker.prefill_tokens == 16  # the shared blocks stay
    worker.remove([*shared, 11])
    assert worker.blocks == 0 and worker.new_blocks(shared) == 4


def test_dynamo_prefers_the_worker_whose_active_requests_share_the_prompt() -> None:
    # Both workers run one 8-block request; only worker 0's shares the new prompt's
    # prefix. Counting every request's blocks in full would make them cost the same.
    sharing, other = ActiveBlocks(), ActiveBlocks()
    sharing.add(list(range(8)), 0)
    other.add(list(range(100, 108)), 0)
    prompt = [*range(6), 50, 51]
    costs = [dynamo_cost(w, prompt, 8 * BS, BS) for w in (sharing, other)]
    assert costs[0] < costs[1]


def test_llmd_precise_normalises_matches_over_the_pods_that_matched() -> None:
    idle = [0, 0, 0, 0]
    empty = [0.0] * 4
    # Matches 2, 6, 10 and one pod with none: min-max over 2..10, the miss scores 0.
    totals = llmd_precise_scores([2, 6, 10, 0], idle, empty)
    assert totals == pytest.approx([2 * 0.0 + 2, 2 * 0.5 + 2, 2 * 1.0 + 2, 2])
    # One pod matched: it scores a full prefix point, whatever its count.
    assert llmd_precise_scores([0, 3, 0, 0], idle, empty)[1] == pytest.approx(4.0)
    # No match anywhere: load alone decides.
    totals = llmd_precise_scores([0] * 4, [4, 0, 2, 4], [0.5, 0.1, 0.1, 0.9])
    assert totals == pytest.approx([0.5, 0.9 + 1.0, 0.9 + 0.5, 0.1])


def test_llmd_precise_weighs_prefix_twice_queue_and_kv_once() -> None:
    # A full prefix match (2 points) outweighs the emptiest queue (1 point).
    cached_busy = llmd_precise_scores([10, 0], [8, 0], [0.5, 0.5])
    assert cached_busy[0] > cached_busy[1]
    assert LlmDPrecise.WEIGHTS == (2.0, 1.0, 1.0)
    assert parse_policy("llm-d-precise") == ("llm-d-precise", None)
    assert uses_index("llm-d-precise")


def test_kvindex_route_sends_the_clients_max_tokens_unless_told_the_truth() -> None:
    request = SimRequest(1, 1, "g", [1] * 40, [2] * 300, 40)
    k = SimpleNamespace(request=request)
    client = KvindexRoute(None, "m", ["a"], "t")  # type: ignore[arg-type]
    truth = KvindexRoute(None, "m", ["a"], "t", max_tokens="true")  # type: ignore[arg-type]
    assert client.max_tokens(k) is None  # type: ignore[arg-type]
    assert truth.max_tokens(k) == 300  # type: ignore[arg-type]
    capped = SimpleNamespace(request=SimRequest(1, 1, "g", [1], [2] * 300, 1, max_tokens=512))
    assert client.max_tokens(capped) == 512  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens"):
        KvindexRoute(None, "m", ["a"], "t", max_tokens="oracle")  # type: ignore[arg-type]


def test_inference_perf_prompts_carry_their_fixed_max_tokens_and_others_none() -> None:
    exact = SharedPrefixSpec(groups=2, prompts=2, output_tokens=37, exact=True).build(0)
    assert {r.max_tokens for r in exact.requests} == {37}
    varying = SharedPrefixSpec(groups=2, prompts=2, output_tokens=37).build(0)
    assert {r.max_tokens for r in varying.requests} == {None}

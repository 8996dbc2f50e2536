"""The cluster simulator (bench/sim): vLLM's block-pool rules, and one small comparison
end to end through a real ``kvindex serve`` - ordering of policies and block-for-block
agreement between the index and the simulated pods."""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ is not an installed package; pyproject's pytest `pythonpath = ["."]` puts the
# repository root on sys.path, and this keeps the test runnable without it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.sim.__main__ import main
from bench.sim.cluster import Cluster, ClusterSpec
from bench.sim.pod import Job, SimPod
from bench.sim.pool import BlockPool, PoolBusy
from bench.sim.runner import RunSpec, run
from bench.sim.service import IndexClient
from bench.sim.workloads import (
    ChatSpec,
    DocQASpec,
    KeyedRequest,
    SimRequest,
    Workload,
    prepare,
)
from kvindex.events.testing import wait_until
from kvindex.events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig

BS = 4  # small blocks keep the pool tests readable


def hasher(block_size: int = BS) -> BlockHasher:
    return BlockHasher(HashConfig(block_size=block_size))


def keyed(prompt: list[int], output: list[int], rid: int = 0) -> KeyedRequest:
    """One request, hashed as the simulator hashes a workload."""
    request = SimRequest(rid, rid, "g", prompt, output, len(prompt))
    return prepare(Workload("t", "t", {}, [request], 1), hasher()).requests[0]


# -- the block pool -----------------------------------------------------------------


def test_pool_evicts_least_recently_freed_tail_first() -> None:
    pool = BlockPool(4, BS)
    keys = [11, 12, 13, 14]
    tokens = list(range(16))
    blocks = pool.allocate(4)
    pool.cache(blocks, keys, 0, 4, tokens)
    stored = pool.drain_events()
    assert stored == [BlockStored([11, 12, 13, 14], None, tokens, BS, medium="GPU")]
    pool.release(blocks)  # reversed: block of key 14 is freed first, so evicted first
    assert pool.match(keys) == 4
    pool.allocate(1)
    assert pool.drain_events() == [BlockRemoved([14], medium="GPU")]
    assert pool.match(keys) == 3
    assert pool.evictions == 1


def test_pool_touch_revives_a_free_block_and_pins_it() -> None:
    pool = BlockPool(2, BS)
    blocks = pool.allocate(2)
    pool.cache(blocks, [1, 2], 0, 2, list(range(8)))
    pool.release(blocks)
    pool.drain_events()
    assert pool.hit_cost([1]) == 1
    pool.touch([1])  # the head of the free queue, now in use
    assert pool.free_blocks == 1
    pool.allocate(1)  # must evict key 2, not the pinned key 1
    assert pool.drain_events() == [BlockRemoved([2], medium="GPU")]
    assert pool.match([1]) == 1


def test_pool_stored_event_names_its_parent_and_only_new_tokens() -> None:
    pool = BlockPool(3, BS)
    blocks = pool.allocate(3)
    tokens = list(range(12))
    pool.cache(blocks, [7, 8, 9], 0, 1, tokens)
    pool.cache(blocks, [7, 8, 9], 1, 3, tokens)
    assert pool.drain_events()[1] == BlockStored([8, 9], 7, tokens[4:12], BS, medium="GPU")


def test_pool_duplicate_copy_eviction_leaves_a_ghost() -> None:
    # vLLM keeps two blocks with one hash (a fully cached prompt recomputes its last
    # block) and publishes BlockRemoved when either goes: the index then lacks a block
    # the pod still holds.
    pool = BlockPool(3, BS)
    first = pool.allocate(1)
    pool.cache(first, [5], 0, 1, list(range(4)))
    second = pool.allocate(1)
    pool.cache(second, [5], 0, 1, list(range(4)))
    assert pool.duplicate_stores == 1
    pool.release(first)
    pool.release(second)
    pool.allocate(2)  # the never-used block, then the first copy
    assert pool.match([5]) == 1
    assert pool.ghosts == {5}
    assert 5 not in pool.event_view()


def test_pool_reset_only_when_idle() -> None:
    pool = BlockPool(2, BS)
    blocks = pool.allocate(1)
    pool.cache(blocks, [3], 0, 1, list(range(4)))
    with pytest.raises(PoolBusy):
        pool.reset()
    pool.release(blocks)
    pool.drain_events()
    pool.reset()
    assert pool.drain_events() == [AllBlocksCleared()]
    assert pool.match([3]) == 0
    assert pool.event_view() == set()


# -- the pod ------------------------------------------------------------------------


def test_pod_recomputes_the_last_block_of_a_fully_cached_prompt() -> None:
    pod = SimPod("127.0.0.1:8001", 0, BlockPool(16, BS), ClusterSpec().costs)
    k = keyed(list(range(100, 108)), [1, 2])  # two full prompt blocks
    for t in (0.0, 1.0):
        job = Job(k, t, 0)
        assert pod.submit(job)
        (started,) = pod.admit(t)
        pod.finish(started)
    # The second time only block 0 may be reused (vLLM caps hits at prompt length - 1).
    assert job.hit_blocks == 1
    assert job.computed_tokens == 4
    assert pod.pool.duplicate_stores == 1


def test_pod_waits_for_blocks_and_rejects_what_never_fits() -> None:
    costs = ClusterSpec().costs
    pod = SimPod("127.0.0.1:8001", 0, BlockPool(4, BS), costs)
    big = Job(keyed(list(range(20)), [1]), 0.0, 0)  # 6 blocks > 4
    assert not pod.submit(big)
    a = Job(keyed(list(range(10)), [1], rid=1), 0.0, 0)  # 3 blocks
    b = Job(keyed(list(range(50, 60)), [1], rid=2), 0.0, 0)
    assert pod.submit(a) and pod.submit(b)
    assert pod.admit(0.0) == [a]  # b waits: one block free
    pod.finish(a)
    assert pod.admit(a.finish_s) == [b]
    assert b.ttft_s >= a.finish_s


# -- workloads ----------------------------------------------------------------------


def test_workloads_are_deterministic_and_docqa_ideal_is_one_document_per_doc() -> None:
    spec = DocQASpec(docs=3, questions=4, doc_tokens=64, question_tokens=6, sessions_per_s=1.0)
    a, b = spec.build(7), spec.build(7)
    assert [r.prompt for r in a.requests] == [r.prompt for r in b.requests]
    prepared = prepare(a, hasher(16))
    questions = sum(r.fresh_tokens for r in a.requests)
    assert prepared.ideal_prefill_tokens == 3 * 64 + questions


# -- end to end ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("vllm_version", ["0.33", "0.23"])  # map and array event layouts
def test_small_comparison_through_kvindex(vllm_version: str) -> None:
    """oracle >= precise > round-robin, and the index holds exactly the pods' blocks."""
    spec = ChatSpec(
        users=12,
        turns=4,
        system_tokens=48,
        user_tokens=40,
        output_tokens=40,
        think_s=2.0,
        sessions_per_s=2.0,
    )
    prepared = prepare(spec.build(3, "chat"), hasher(16))
    # Small pools: evictions happen, so BlockRemoved reaches the index too.
    cluster = ClusterSpec(pods=3, blocks_per_pod=96, block_size=16)
    seen: dict[str, object] = {}

    def inspect(sim: Cluster, client: IndexClient) -> None:
        def index_blocks() -> dict[str, int]:
            reports = client.pods()
            return {
                p.pod_id: reports.get(p.pod_id, {}).get("blocks", {}).get("gpu", 0)
                for p in sim.pods
            }

        seen["index"] = index_blocks()
        seen["sim"] = {pod.pod_id: len(pod.pool.event_view()) for pod in sim.pods}
        seen["truth"] = {pod.pod_id: len(pod.pool.cached_keys()) for pod in sim.pods}
        # Every request has finished, so a pod may reset: AllBlocksCleared must empty it.
        fullest = max(sim.pods, key=lambda p: len(p.pool.event_view()))
        sim.reset_pod(fullest.index)
        seen["cleared"] = wait_until(lambda: index_blocks()[fullest.pod_id] == 0, 5.0)

    results = {
        policy: run(
            prepared,
            RunSpec("tiny", policy, cluster, vllm_version=vllm_version),
            inspect=inspect if policy == "precise" else None,
        )
        for policy in ("round-robin", "precise", "oracle")
    }
    rr, precise, oracle = (results[p].hit_ratio for p in ("round-robin", "precise", "oracle"))
    assert oracle >= precise > rr, (oracle, precise, rr)

    info = results["precise"].index
    assert info is not None
    assert info["sync_timeouts"] == 0
    assert info["score_mismatches"] == 0
    agreement = info["agreement"]
    assert agreement["agrees"], agreement
    assert agreement["keys_agree"]  # block for block, via /index/pods/{pod}/blocks
    assert agreement["probed_chains"] == agreement["chains"] > 0
    for pod in agreement["pods"].values():
        assert pod["confirmed_blocks"] + pod["unconfirmable_blocks"] == pod["sim_blocks"]
        assert pod["missing_keys"] == pod["extra_keys"] == 0
    assert results["precise"].evicted_blocks > 0
    assert seen["index"] == seen["sim"]
    if results["precise"].ghost_blocks == 0:
        assert seen["sim"] == seen["truth"]
    assert seen["cleared"]


def test_command_line_runs_a_partial_comparison(tmp_path: Path) -> None:
    code = main(
        [
            "--scenarios", "docqa",
            "--scale", "0.05",
            "--policies", "round-robin,session-sticky,oracle",
            "--docqa-questions", "4",
            "--no-png",
            "--no-progress",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    assert (tmp_path / "routing.md").read_text().count("| oracle |") == 1
    assert '"claims"' in (tmp_path / "routing.json").read_text()

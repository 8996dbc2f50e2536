"""The cluster simulator (bench/sim): vLLM's block-pool rules, and one small comparison
end to end through a real ``kvindex serve`` - ordering of policies and block-for-block
agreement between the index and the simulated pods."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# bench/ is not an installed package; pyproject's pytest `pythonpath = ["."]` puts the
# repository root on sys.path, and this keeps the test runnable without it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.sim.__main__ import main
from bench.sim.cache_policies import RoutedBlocks
from bench.sim.cluster import Cluster, ClusterSpec
from bench.sim.costs import CostModel
from bench.sim.faults import FaultSpec
from bench.sim.lag import LagModel
from bench.sim.metrics import PodMetricsServers, ScrapeClock
from bench.sim.pod import Job, SimPod
from bench.sim.policies import LeastLoaded, PrefixHash
from bench.sim.pool import BlockPool, PoolBusy
from bench.sim.runner import RunSpec, run
from bench.sim.service import IndexClient, KvindexProcess
from bench.sim.workloads import (
    ChatSpec,
    DocQASpec,
    KeyedRequest,
    SimRequest,
    Workload,
    prepare,
)
from kvindex.api.testing import free_port
from kvindex.events.ingest.sink import Delivery
from kvindex.events.ingest.testing import wait_until
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.vllm import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.keys import BlockHasher, HashConfig
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import ModelCatalog
from kvindex.scoring.load import LoadView

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


def test_pool_reuses_blocks_without_a_hash_before_any_cached_block() -> None:
    # vLLM 0.33 BlockPool.free_blocks: a released block without a hash (a partial last
    # block) goes to the free queue's head, a cached one to its tail.
    pool = BlockPool(4, BS)
    cached = pool.allocate(2)
    pool.cache(cached, [1, 2], 0, 2, list(range(8)))
    pool.release(cached)
    request = pool.allocate(2)
    pool.cache(request, [3, 4], 0, 1, list(range(8)))  # the second block stays partial
    pool.drain_events()
    pool.release(request)
    assert pool.allocate(1) == [request[1]]  # the partial block: no eviction
    assert pool.drain_events() == []
    pool.allocate(1)
    assert pool.drain_events() == [BlockRemoved([2], medium="GPU")]  # then LRU, tail first


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


def test_pool_root_copies_each_have_their_store_and_removal_like_vllm() -> None:
    # vLLM 0.33 keeps two blocks with one hash, also when both were stored from the
    # chain's root (BlockHashToBlockMap.insert), publishes a BlockStored per copy and a
    # BlockRemoved per evicted copy (_maybe_evict_cached_block), and hits the hash while
    # a copy is left (get_cached_block returns any): the events say exactly what is held.
    pool = BlockPool(3, BS)
    first = pool.allocate(1)
    pool.cache(first, [5], 0, 1, list(range(4)))
    second = pool.allocate(1)
    pool.cache(second, [5], 0, 1, list(range(4)))
    assert pool.duplicate_stores == 1
    pool.release(first)
    pool.release(second)
    pool.drain_events()
    pool.allocate(2)  # the never-used block, then the first copy
    assert pool.drain_events() == [BlockRemoved([5], medium="GPU")]
    assert pool.match([5]) == 1
    assert pool.event_view() == pool.cached_keys() == {5}
    assert pool.ghosts == set()
    pool.allocate(1)  # the second copy
    assert pool.drain_events() == [BlockRemoved([5], medium="GPU")]
    assert pool.match([5]) == 0
    assert pool.event_view() == pool.cached_keys() == set()


def test_kvindex_fed_the_pools_events_holds_what_the_pool_holds() -> None:
    """The pool's events through kvindex's own ingest (default report mode) leave the
    index equal to the pool at every step, through root copies, copies stored after a
    hit and constant eviction."""
    backend = MemoryBackend()
    ingestor = Ingestor(backend, ModelCatalog())
    pod = StreamId("127.0.0.1:8001")
    pool = BlockPool(6, BS)
    chains = {c: [100 * (c + 1) + i for i in range(3)] for c in range(4)}
    # (chain, blocks, first block to store): the second and third requests store chain
    # 0 again from its root and after a one-block hit; the rest evict.
    plan = [(0, 2, 0), (0, 2, 0), (0, 3, 1), (1, 3, 0), (2, 3, 0), (0, 1, 0), (3, 3, 0)]
    held: list[list[int]] = []
    for seq, (chain, count, start) in enumerate(plan):
        keys = chains[chain]
        hit = pool.touch(keys[:start])
        while len(hit) + count - start > pool.free_blocks and held:
            pool.release(held.pop(0))
        blocks = hit + pool.allocate(count - start)
        pool.cache(blocks, keys, start, count, list(range(4 * count)))
        held.append(blocks)
        batch = EventBatch(float(seq), pool.drain_events())
        ingestor.deliver([Delivery(pod, "m", seq, batch, 0.0)])
        assert set(backend.member_keys(pod.member, "m")) == pool.cached_keys(), seq
        assert pool.ghosts == set()
    assert pool.duplicate_stores >= 2
    assert pool.evictions > 0


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


# -- the pod (vLLM's step scheduler) -------------------------------------------------


def drive(pod: SimPod, now: float = 0.0) -> float:
    """Run the pod's steps until it has no work; return the time the last one ended."""
    for _ in range(10_000):
        step = pod.schedule()
        if step is None:
            return now
        now += step.duration_s
        pod.complete(step, now)
    raise AssertionError("the pod never ran out of work")


def test_pod_recomputes_the_last_block_of_a_fully_cached_prompt() -> None:
    pod = SimPod("127.0.0.1:8001", 0, BlockPool(16, BS), CostModel())
    k = keyed(list(range(100, 108)), [1, 2])  # two full prompt blocks
    for t in (0.0, 1.0):
        job = Job(k, t, 0)
        assert pod.submit(job)
        drive(pod, t)
    # The second time only block 0 may be reused (vLLM caps hits at prompt length - 1).
    assert job.hit_blocks == 1
    assert job.computed_tokens == 4
    assert job.finish_s > job.first_token_s > 1.0
    assert pod.pool.duplicate_stores == 1


def test_pod_chunks_prefills_to_the_token_budget_and_decodes_alongside() -> None:
    costs = CostModel(max_num_batched_tokens=8)
    pod = SimPod("127.0.0.1:8001", 0, BlockPool(64, BS), costs)
    short = Job(keyed(list(range(4)), [1, 2, 3], rid=1), 0.0, 0)
    long = Job(keyed(list(range(100, 120)), [1, 2], rid=2), 0.0, 0)
    assert pod.submit(short) and pod.submit(long)
    first = pod.schedule()
    assert first is not None
    assert [(j.keyed.request.rid, n) for j, n in first.work] == [(1, 4), (2, 4)]
    pod.complete(first, first.duration_s)
    assert short.produced == 1 and long.produced == 0  # long's prefill is chunked
    second = pod.schedule()
    assert second is not None
    assert [(j.keyed.request.rid, n) for j, n in second.work] == [(1, 1), (2, 7)]
    assert second.duration_s == costs.step_s(8, 5 + 11)


def test_pod_preempts_the_newest_request_when_blocks_run_out() -> None:
    pod = SimPod("127.0.0.1:8001", 0, BlockPool(4, BS), CostModel())
    a = Job(keyed(list(range(7)), list(range(1, 6)), rid=1), 0.0, 0)  # 12 tokens: 3 blocks
    b = Job(keyed(list(range(50, 53)), list(range(1, 6)), rid=2), 0.0, 0)  # 8 tokens: 2
    assert pod.submit(a) and pod.submit(b)
    drive(pod)
    assert b.preemptions >= 1 and a.preemptions == 0
    assert a.finish_s < b.finish_s
    assert b.recomputed_tokens > 0
    assert pod.pool.free_blocks == 4


def test_pod_rejects_what_never_fits_and_a_full_queue() -> None:
    pod = SimPod("127.0.0.1:8001", 0, BlockPool(4, BS), CostModel(max_waiting=1))
    assert not pod.submit(Job(keyed(list(range(20)), [1]), 0.0, 0))  # 6 blocks > 4
    assert pod.submit(Job(keyed(list(range(5)), [1], rid=1), 0.0, 0))
    assert not pod.submit(Job(keyed(list(range(5)), [1], rid=2), 0.0, 0))
    assert pod.rejected == 2


def test_step_time_grows_with_tokens_and_context() -> None:
    costs = CostModel()
    assert costs.step_s(1, 0) < costs.step_s(64, 0) < costs.step_s(64, 64 * 3000)


# -- policies -----------------------------------------------------------------------


def test_approximate_forgets_tails_before_heads() -> None:
    blocks = RoutedBlocks(1, capacity_blocks=4)
    blocks.add([1, 2, 3], 0)
    blocks.add([7, 8], 0)  # over capacity: the oldest prompt's tail goes, not its head
    assert blocks.scores([1, 2, 3]) == [2]
    assert blocks.scores([7, 8]) == [2]


def sim_pods(n: int = 4) -> list[SimPod]:
    return [SimPod(f"127.0.0.1:{8001 + i}", i, BlockPool(64, BS), CostModel()) for i in range(n)]


def test_prefix_hash_keeps_a_prefix_on_one_pod_until_it_is_overloaded() -> None:
    pods = sim_pods()
    scrapes = ScrapeClock(pods, 0.05)
    policy = PrefixHash(4, blocks=2)
    k = keyed(list(range(40)), [1])
    scrapes.advance(0.0)
    home = policy.choose(k, scrapes.views)
    for t in range(1, 6):  # one request per scrape tick, each done before the next
        scrapes.advance(t * 0.05)
        assert policy.choose(k, scrapes.views) == home
    for j in range(6):  # the home pod is now far above its share
        pods[home].waiting.append(Job(keyed(list(range(j, j + 4)), [1], rid=10 + j), 0.0, home))
    scrapes.advance(0.3)
    assert policy.choose(k, scrapes.views) != home


def test_policies_see_load_as_of_the_last_scrape_tick_plus_what_they_sent() -> None:
    """A queue that grew after the tick is invisible until the next one; what a replica
    sent itself since the tick counts at once."""
    pods = sim_pods(2)
    scrapes = ScrapeClock(pods, 0.05)
    assert scrapes.advance(0.01) and scrapes.tick == 0
    for j in range(3):
        pods[0].waiting.append(Job(keyed(list(range(j, j + 4)), [1], rid=10 + j), 0.0, 0))
    assert not scrapes.advance(0.049)  # same tick: the queue is not seen yet
    assert [v.load for v in scrapes.views] == [0, 0]
    policy = LeastLoaded()
    first = policy.choose(keyed([1, 2, 3, 4, 5], [1]), scrapes.views)
    second = policy.choose(keyed([1, 2, 3, 4, 5], [1], rid=1), scrapes.views)
    assert {first, second} == {0, 1}  # its own first route counted against that pod
    assert scrapes.advance(0.05) and scrapes.tick == 1
    assert [v.load for v in scrapes.views] == [3, 0] and scrapes.views[0].saturated
    assert policy.choose(keyed([1, 2, 3, 4, 5], [1], rid=2), scrapes.views) == 1


@pytest.mark.timeout(30)
def test_kvindex_scrapes_exactly_the_tick_the_pods_serve() -> None:
    """kvindex's load scraper (the real one, over HTTP) reads each pod's /metrics page;
    once ``wait_scraped`` returns, kvindex holds the current tick's gauges, including a
    restart's new process start time."""
    pods = sim_pods(2)
    scrapes = ScrapeClock(pods, 0.05)
    servers = PodMetricsServers(pods, "m", hold_s=0.2)
    view = LoadView(interval_s=0.005, timeout_s=5.0, stale_after_s=60.0)
    view.set_pods([p.pod_id for p in pods])
    try:
        view.start()
        scrapes.advance(0.0)
        servers.publish(scrapes)
        assert servers.wait_scraped(10.0)
        loads = view.snapshot([p.pod_id for p in pods])
        assert [loads[p.pod_id].waiting for p in pods] == [0, 0]  # type: ignore[union-attr]
        pods[1].waiting.append(Job(keyed([1, 2, 3, 4, 5], [1]), 0.0, 1))
        pods[0].restart(0.07)
        scrapes.advance(0.07)
        servers.publish(scrapes)
        assert servers.wait_scraped(10.0)
        loads = view.snapshot([p.pod_id for p in pods])
        assert [loads[p.pod_id].waiting for p in pods] == [0, 1]  # type: ignore[union-attr]
        assert servers.timeouts == 0
    finally:
        view.stop()
        servers.close()


@pytest.mark.timeout(60)
def test_only_kvindex_own_scrapes_prove_it_stored_the_tick() -> None:
    """Another client on the host GETting the pods' pages (another run's kvindex
    scraping the same pod addresses) proves nothing: ``wait_scraped`` waits for the
    scraper process named, and kvindex then holds the tick's gauges."""
    pods = [SimPod(f"127.0.0.1:{free_port()}", i, BlockPool(64, BS), CostModel()) for i in range(2)]
    scrapes = ScrapeClock(pods, 0.05)
    servers = PodMetricsServers(pods, "m", hold_s=0.2, scraper_pid=os.getpid())
    view = LoadView(interval_s=0.005, timeout_s=5.0, stale_after_s=60.0)
    view.set_pods([p.pod_id for p in pods])
    try:
        view.start()
        scrapes.advance(0.0)
        servers.publish(scrapes)
        assert servers.wait_scraped(10.0)
        view.stop()  # kvindex stops scraping; only the other client asks from here on
        pods[1].waiting.append(Job(keyed([1, 2, 3, 4, 5], [1]), 0.0, 1))
        scrapes.advance(0.05)
        servers.publish(scrapes)
        other = [f"http://{p.pod_id}/metrics" for p in pods for _ in range(2)]
        subprocess.run([sys.executable, "-c", _GET_EACH, *other], check=True, timeout=30)
        assert not servers.wait_scraped(0.3)  # its GETs are not kvindex's
        loads = view.snapshot([p.pod_id for p in pods])
        assert [loads[p.pod_id].waiting for p in pods] == [0, 0]  # type: ignore[union-attr]
        view.start()
        assert servers.wait_scraped(10.0)
        loads = view.snapshot([p.pod_id for p in pods])
        assert [loads[p.pod_id].waiting for p in pods] == [0, 1]  # type: ignore[union-attr]
    finally:
        view.stop()
        servers.close()


#: A client in another process: GET each URL given, in order.
_GET_EACH = """
import sys, urllib.request
for url in sys.argv[1:]:
    urllib.request.urlopen(url, timeout=10).read()
"""


def test_lag_keeps_a_pods_batches_in_order() -> None:
    sampler = LagModel(median_ms=5.0, sigma=2.0).sampler(1)
    assert all(sampler.delay_s() >= 0 for _ in range(100))
    assert LagModel(0.0).sampler(1).delay_s() == 0.0


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
    """Without lag, greedy-perfect >= precise > round-robin (precise sees what the pods
    hold); with lag, restarts and direct traffic the index still ends block for block
    equal to the pods; the index holds exactly the pods' blocks."""
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
    cluster = ClusterSpec(pods=3, blocks_per_pod=96, block_size=16).for_run(1)
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
        assert sim.reset_pod(fullest.index)
        sim.release(float("inf"))  # the reset's batch leaves the pod
        seen["cleared"] = wait_until(lambda: index_blocks()[fullest.pod_id] == 0, 5.0)

    no_lag = LagModel(0.0)
    results = {
        policy: run(
            prepared,
            RunSpec("tiny", policy, cluster, vllm_version=vllm_version, lag=no_lag),
            inspect=inspect if policy == "precise" else None,
        )
        for policy in ("round-robin", "precise", "greedy-perfect")
    }
    rr, precise, greedy = (
        results[p].hit_ratio for p in ("round-robin", "precise", "greedy-perfect")
    )
    assert greedy >= precise > rr, (greedy, precise, rr)
    assert results["precise"].index is not None
    assert results["precise"].index["stale_decisions"] == 0

    faults = FaultSpec(restarts=2, direct=0.2)
    for policy in ("precise", "dynamo", "kvindex-route"):
        lagged = run(
            prepared,
            RunSpec("tiny", policy, cluster, vllm_version=vllm_version, replicas=2, faults=faults),
        )
        assert lagged.index is not None
        assert lagged.restarts == 2 and lagged.direct > 0
        assert lagged.requests == len(prepared.requests)
        assert lagged.index["sync_timeouts"] == 0
        assert lagged.index["agreement"]["agrees"], lagged.index["agreement"]

    info = results["precise"].index
    assert info is not None
    assert info["sync_timeouts"] == 0
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


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_runs_sharing_one_kvindex_stay_within_its_per_sender_stream_cap() -> None:
    """Many runs share one ``kvindex serve`` (``python -m bench.sim``), and in bind mode
    kvindex lets one sender address open only ``--max-streams-per-sender`` streams.
    Each run's pods send from a loopback host of their own, so kvindex hears every run's
    pods however many runs came before: here three runs of two pods against a cap of two
    (pods all on 127.0.0.1 were refused from the second run on, and every decision then
    waited out the sync deadline)."""
    spec = ChatSpec(users=3, turns=2, system_tokens=32, user_tokens=20, output_tokens=8)
    prepared = prepare(spec.build(1, "chat"), hasher(16))
    base = ClusterSpec(pods=2, blocks_per_pod=64, block_size=16)
    with KvindexProcess(extra_args=("--max-streams-per-sender", "2")) as service:
        hosts: dict[str, set[str]] = {}
        for n in range(3):
            cluster = base.for_run(n)
            result = run(
                prepared,
                RunSpec("tiny", "precise", cluster, lag=LagModel(0.0), sync_timeout_s=3.0),
                service=service,
            )
            assert result.index is not None
            assert result.index["sync_timeouts"] == 0
            assert result.index["agreement"]["agrees"], result.index["agreement"]
            hosts.setdefault(cluster.host, set()).update(cluster.pod_ids())
        client = IndexClient(service.url)
        known = set(client.pods())
        refused = client.event_errors().get("sender_stream_cap", 0)
        client.close()
    assert refused == 0
    assert len(hosts) == 3 and all(len(pods) == 2 for pods in hosts.values())
    assert {pod.partition(":")[0] for pod in known} == set(hosts)  # each run was heard


def test_command_line_runs_a_partial_comparison(tmp_path: Path) -> None:
    code = main(
        [
            "--scenarios", "docqa",
            "--scale", "0.05",
            "--policies", "round-robin,session-sticky,greedy-perfect",
            "--sweep", "none",
            "--replica-counts", "",
            "--faults", "",
            "--docqa-questions", "4",
            "--no-png",
            "--no-progress",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert code == 0
    assert (tmp_path / "routing.md").read_text().count("| greedy-perfect |") == 1
    assert '"claims"' in (tmp_path / "routing.json").read_text()

"""Waiting for the index before a decision (bench/sim/streams.py), against a real
``kvindex serve`` fed by real publishers: a decision waits for the batches that touch
its prompt's blocks and for nothing else, and a restarted pod is waited for in full."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.sim.cluster import Cluster, ClusterSpec
from bench.sim.service import IndexClient, KvindexProcess
from bench.sim.workloads import KeyedRequest, SimRequest, Workload, prepare
from kvindex.indexer.keys import BlockHasher, HashConfig

BS = 16
MODEL = "sim-model"


def keyed(first: int, rid: int) -> KeyedRequest:
    request = SimRequest(rid, rid, "g", list(range(first, first + 2 * BS + 1)), [7], 0)
    workload = Workload("t", "t", {}, [request], 1)
    return prepare(workload, BlockHasher(HashConfig(block_size=BS))).requests[0]


def store(cluster: Cluster, pod: int, k: KeyedRequest, now: float) -> None:
    """Pod ``pod`` computes ``k``'s two full prompt blocks; the batch leaves at ``now``."""
    pool = cluster.pods[pod].pool
    blocks = pool.allocate(2)
    pool.cache(blocks, k.keys, 0, 2, k.tokens)
    cluster.emit(pod, now)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_decision_waits_only_for_the_batches_that_touch_its_prompt() -> None:
    a, b, c = keyed(1000, 0), keyed(2000, 1), keyed(3000, 2)
    with KvindexProcess(block_size=BS) as service:
        client = IndexClient(service.url)
        cluster = Cluster(
            ClusterSpec(pods=2, blocks_per_pod=64, block_size=BS).for_run(0),
            model=MODEL,
            zmq_endpoint=service.zmq_endpoint,
        )
        try:
            ids = list(cluster.ids())
            streams = cluster.streams
            store(cluster, 0, a, 0.0)
            store(cluster, 1, b, 0.0)
            cluster.release(1.0)
            # Neither batch touches c's blocks: nothing to wait for.
            assert cluster.sync(client, 10.0, c.prompt_keys)
            assert (streams.syncs, streams.skipped) == (0, 1)
            # a's blocks are in pod 0's batch: wait for it, then the index holds them.
            assert cluster.sync(client, 10.0, a.prompt_keys)
            assert streams.syncs == 1
            assert client.score(MODEL, a.request.prompt, ids)[ids[0]] == 2
            assert cluster.sync(client, 10.0)
            assert client.score(MODEL, b.request.prompt, ids)[ids[1]] == 2

            # Pod 0 restarts (seq back to 0) and caches c: a decision on b's prompt
            # must still wait for pod 0 in full, and then the index has dropped a.
            cluster.restart_pod(0, 0.0, client)
            store(cluster, 0, c, 2.0)
            cluster.release(3.0)
            syncs = streams.syncs
            assert cluster.sync(client, 10.0, b.prompt_keys)
            assert streams.syncs == syncs + 1
            assert client.score(MODEL, a.request.prompt, ids)[ids[0]] == 0
            assert client.score(MODEL, c.request.prompt, ids)[ids[0]] == 2
            assert client.sync_timeouts == 0
        finally:
            cluster.close()
            client.close()

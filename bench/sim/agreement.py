"""Does the index hold, block for block, what every simulated pod holds?

Three checks, from the raw sets to what a gateway sees:

1. **keys** - each pod's key set from ``/index/pods/{pod}/blocks`` equals the set of
   hashes its events say it holds: block for block;
2. **counts** - each pod's GPU block count in ``/index/pods`` equals the same number
   (and nothing sits in other tiers);
3. **probes** - for every cached chain (a leaf block of a pod's cache and the blocks
   before it) one ``/score`` call with the chain's tokens must return, for *every* pod,
   exactly the length of the chain's leading run that pod holds.

The pods' event view (copy counts over their own events, kvindex's rule) is the
reference. It equals the pool's true contents under kvindex's default report mode
(``incremental``: every store is a copy); blocks where they would differ are reported
as ``ghost_blocks`` (see ``pool.BlockPool.ghosts``).
"""

from __future__ import annotations

import random
from typing import Any

from bench.sim.cluster import Cluster
from bench.sim.service import IndexClient
from bench.sim.workloads import PreparedWorkload


def check_agreement(
    cluster: Cluster,
    client: IndexClient,
    prepared: PreparedWorkload,
    *,
    max_probes: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Compare the index with the pods; ``agrees`` is the verdict."""
    reports = client.pods()
    views = {pod.pod_id: pod.pool.event_view() for pod in cluster.pods}
    indexed = {pod_id: client.block_keys(pod_id, cluster.model) for pod_id in views}
    pods: dict[str, dict[str, Any]] = {}
    for pod in cluster.pods:
        report = reports.get(pod.pod_id, {})
        tiers = report.get("blocks", {})
        pods[pod.pod_id] = {
            "sim_blocks": len(views[pod.pod_id]),
            "index_blocks": tiers.get("gpu", 0),
            "missing_keys": len(views[pod.pod_id] - indexed[pod.pod_id]),
            "extra_keys": len(indexed[pod.pod_id] - views[pod.pod_id]),
            "index_other_tiers": tiers.get("cpu", 0) + tiers.get("storage", 0),
            "ghost_blocks": len(pod.pool.ghosts),
            "stream_state": report.get("stream_state"),
            "gaps": report.get("gaps"),
            "hash_check": sorted({c["state"] for c in report.get("hash_check", {}).values()}),
            "confirmed_blocks": 0,
            "mismatched_probes": 0,
        }

    where = _locate(prepared, set().union(*views.values()))
    leaves = sorted(set().union(*(_leaves(view, where, prepared) for view in views.values())))
    probed = leaves
    if max_probes is not None and len(leaves) > max_probes:
        probed = sorted(random.Random(seed).sample(leaves, max_probes))
    confirmed: dict[str, set[int]] = {pod_id: set() for pod_id in views}
    pod_ids = list(views)
    mismatches: list[dict[str, Any]] = []
    size = prepared.block_size
    for leaf in probed:
        rid, j = where[leaf]
        k = prepared.by_rid[rid]
        chain = k.keys[: j + 1]
        tokens = (k.request.prompt + k.request.output)[: (j + 1) * size]
        answer = client.score(cluster.model, tokens, pod_ids)
        for pod_id, view in views.items():
            expected = _leading(chain, view)
            got = answer.get(pod_id, 0)
            if got == expected:
                confirmed[pod_id].update(chain[:expected])
            else:
                pods[pod_id]["mismatched_probes"] += 1
                if len(mismatches) < 10:
                    mismatches.append(
                        {"pod": pod_id, "chain_blocks": j + 1, "expected": expected, "got": got}
                    )
    for pod_id, view in views.items():
        entry = pods[pod_id]
        entry["confirmed_blocks"] = len(confirmed[pod_id])
        if probed is leaves:
            entry["unconfirmable_blocks"] = len(view - confirmed[pod_id])
    counts_agree = all(
        p["sim_blocks"] == p["index_blocks"] and p["index_other_tiers"] == 0 for p in pods.values()
    )
    probes_agree = all(p["mismatched_probes"] == 0 for p in pods.values())
    keys_agree = all(views[pod_id] == indexed[pod_id] for pod_id in views)
    return {
        "agrees": keys_agree and counts_agree and probes_agree,
        "keys_agree": keys_agree,
        "counts_agree": counts_agree,
        "probes_agree": probes_agree,
        "chains": len(leaves),
        "probed_chains": len(probed),
        "pods": pods,
        "mismatches": mismatches,
    }


def _locate(prepared: PreparedWorkload, wanted: set[int]) -> dict[int, tuple[int, int]]:
    """Where each wanted key first occurs: (request id, block index)."""
    where: dict[int, tuple[int, int]] = {}
    for k in prepared.requests:
        rid = k.request.rid
        for j, key in enumerate(k.keys):
            if key in wanted and key not in where:
                where[key] = (rid, j)
    return where


def _leaves(
    view: set[int], where: dict[int, tuple[int, int]], prepared: PreparedWorkload
) -> set[int]:
    """Blocks of ``view`` that no other block of ``view`` extends."""
    extended = set()
    for key in view:
        rid, j = where[key]
        if j:
            parent = prepared.by_rid[rid].keys[j - 1]
            if parent in view:
                extended.add(parent)
    return view - extended


def _leading(chain: list[int], view: set[int]) -> int:
    for i, key in enumerate(chain):
        if key not in view:
            return i
    return len(chain)

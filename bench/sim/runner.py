"""One run: a workload, a policy and a cluster, in virtual time.

The loop is discrete-event: arrivals and request completions are taken from a heap in
time order, so pods never sleep and a ten-minute workload runs in seconds. Same-time
completions are handled before arrivals (a freed slot is visible to the router).

Consistency with kvindex (precise runs): at every step boundary the pods publish what
they emitted; before a routing decision the runner flushes the current step and, if
anything was published since the last check, waits until kvindex reports it applied
(its per-stream ``last_seq`` reached the publisher's), with a deadline. So the index
the router asks at virtual time t holds every event the pods published up to t - the
"events arrive in a millisecond" steady state of a real cluster, made deterministic.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

from bench.sim.agreement import check_agreement
from bench.sim.cluster import Cluster, ClusterSpec
from bench.sim.pod import Job
from bench.sim.policies import (
    CacheAware,
    PickRule,
    Policy,
    PolicyContext,
    Precise,
    build_policy,
    uses_index,
)
from bench.sim.progress import SILENT, Progress
from bench.sim.results import GroupStats, RunResult
from bench.sim.service import IndexClient, KvindexProcess
from bench.sim.workloads import KeyedRequest, PreparedWorkload

_FINISH, _ARRIVAL = 0, 1


@dataclass(frozen=True, slots=True)
class RunSpec:
    scenario: str
    policy: str
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    seed: int = 0
    rule: PickRule = field(default_factory=PickRule)
    approx_ratio: float = 0.5
    model: str = "sim-model"
    vllm_version: str = "0.33"
    sync_timeout_s: float = 10.0
    #: Agreement check after a precise run: most chains to probe (None = all).
    max_probes: int | None = 2000


Inspect = Callable[[Cluster, IndexClient], None]


def run(
    prepared: PreparedWorkload,
    spec: RunSpec,
    progress: Progress = SILENT,
    *,
    inspect: Inspect | None = None,
) -> RunResult:
    """Simulate ``prepared`` under ``spec``; a precise run starts its own kvindex.

    ``inspect`` (precise runs) is called with the pods and the index client after the
    run and its agreement check, before kvindex stops: tests look at the service there.
    """
    started = time.perf_counter()
    result = RunResult(spec.scenario, prepared.workload.name, spec.policy)
    result.ideal_prefill_tokens = prepared.ideal_prefill_tokens
    result.no_cache_prefill_tokens = prepared.prompt_tokens
    with ExitStack() as stack:
        client: IndexClient | None = None
        service: KvindexProcess | None = None
        endpoint = None
        if uses_index(spec.policy):
            service = stack.enter_context(KvindexProcess(block_size=spec.cluster.block_size))
            client = IndexClient(service.url)
            stack.callback(client.close)
            endpoint = service.zmq_endpoint
        cluster = Cluster(
            spec.cluster, model=spec.model, zmq_endpoint=endpoint, vllm_version=spec.vllm_version
        )
        stack.callback(cluster.close)
        policy = build_policy(
            spec.policy,
            PolicyContext(
                cluster.ids(),
                spec.cluster.blocks_per_pod,
                seed=spec.seed,
                rule=spec.rule,
                approx_ratio=spec.approx_ratio,
                client=client,
                model=spec.model,
            ),
        )
        try:
            _simulate(prepared, cluster, policy, client, spec, result, progress)
        except Exception as exc:
            if service is not None:
                exc.add_note(f"kvindex log (last lines):\n{service.log_tail()}")
            raise
        _collect(cluster, policy, result)
        if client is not None:
            result.index = {
                "score_calls": client.score_calls,
                "syncs": cluster.syncs,
                "sync_waits": client.sync_waits,
                "sync_timeouts": client.sync_timeouts,
                "sync_wait_s": round(client.sync_wait_s, 3),
                "score_mismatches": policy.mismatches if isinstance(policy, Precise) else None,
                "agreement": check_agreement(
                    cluster, client, prepared, max_probes=spec.max_probes, seed=spec.seed
                ),
            }
            if inspect is not None:
                inspect(cluster, client)
    result.wall_s = time.perf_counter() - started
    return result


def _simulate(
    prepared: PreparedWorkload,
    cluster: Cluster,
    policy: Policy,
    client: IndexClient | None,
    spec: RunSpec,
    result: RunResult,
    progress: Progress,
) -> None:
    pods = cluster.pods
    size = prepared.block_size
    costs = spec.cluster.costs
    heap: list[tuple[float, int, int, object]] = []
    order = itertools.count()
    followers = {k.request.after: k for k in prepared.requests if k.request.after is not None}
    for k in prepared.requests:
        if k.request.after is None:
            heap.append((k.request.start_s, _ARRIVAL, next(order), k))
    heapq.heapify(heap)
    result.requests = len(prepared.requests)

    def started(jobs: list[Job]) -> None:
        for job in jobs:
            heapq.heappush(heap, (job.finish_s, _FINISH, next(order), job))
            request = job.keyed.request
            result.admitted += 1
            result.prompt_tokens += len(request.prompt)
            result.reused_tokens += job.hit_blocks * size
            result.prefill_tokens += job.computed_tokens
            result.prefill_busy_s += costs.prefill_s(job.computed_tokens)
            result.ttfts.append(job.ttft_s)
            group = result.groups.get(request.group)
            if group is None:
                group = result.groups[request.group] = GroupStats()
            group.requests += 1
            group.computed_tokens += job.computed_tokens
            group.fresh_tokens += request.fresh_tokens
            group.pods.add(job.pod)

    def follow(rid: int, now: float) -> None:
        successor = followers.pop(rid, None)
        if successor is not None:
            t = now + successor.request.think_s
            heapq.heappush(heap, (t, _ARRIVAL, next(order), successor))

    now = 0.0
    while heap:
        t, kind, _, item = heapq.heappop(heap)
        if t > now:
            cluster.flush()  # the step at `now` is over
            now = t
        if kind == _FINISH:
            assert isinstance(item, Job)
            pod = pods[item.pod]
            pod.finish(item)
            result.virtual_s = max(result.virtual_s, t)
            started(pod.admit(t))
            follow(item.keyed.request.rid, t)
            progress.update()
            continue
        assert isinstance(item, KeyedRequest)
        cluster.flush()
        if client is not None:
            cluster.sync(client, spec.sync_timeout_s)
        choice = policy.choose(item, pods)
        job = Job(item, t, choice)
        if pods[choice].submit(job):
            started(pods[choice].admit(t))
        else:
            result.rejected += 1
            follow(item.request.rid, t)
            progress.update()
    cluster.flush()
    if client is not None:
        cluster.sync(client, spec.sync_timeout_s)


def _collect(cluster: Cluster, policy: Policy, result: RunResult) -> None:
    result.pods = len(cluster.pods)
    result.routed_per_pod = [pod.routed for pod in cluster.pods]
    result.evicted_blocks = sum(pod.pool.evictions for pod in cluster.pods)
    result.duplicate_stores = sum(pod.pool.duplicate_stores for pod in cluster.pods)
    result.ghost_blocks = sum(len(pod.pool.ghosts) for pod in cluster.pods)
    result.batches = cluster.batches
    result.events = cluster.events
    if isinstance(policy, CacheAware):
        result.spills = policy.spills

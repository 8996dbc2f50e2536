"""One run: a workload, a policy (one instance per gateway replica) and a cluster.

The loop is discrete-event in virtual time: arrivals, pod step ends and faults are taken
from a heap in time order (step ends first at equal times, so a finished request's
blocks are free before the next decision). A pod with work schedules its next step as
soon as the previous one ends (:mod:`bench.sim.pod`), so a ten-minute workload runs in
seconds. Before each event the scrape clock takes the pods' gauges if a scrape tick
passed (:mod:`bench.sim.metrics`): every policy reads load as of that tick, and
kvindex scrapes the same tick from the pods' ``/metrics`` pages (before a kvindex-route
decision the pods serve the tick's pages, and the decision waits until kvindex stored
them).

Each request goes to one gateway replica drawn at random (a session's requests may land
on different replicas, as behind a plain load balancer), or, with the ``direct`` fault,
straight to a random pod. Before a replica whose policy asks kvindex decides, the
runner publishes every event batch due by now (:mod:`bench.sim.lag`) and waits until
kvindex applied those that touch the prompt's blocks (:mod:`bench.sim.streams`), so
decisions see exactly the lagged view, deterministically.
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field

from bench.sim.agreement import check_agreement
from bench.sim.bounds import ideal_hits, prefill_bound, ttft_floor
from bench.sim.cache_policies import CacheAware, KvindexRoute, Precise
from bench.sim.cluster import Cluster, ClusterSpec
from bench.sim.faults import FaultSpec
from bench.sim.lag import LagModel
from bench.sim.metrics import DEFAULT_SCRAPE_S, PodMetricsServers, ScrapeClock
from bench.sim.pod import Job, Step
from bench.sim.policies import PickRule, Policy, PolicyContext, build_policy, uses_index
from bench.sim.progress import SILENT, Progress
from bench.sim.results import RunResult, Slo
from bench.sim.service import IndexClient, KvindexProcess
from bench.sim.workloads import KeyedRequest, PreparedWorkload

_STEP, _FAULT, _ARRIVAL = 0, 1, 2
#: kvindex's scrape settings for kvindex-route runs, in wall-clock seconds: it scrapes
#: again a few ms after storing a round (a page already served this tick is held until
#: the next tick: sim/metrics.py), waits up to the hold for an answer, and never counts
#: a pod's load stale because the simulation was busy elsewhere in wall time.
ROUTE_SCRAPE_ARGS = (
    "--load-interval", "0.005", "--load-timeout", "5", "--load-stale-after", "3600",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RunSpec:
    scenario: str
    policy: str
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    seed: int = 0
    rule: PickRule = field(default_factory=PickRule)
    approx_ratio: float = 1.0
    replicas: int = 1
    lag: LagModel = field(default_factory=LagModel)
    faults: FaultSpec = field(default_factory=FaultSpec)
    slo: Slo = field(default_factory=Slo)
    model: str = "sim-model"
    vllm_version: str = "0.33"
    sync_timeout_s: float = 10.0
    #: Agreement check after a run through kvindex: most chains to probe (None = all).
    max_probes: int | None = 2000
    load: float = 1.0  # the offered-load factor the workload was built with (a label)
    scrape_s: float = DEFAULT_SCRAPE_S  # virtual seconds between scrapes of pod load
    #: /route's cost weights for kvindex-route runs (None: kvindex's defaults).
    route_weights: dict[str, float] | None = None
    #: kvindex-route's max_tokens: the client's field ("client") or the true length.
    route_max_tokens: str = "client"


Inspect = Callable[[Cluster, IndexClient], None]


def run(
    prepared: PreparedWorkload,
    spec: RunSpec,
    progress: Progress = SILENT,
    *,
    inspect: Inspect | None = None,
    service: KvindexProcess | None = None,
) -> RunResult:
    """Simulate ``prepared`` under ``spec``; a run whose policy asks kvindex uses
    ``service`` or starts its own (a shared service must see distinct pods, on a host of
    their own, per run: :meth:`ClusterSpec.for_run`).

    ``inspect`` (kvindex runs) is called with the pods and the index client after the
    run and its agreement check, before kvindex stops: tests look at the service there.
    """
    if spec.replicas < 1:
        raise ValueError("a run needs at least one gateway replica")
    started = time.perf_counter()
    result = RunResult(spec.scenario, prepared.workload.name, spec.policy, slo=spec.slo)
    result.replicas, result.load = spec.replicas, spec.load
    result.faults = spec.faults.label()
    result.ideal_prefill_tokens = prepared.ideal_prefill_tokens
    result.no_cache_prefill_tokens = prepared.prompt_tokens
    with ExitStack() as stack:
        client: IndexClient | None = None
        endpoint = None
        routes = spec.policy == "kvindex-route"
        if not uses_index(spec.policy):
            service = None
        elif service is None or routes:
            # /route scrapes its pods: a kvindex of its own, told the run's pods from the
            # start (--pod-role), so it scrapes them before the first request names them.
            extra: tuple[str, ...] = ()
            if routes:
                roles = [f"--pod-role={pod}=both" for pod in spec.cluster.pod_ids()]
                # Virtual time ages /route's state and the seed breaks its ties: one
                # seed, one set of figures, however fast the machine ran them.
                timing = ("--clock", "external", "--route-seed", str(spec.seed))
                extra = (*ROUTE_SCRAPE_ARGS, *timing, *roles)
            weights = spec.route_weights if routes else None
            service = stack.enter_context(
                KvindexProcess(
                    block_size=spec.cluster.block_size,
                    extra_args=extra,
                    settings={"scoring": {"route_weights": weights}} if weights else None,
                )
            )
        if service is not None:
            client = IndexClient(service.url)
            if routes:
                client.now = 0.0  # the run's virtual time from here on (_Loop.run)
            stack.callback(client.close)
            endpoint = service.zmq_endpoint
        cluster = Cluster(
            spec.cluster,
            model=spec.model,
            zmq_endpoint=endpoint,
            vllm_version=spec.vllm_version,
            lag=spec.lag,
            seed=spec.seed,
        )
        stack.callback(cluster.close)
        metrics = None
        if routes:
            assert service is not None  # a kvindex-route run starts its own (above)
            # Only this run's kvindex proves it stored a tick (another on the host may
            # scrape the same pod addresses).
            metrics = PodMetricsServers(cluster.pods, spec.model, scraper_pid=service.pid)
            stack.callback(metrics.close)
        policies = [
            build_policy(
                spec.policy,
                PolicyContext(
                    cluster.ids(),
                    spec.cluster.blocks_per_pod,
                    seed=spec.seed,
                    rule=spec.rule,
                    approx_ratio=spec.approx_ratio,
                    client=client,
                    model=spec.model,
                    replica=r,
                    route_max_tokens=spec.route_max_tokens,
                ),
            )
            for r in range(spec.replicas)
        ]
        try:
            _Loop(prepared, cluster, policies, client, spec, result, progress, metrics).run()
        except Exception as exc:
            if service is not None:
                exc.add_note(f"kvindex log (last lines):\n{service.log_tail()}")
            raise
        _collect(cluster, policies, result)
        _bounds(prepared, spec.cluster, result)
        if client is not None:
            result.index = {
                "score_calls": client.score_calls,
                "route_calls": client.route_calls,
                "route_reasons": _merged(
                    p.reasons for p in policies if isinstance(p, KvindexRoute)
                ),
                "route_refusals": sum(p.refusals for p in policies if isinstance(p, KvindexRoute)),
                "scrape_waits": metrics.waits if metrics is not None else None,
                "scrape_timeouts": metrics.timeouts if metrics is not None else None,
                "scrape_wait_s": round(metrics.wait_s, 3) if metrics is not None else None,
                "syncs": cluster.streams.syncs,
                "syncs_skipped": cluster.streams.skipped,
                "nudges": cluster.streams.nudges,
                "sync_waits": client.sync_waits,
                "sync_timeouts": client.sync_timeouts,
                "sync_wait_s": round(client.sync_wait_s, 3),
                "stale_decisions": sum(p.stale for p in policies if isinstance(p, Precise))
                if isinstance(policies[0], Precise)
                else None,
                "agreement": check_agreement(
                    cluster, client, prepared, max_probes=spec.max_probes, seed=spec.seed
                ),
            }
            if inspect is not None:
                inspect(cluster, client)
    result.wall_s = time.perf_counter() - started
    return result


class _Loop:
    """The event loop of one run (state shared by its handlers)."""

    def __init__(
        self,
        prepared: PreparedWorkload,
        cluster: Cluster,
        policies: list[Policy],
        client: IndexClient | None,
        spec: RunSpec,
        result: RunResult,
        progress: Progress,
        metrics: PodMetricsServers | None = None,
    ) -> None:
        self.prepared, self.cluster, self.policies = prepared, cluster, policies
        self.client, self.spec, self.result, self.progress = client, spec, result, progress
        self.scrapes = ScrapeClock(cluster.pods, spec.scrape_s)
        self.metrics = metrics  # the pods' /metrics pages kvindex scrapes (kvindex-route)
        self.stored_tick = -1  # the last tick kvindex was seen to have stored
        self.heap: list[tuple[float, int, int, object]] = []
        self.order = itertools.count()
        self.rng = random.Random(spec.seed * 7919 + 17)
        self.steps: dict[int, tuple[int, Step]] = {}  # pod -> (generation, step in flight)
        self.generation = [0] * len(cluster.pods)
        self.followers = {
            k.request.after: k for k in prepared.requests if k.request.after is not None
        }
        for k in prepared.requests:
            if k.request.after is None:
                self.push(k.request.start_s, _ARRIVAL, (k, k.request.start_s))
        self._plan_faults()

    def push(self, t: float, kind: int, item: object) -> None:
        heapq.heappush(self.heap, (t, kind, next(self.order), item))

    def run(self) -> None:
        while self.heap:
            t, kind, _, item = heapq.heappop(self.heap)
            self.scrapes.advance(t)
            if self.client is not None and self.client.now is not None:
                self.client.now = t
            if kind == _STEP:
                self.step_end(t, *item)  # type: ignore[misc]
            elif kind == _FAULT:
                self.fault(t, *item)  # type: ignore[misc]
            else:
                self.arrival(t, *item)  # type: ignore[misc]
        self.cluster.release(float("inf"))
        if self.client is not None:
            self.cluster.sync(self.client, self.spec.sync_timeout_s)

    def _plan_faults(self) -> None:
        faults = self.spec.faults
        span = max((k.request.start_s for k in self.prepared.requests), default=0.0)
        n = len(self.cluster.pods)
        for i, t in enumerate(faults.times(faults.restarts, span)):
            self.push(t, _FAULT, ("restart", i % n))
        for i, t in enumerate(faults.times(faults.resets, span)):
            self.push(t, _FAULT, ("reset", (i + n // 2) % n))

    def kick(self, i: int, now: float) -> None:
        pod = self.cluster.pods[i]
        if pod.busy or not pod.has_work:
            return
        step = pod.schedule()
        if step is None:
            return
        pod.busy = True
        self.steps[i] = (self.generation[i], step)
        self.push(now + step.duration_s, _STEP, (i, self.generation[i]))

    def step_end(self, now: float, i: int, generation: int) -> None:
        if generation != self.generation[i]:
            return  # the pod restarted during the step
        pod = self.cluster.pods[i]
        _, step = self.steps.pop(i)
        pod.busy = False
        firsts, done = pod.complete(step, now)
        self.cluster.emit(i, now)
        for job in firsts:
            if not job.direct:
                self.policies[job.replica].first_token(job)
        for job in done:
            self.result.record(job, self.prepared.block_size)
            self.close(job, now)
        self.result.virtual_s = max(self.result.virtual_s, now)
        self.kick(i, now)

    def close(self, job: Job, now: float) -> None:
        """The request is over (done or refused): tell its replica, send the next one."""
        if not job.direct:
            self.policies[job.replica].finished(job)
        self.progress.update()
        successor = self.followers.pop(job.keyed.request.rid, None)
        if successor is not None:
            t = now + successor.request.think_s
            self.push(t, _ARRIVAL, (successor, t))

    def arrival(self, now: float, k: KeyedRequest, arrival_s: float) -> None:
        spec, pods = self.spec, self.cluster.pods
        if spec.faults.direct and self.rng.random() < spec.faults.direct:
            job = Job(k, arrival_s, self.rng.randrange(len(pods)), -1, direct=True)
            self.result.direct += 1
        else:
            replica = self.rng.randrange(len(self.policies))
            if self.client is not None:
                self.cluster.release(now)
                self.cluster.sync(self.client, spec.sync_timeout_s, k.prompt_keys)
            if self.metrics is not None and self.stored_tick != self.scrapes.tick:
                # Served only when a decision reads it: a tick nobody decides on costs
                # kvindex no scrape (its view is the same at the next decision).
                self.metrics.publish(self.scrapes)
                self.metrics.wait_scraped(spec.sync_timeout_s)
                self.stored_tick = self.scrapes.tick
            choice = self.policies[replica].choose(k, self.scrapes.views)
            job = Job(k, arrival_s, choice, replica)
        if pods[job.pod].submit(job):
            self.kick(job.pod, now)
        else:
            self.result.rejected += 1
            self.close(job, now)

    def fault(self, now: float, kind: str, i: int) -> None:
        if kind == "reset":
            self.cluster.reset_pod(i, now)
            return
        self.generation[i] += 1
        self.steps.pop(i, None)
        self.cluster.pods[i].busy = False
        for job in self.cluster.restart_pod(i, now, self.client):
            if not job.direct:
                self.policies[job.replica].finished(job)
            self.result.retried += 1
            self.push(now, _ARRIVAL, (job.keyed, job.arrival_s))


def _merged(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


#: The last run's bounds: (workload, capacity, arrival order, (bound, floors)). The
#: workload itself is held, so a later workload cannot be mistaken for it.
_LAST_BOUNDS: list[tuple[PreparedWorkload, int, tuple[int, ...], tuple[int, list[float]]]] = []


def _bounds(prepared: PreparedWorkload, cluster: ClusterSpec, result: RunResult) -> None:
    """The run's bounds on its own arrival order (open-loop runs of one workload share
    the order, so the policies after the first reuse it)."""
    rids = tuple(rid for _, rid in sorted(result.arrivals))
    capacity = cluster.pods * cluster.blocks_per_pod
    last = _LAST_BOUNDS[0] if _LAST_BOUNDS else None
    if last is None or last[0] is not prepared or last[1] != capacity or last[2] != rids:
        order = [prepared.by_rid[rid] for rid in rids]
        size = prepared.block_size
        floors = [
            ttft_floor(k, hit, cluster.costs, size)
            for k, hit in zip(order, ideal_hits(order), strict=True)
        ]
        _LAST_BOUNDS[:] = [
            (prepared, capacity, rids, (prefill_bound(order, size, capacity), floors))
        ]
    result.capacity_bound_tokens, result.ttft_floors = _LAST_BOUNDS[0][3]


def _collect(cluster: Cluster, policies: list[Policy], result: RunResult) -> None:
    pods = cluster.pods
    result.pods = len(pods)
    result.routed_per_pod = [pod.routed for pod in pods]
    result.evicted_blocks = sum(pod.pool.evictions for pod in pods)
    result.duplicate_stores = sum(pod.pool.duplicate_stores for pod in pods)
    result.ghost_blocks = sum(len(pod.pool.ghosts) for pod in pods)
    result.preemptions = sum(pod.preemptions for pod in pods)
    result.busy_s = sum(pod.busy_s for pod in pods)
    result.steps = sum(pod.steps for pod in pods)
    result.batched_tokens = sum(pod.batched_tokens for pod in pods)
    result.batches = cluster.batches
    result.events = cluster.events
    result.restarts, result.resets = cluster.restarts, cluster.resets
    result.resets_refused = cluster.resets_refused
    if isinstance(policies[0], CacheAware):
        result.spills = sum(p.spills for p in policies if isinstance(p, CacheAware))

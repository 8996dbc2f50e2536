"""A simulated vLLM pod: the block pool plus vLLM v1's step scheduler.

Each step (``schedule``) follows ``v1/core/sched/scheduler.py`` (0.33):

1. running requests first, in admission order: a decode gets 1 token, an unfinished
   prefill the rest of its prompt, both within the step's token budget (chunked
   prefill). Blocks are allocated as the tokens are scheduled; when the pool has too
   few, the last running request is preempted (its blocks freed - they stay cached -
   and it goes back to the head of the waiting queue to be recomputed), repeatedly,
   until the allocation fits or the request itself was the one preempted;
2. then, only if nothing was preempted this step, waiting requests in FIFO order while
   the budget lasts and fewer than ``max_num_seqs`` run: each looks up its longest
   cached prefix (at most all tokens but the last: vLLM recomputes it for the logits),
   pins it and allocates blocks for its first chunk; a request whose blocks do not fit
   stops admission (FCFS head-of-line);
3. newly full blocks get their hash when scheduled, so the next request already hits
   them (one ``BlockStored`` per request and step, published at the step's end).

When the step ends (``complete``) every scheduled request has computed its tokens; one
whose known tokens are all computed samples its next output token (the first one is
its TTFT); a request with all its output is finished and its blocks are released.

Not modelled: data parallelism, LoRA, cache salts, CPU offload, speculative decoding,
priorities, ``long_prefill_token_threshold`` (0 by default).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from bench.sim.costs import CostModel
from bench.sim.pool import BlockPool
from bench.sim.workloads import KeyedRequest


@dataclass(slots=True, eq=False)
class Job:
    """A request on its pod, with what happened to it."""

    keyed: KeyedRequest
    arrival_s: float
    pod: int
    replica: int = 0
    direct: bool = False  # reached the pod around the router
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is computed (cache hits included)
    produced: int = 0  # output tokens sampled
    cached_blocks: int = 0  # leading blocks that got their hash
    admitted: bool = False
    hit_blocks: int = 0  # cached prefix at first admission
    computed_tokens: int = 0  # prompt tokens computed at first admission's prefill
    recomputed_tokens: int = 0  # tokens computed again after a preemption
    preemptions: int = 0
    first_token_s: float = -1.0
    finish_s: float = -1.0

    @property
    def known(self) -> int:
        """Tokens of the sequence so far: the prompt and the output sampled."""
        return len(self.keyed.request.prompt) + self.produced

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def itl_s(self) -> float:
        """Mean time between output tokens after the first (0 for one-token outputs)."""
        out = len(self.keyed.request.output)
        return (self.finish_s - self.first_token_s) / (out - 1) if out > 1 else 0.0


@dataclass(slots=True)
class Step:
    """One scheduled forward pass: (job, tokens) pairs and its duration."""

    work: list[tuple[Job, int]]
    duration_s: float
    preempted: int = 0


class SimPod:
    """One vLLM engine: ``pod_id`` is the ``ip:port`` a gateway routes to."""

    def __init__(self, pod_id: str, index: int, pool: BlockPool, costs: CostModel) -> None:
        self.pod_id = pod_id
        self.index = index
        self.pool = pool
        self.costs = costs
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.busy = False  # a step is in flight
        self.routed = 0
        self.rejected = 0
        self.preemptions = 0
        self.steps = 0
        self.busy_s = 0.0
        self.batched_tokens = 0
        self.started_s = 0.0  # virtual time of the engine's last (re)start
        #: ... on the engine's own clock, the one its event batches are stamped with
        #: (EnginePublisher stamps time.time()): its /metrics process_start_time_seconds.
        self.started_at = time.time()

    # -- vLLM's /metrics gauges (gateways read them as of a scrape: sim/metrics.py) --

    @property
    def load(self) -> int:
        """Requests in the system: vLLM's ``num_requests_running`` + ``_waiting``."""
        return len(self.running) + len(self.waiting)

    @property
    def waiting_count(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: blocks in use (cached free blocks count free)."""
        return self.pool.used_blocks / self.pool.num_blocks

    @property
    def saturated(self) -> bool:
        """A new request would wait: requests are queued or every sequence slot is taken."""
        return bool(self.waiting) or len(self.running) >= self.costs.max_num_seqs

    # -- the request life cycle -----------------------------------------------------

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False when it is rejected (queue full, or larger than the pool)."""
        self.routed += 1
        too_big = job.keyed.total_blocks > self.pool.num_blocks
        if too_big or len(self.waiting) >= self.costs.max_waiting:
            self.rejected += 1
            return False
        self.waiting.append(job)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> Step | None:
        """Pick this step's work and allocate its blocks; None when nothing can run."""
        budget = self.costs.max_num_batched_tokens
        work: list[tuple[Job, int]] = []
        preempted = 0
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            job = running[i]
            n = min(job.known - job.computed, budget)
            while not self._grow(job, n):
                victim = running.pop()
                self._preempt(victim)
                preempted += 1
                if victim is job:
                    break
            else:
                self._cache(job, job.computed + n)
                work.append((job, n))
                budget -= n
                i += 1
        if not preempted or not work:  # (an empty step would stall the pod)
            budget = self._admit(work, budget)
        if not work:
            return None
        tokens = sum(n for _, n in work)
        context = sum(job.computed + n for job, n in work)
        self.steps += 1
        self.batched_tokens += tokens
        duration = self.costs.step_s(tokens, context)
        self.busy_s += duration
        return Step(work, duration, preempted)

    def complete(self, step: Step, now: float) -> tuple[list[Job], list[Job]]:
        """The step is over at ``now``: returns (jobs with a first token, finished jobs)."""
        firsts, done = [], []
        for job, n in step.work:
            job.computed += n
            if job.computed < job.known:
                continue  # a prefill chunk: no token yet
            job.produced += 1
            if job.produced == 1:
                job.first_token_s = now
                firsts.append(job)
            if job.produced >= len(job.keyed.request.output):
                job.finish_s = now
                done.append(job)
        for job in done:
            self.running.remove(job)
            self.pool.release(job.blocks)
            job.blocks = []
        return firsts, done

    def restart(self, now: float) -> list[Job]:
        """The engine restarts at ``now``: every block and hash is lost; returns the
        requests that were on the pod (the caller decides what happens to them)."""
        self.started_s, self.started_at = now, time.time()
        lost = [*self.running, *self.waiting]
        self.running, self.waiting = [], deque()
        self.pool = BlockPool(self.pool.num_blocks, self.pool.block_size)
        return lost

    # -- internals --------------------------------------------------------------------

    def _admit(self, work: list[tuple[Job, int]], budget: int) -> int:
        pool, size = self.pool, self.pool.block_size
        while self.waiting and budget > 0 and len(self.running) < self.costs.max_num_seqs:
            job = self.waiting[0]
            keys = job.keyed.keys
            limit = min((job.known - 1) // size, len(keys))
            hit_keys = keys[: pool.match(keys[:limit])]
            n = min(job.known - len(hit_keys) * size, budget)
            new = -(-(len(hit_keys) * size + n) // size) - len(hit_keys)
            if new + pool.hit_cost(hit_keys) > pool.free_blocks:
                break  # head-of-line: wait for running requests to free blocks
            self.waiting.popleft()
            job.blocks = pool.touch(hit_keys) + pool.allocate(new)
            job.computed = job.cached_blocks = len(hit_keys)
            job.computed *= size
            if not job.admitted:
                job.admitted = True
                job.hit_blocks = len(hit_keys)
                job.computed_tokens = len(job.keyed.request.prompt) - job.computed
            else:
                job.recomputed_tokens += job.known - job.computed
            self.running.append(job)
            # vLLM's allocate_slots caches as it schedules: the next waiting request of
            # this same step already hits these blocks.
            self._cache(job, job.computed + n)
            work.append((job, n))
            budget -= n
        return budget

    def _grow(self, job: Job, n: int) -> bool:
        """Allocate the blocks ``n`` more tokens need; False when the pool is short."""
        size = self.pool.block_size
        new = -(-(job.computed + n) // size) - len(job.blocks)
        if new <= 0:
            return True
        if new > self.pool.free_blocks:
            return False
        job.blocks.extend(self.pool.allocate(new))
        return True

    def _preempt(self, job: Job) -> None:
        self.pool.release(job.blocks)
        job.blocks = []
        job.computed = job.cached_blocks = 0
        job.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(job)

    def _cache(self, job: Job, computed: int) -> None:
        k = job.keyed
        full = min(computed // self.pool.block_size, len(k.keys))
        if full > job.cached_blocks:
            self.pool.cache(job.blocks, k.keys, job.cached_blocks, full, k.tokens)
            job.cached_blocks = full

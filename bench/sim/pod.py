"""A simulated vLLM pod: the block pool plus a scheduler under the cost model.

The scheduler follows vLLM v1's shape: a FIFO waiting queue; a request is admitted when
a batch slot is free and the pool has blocks for it, and the head of the queue blocks
the rest (FCFS, no skipping ahead). Admission looks up the longest cached prefix,
pins it, allocates the remaining blocks - evicting least recently used cached blocks -
and hashes the prompt's new full blocks at once (vLLM caches blocks when it schedules
them, so the next request already hits them).

Modelled simplifications (each one keeps the pool's events exact and the time model
simple):

* blocks for the whole output are reserved at admission (vLLM allocates them during
  decode and preempts when it runs out; reserving means no preemption);
* the output's full blocks are hashed when the request finishes, in one BlockStored
  (vLLM stores each block as decode fills it); only the finished request could hit them
  before that, so no routing decision differs;
* data parallelism, LoRA, cache salts and CPU offload are not modelled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from bench.sim.costs import CostModel
from bench.sim.pool import BlockPool
from bench.sim.workloads import KeyedRequest


@dataclass(slots=True)
class Job:
    """A request on its pod, with what happened to it."""

    keyed: KeyedRequest
    arrival_s: float
    pod: int
    blocks: list[int] | None = None
    hit_blocks: int = 0
    computed_tokens: int = 0
    admitted_s: float = 0.0
    first_token_s: float = 0.0
    finish_s: float = 0.0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


class SimPod:
    """One vLLM engine: ``pod_id`` is the ``ip:port`` a gateway routes to."""

    def __init__(self, pod_id: str, index: int, pool: BlockPool, costs: CostModel) -> None:
        self.pod_id = pod_id
        self.index = index
        self.pool = pool
        self.costs = costs
        self.waiting: deque[Job] = deque()
        self.running = 0
        self.prefill_free_s = 0.0  # when the prefill queue is next idle
        self.routed = 0
        self.rejected = 0

    @property
    def load(self) -> int:
        """Requests in the system: what a router reads from vLLM's running + waiting."""
        return self.running + len(self.waiting)

    @property
    def saturated(self) -> bool:
        """A new request would wait for a batch slot."""
        return self.load >= self.costs.batch_limit

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False when it is rejected (queue full, or larger than the pool)."""
        self.routed += 1
        too_big = job.keyed.total_blocks > self.pool.num_blocks
        if too_big or len(self.waiting) >= self.costs.max_waiting:
            self.rejected += 1
            return False
        self.waiting.append(job)
        return True

    def admit(self, now: float) -> list[Job]:
        """Start every queued job that fits now, in order; return them."""
        pool, costs = self.pool, self.costs
        size = pool.block_size
        started = []
        while self.waiting and self.running < costs.batch_limit:
            job = self.waiting[0]
            k = job.keyed
            hit = pool.match(k.keys[: k.hit_limit])
            hit_keys = k.keys[:hit]
            new = k.total_blocks - hit
            if new + pool.hit_cost(hit_keys) > pool.free_blocks:
                break  # head-of-line: wait for running requests to free blocks
            self.waiting.popleft()
            blocks = pool.touch(hit_keys) + pool.allocate(new)
            prompt = k.request.prompt
            pool.cache(blocks, k.keys, hit, k.prompt_blocks, prompt)
            job.blocks = blocks
            job.hit_blocks = hit
            job.computed_tokens = len(prompt) - hit * size
            job.admitted_s = now
            start = max(now, self.prefill_free_s)
            job.first_token_s = self.prefill_free_s = start + costs.prefill_s(job.computed_tokens)
            job.finish_s = job.first_token_s + costs.decode_s(len(k.request.output))
            self.running += 1
            started.append(job)
        return started

    def finish(self, job: Job) -> None:
        """The job's last token is out: hash its output blocks, release its blocks."""
        assert job.blocks is not None
        k = job.keyed
        self.pool.cache(
            job.blocks, k.keys, k.prompt_blocks, len(k.keys), k.request.prompt + k.request.output
        )
        self.pool.release(job.blocks)
        self.running -= 1

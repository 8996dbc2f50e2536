"""Bounds no routing policy can beat on a run's own arrivals: how little prefill the
cluster could possibly compute, and how soon each request could possibly start answering.

* **ideal prefill** (:func:`prefill_bound` with no capacity): every distinct block
  computed once - one cache that never forgets.
* **capacity bound on prefill** (:func:`prefill_bound` with the cluster's blocks): the
  cluster's pods together hold at most ``pods x blocks_per_pod`` blocks, so whatever a
  router does, the blocks cached anywhere form one set of at most that many. A request
  routed to pod p reuses at most the longest prefix cached *anywhere*, so every policy
  computes at least what one pooled cache of that size computes on the same arrivals
  when managed with knowledge of the future: Belady's MIN with bypass (keep the blocks
  whose next use is soonest; a block that would be used later than every cached one is
  not kept), which is optimal for uniform per-block costs. A block's next use is its
  next appearance in a later prompt's reusable part, never before its parent's (a
  prompt holding a block holds its parent), and ties go to the deeper block, so the
  pooled cache stays prefix-closed and a "hit" is simply "present". Relaxations that
  only lower it: running requests' blocks need no room, a block counts from its
  request's arrival, and nothing is lost to restarts.
* **TTFT floor** (:func:`ttft_floor`): a request alone on an idle pod, with the longest
  prefix any earlier request could have left (the ideal cache), still waits for its
  prefill steps (chunked at the token budget, each with the step overhead). Every
  policy's TTFT for it is at least that, so its TTFT percentiles are at least the
  floors' percentiles (order statistics are monotone).

The order is the run's own arrival order: sessions are closed loops, so arrivals depend
on the policy, and the bound is stated "on these arrivals".
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from bench.sim.costs import CostModel
from bench.sim.workloads import KeyedRequest

_NEVER = 1 << 62


def ideal_hits(order: Sequence[KeyedRequest]) -> list[int]:
    """Per request (in ``order``), the reusable blocks an unbounded cache would hold."""
    seen: set[int] = set()
    hits = []
    for k in order:
        hit = 0
        for key in k.keys[: k.hit_limit]:
            if key not in seen:
                break
            hit += 1
        hits.append(hit)
        seen.update(k.keys)
    return hits


def prefill_bound(order: Sequence[KeyedRequest], block_size: int, capacity: int | None) -> int:
    """Prefill tokens of the pooled cache of ``capacity`` blocks under Belady's MIN with
    bypass (``None``: unbounded, the ideal prefill)."""
    if capacity is None:
        return sum(
            len(k.request.prompt) - h * block_size
            for k, h in zip(order, ideal_hits(order), strict=True)
        )
    # Next use of each (request, block): the index of the next request whose reusable
    # part holds the key.
    following: dict[int, int] = {}
    next_use: list[list[int]] = [[] for _ in order]
    for i in range(len(order) - 1, -1, -1):
        k = order[i]
        next_use[i] = [following.get(key, _NEVER) for key in k.keys]
        for key in k.keys[: k.hit_limit]:
            following[key] = i
    cached: dict[int, tuple[int, int]] = {}  # key -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key); stale entries skipped
    total = 0
    for i, k in enumerate(order):
        hit = 0
        for key in k.keys[: k.hit_limit]:
            if key not in cached:
                break
            hit += 1
        total += len(k.request.prompt) - hit * block_size
        for depth, (key, use) in enumerate(zip(k.keys, next_use[i], strict=True)):
            if key in cached:
                cached[key] = (use, depth)
                heapq.heappush(heap, (-use, -depth, key))
                continue
            if use == _NEVER:
                continue  # never reused: keeping it cannot help
            if len(cached) >= capacity:
                while heap:
                    neg_use, neg_depth, victim = heap[0]
                    if cached.get(victim) == (-neg_use, -neg_depth):
                        break
                    heapq.heappop(heap)  # stale
                if not heap or (-heap[0][0], -heap[0][1]) <= (use, depth):
                    continue  # bypass: every cached block is needed sooner
                _, _, victim = heapq.heappop(heap)
                del cached[victim]
            cached[key] = (use, depth)
            heapq.heappush(heap, (-use, -depth, key))
    return total


def ttft_floor(k: KeyedRequest, hit_blocks: int, costs: CostModel, block_size: int) -> float:
    """The request's TTFT alone on an idle pod with ``hit_blocks`` cached: its prefill
    in chunks of the step budget, each step with its overhead and context reads."""
    done = hit_blocks * block_size
    left = len(k.request.prompt) - done
    total = 0.0
    while left > 0:
        n = min(left, costs.max_num_batched_tokens)
        total += costs.step_s(n, done + n)
        done += n
        left -= n
    return total

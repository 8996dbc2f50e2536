"""Routing policies: which pod gets the next request.

Load-only policies (what "fair" balancing means in practice):

* ``round-robin`` - the next pod in turn;
* ``random`` - a seeded uniform choice;
* ``least-loaded`` - fewest requests running + waiting;
* ``session-sticky`` - a hash of the session id (a conversation, a document, an agent
  task) picks the pod, as a gateway's consistent-hash affinity does.

Cache-aware policies differ only in where their prefix scores come from; the pick is
shared (:meth:`CacheAware.pick`) so the comparison measures the scores:

* ``approximate`` - remembers the prompt blocks it routed to each pod in a bounded LRU
  (``approximate:R`` sizes it at R x the pod's real capacity; the default is smaller
  than the pod, as estimating routers are configured by guess) and never learns what a
  pod evicted or what it generated;
* ``precise`` - asks the real kvindex (``POST /score``), fed by the pods' ZMQ events;
* ``oracle`` - reads every pod's block pool directly.
"""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from bench.sim.pod import SimPod
from bench.sim.service import IndexClient
from bench.sim.workloads import KeyedRequest

POLICY_NAMES = (
    "round-robin",
    "random",
    "least-loaded",
    "session-sticky",
    "approximate",
    "precise",
    "oracle",
)


class Policy:
    """Picks a pod index for a request, looking at the pods as a gateway can."""

    name: str = "policy"
    uses_index = False

    def choose(self, k: KeyedRequest, pods: Sequence[SimPod]) -> int:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, k: KeyedRequest, pods: Sequence[SimPod]) -> int:
        choice = self._next % len(pods)
        self._next += 1
        return choice


class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, k: KeyedRequest, pods: Sequence[SimPod]) -> int:
        return self._rng.randrange(len(pods))


class LeastLoaded(Policy):
    """Fewest requests in the system; ties go round the pods so none is favoured."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, k: KeyedRequest, pods: Sequence[SimPod]) -> int:
        n = len(pods)
        self._turn += 1
        return min(range(n), key=lambda i: (pods[i].load, (i - self._turn) % n))


class SessionSticky(Policy):
    name = "session-sticky"

    def choose(self, k: KeyedRequest, pods: Sequence[SimPod]) -> int:
        return zlib.crc32(str(k.request.session).encode()) % len(pods)


@dataclass(frozen=True, slots=True)
class PickRule:
    """How cache-aware policies trade cache hits against load.

    A pod is *overloaded* when it is saturated (a new request would wait for a batch
    slot) or runs more than ``margin`` requests ahead of the least loaded pod; the
    others are candidates (all pods, if none is). Each candidate is priced in prefill
    tokens: the prompt tokens it would compute (those beyond its cached prefix) plus
    ``load_tokens`` per request already running or waiting there - a router sees queue
    lengths, not their contents. The cheapest wins: the highest score among pods of
    equal load, the lower load among equal scores, and a cache hit worth N tokens
    outweighs N / ``load_tokens`` requests of extra load. Remaining ties go round the
    pods.
    """

    load_tokens: int = 128
    margin: int = 8


class CacheAware(Policy):
    def __init__(self, rule: PickRule) -> None:
        self.rule = rule
        self._turn = 0
        self.spills = 0  # decisions where the best-scoring pod was not chosen

    def scores(self, k: KeyedRequest, pods: Sequence[SimPod]) -> list[int]:
        raise NotImplementedError

    def choose(self, k: KeyedRequest, pods: Sequence[SimPod]) -> int:
        choice = self.pick(k, self.scores(k, pods), pods)
        self.routed(k, choice)
        return choice

    def routed(self, k: KeyedRequest, choice: int) -> None:
        """Hook for policies that learn from their own decisions."""

    def pick(self, k: KeyedRequest, scores: Sequence[int], pods: Sequence[SimPod]) -> int:
        n = len(pods)
        size = pods[0].pool.block_size
        prompt_blocks = k.prompt_blocks
        loads = [p.load for p in pods]
        ceiling = min(loads) + self.rule.margin
        allowed = [i for i in range(n) if not pods[i].saturated and loads[i] <= ceiling]
        allowed = allowed or list(range(n))
        self._turn += 1
        turn = self._turn

        def price(i: int) -> tuple[int, int, int]:
            uncached = (prompt_blocks - min(scores[i], prompt_blocks)) * size
            return (uncached + loads[i] * self.rule.load_tokens, loads[i], (i - turn) % n)

        best = min(allowed, key=price)
        if scores[best] < max(scores):
            self.spills += 1
        return best


class Approximate(CacheAware):
    """A bounded LRU of routed prompt blocks per pod (what the router *thinks* is cached)."""

    name = "approximate"

    def __init__(self, rule: PickRule, pods: int, capacity_blocks: int) -> None:
        super().__init__(rule)
        self.capacity = max(capacity_blocks, 1)
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(pods)]

    def scores(self, k: KeyedRequest, pods: Sequence[SimPod]) -> list[int]:
        out = []
        keys = k.prompt_keys
        for lru in self._lru:
            matched = 0
            for key in keys:
                if key not in lru:
                    break
                matched += 1
            out.append(matched)
        return out

    def routed(self, k: KeyedRequest, choice: int) -> None:
        lru = self._lru[choice]
        for key in k.prompt_keys:
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > self.capacity:
            lru.popitem(last=False)


class Precise(CacheAware):
    """Scores from the real kvindex. ``mismatches`` counts decisions where the index's
    score for some pod differed from that pod's true cache (expected: 0, since the runner
    waits for the index to apply everything published before asking)."""

    name = "precise"
    uses_index = True

    def __init__(self, rule: PickRule, client: IndexClient, model: str, pod_ids: Sequence[str]):
        super().__init__(rule)
        self.client = client
        self.model = model
        self.pod_ids = list(pod_ids)
        self.mismatches = 0

    def scores(self, k: KeyedRequest, pods: Sequence[SimPod]) -> list[int]:
        matched = self.client.score(self.model, k.request.prompt, self.pod_ids)
        out = [matched.get(pod_id, 0) for pod_id in self.pod_ids]
        keys = k.prompt_keys
        if any(pod.pool.match(keys) != score for pod, score in zip(pods, out, strict=True)):
            self.mismatches += 1
        return out


class Oracle(CacheAware):
    name = "oracle"

    def scores(self, k: KeyedRequest, pods: Sequence[SimPod]) -> list[int]:
        keys = k.prompt_keys
        return [pod.pool.match(keys) for pod in pods]


@dataclass(frozen=True, slots=True)
class PolicyContext:
    pod_ids: Sequence[str]
    blocks_per_pod: int
    seed: int = 0
    rule: PickRule = PickRule()
    approx_ratio: float = 0.5
    client: IndexClient | None = None
    model: str = "sim-model"


def parse_policy(text: str) -> tuple[str, float | None]:
    """``approximate:1.0`` -> ("approximate", 1.0); other names take no argument."""
    name, _, arg = text.partition(":")
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    if arg and name != "approximate":
        raise ValueError(f"policy {name!r} takes no argument")
    try:
        return name, float(arg) if arg else None
    except ValueError:
        raise ValueError(f"approximate:R needs a number R, got {arg!r}") from None


def uses_index(text: str) -> bool:
    return parse_policy(text)[0] == "precise"


def build_policy(text: str, ctx: PolicyContext) -> Policy:
    """A fresh policy (policies keep state: turn counters, LRUs) for one run."""
    name, arg = parse_policy(text)
    n = len(ctx.pod_ids)
    if name == "round-robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(ctx.seed)
    if name == "least-loaded":
        return LeastLoaded()
    if name == "session-sticky":
        return SessionSticky()
    if name == "approximate":
        ratio = ctx.approx_ratio if arg is None else arg
        policy = Approximate(ctx.rule, n, int(ctx.blocks_per_pod * ratio))
        policy.name = text if arg is not None else "approximate"
        return policy
    if name == "precise":
        if ctx.client is None:
            raise ValueError("the precise policy needs a running kvindex")
        return Precise(ctx.rule, ctx.client, ctx.model, ctx.pod_ids)
    return Oracle(ctx.rule)

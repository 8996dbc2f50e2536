"""Routing policies: which pod gets the next request, and the registry that builds them.

A policy is one gateway replica's router: it keeps its own state (turn counters, LRUs,
predicted in-flight work), and the runner builds one instance per replica. Pods' load
(running, waiting, KV usage) is what every replica scrapes, as of the last scrape tick,
the same for all (:mod:`bench.sim.metrics`); a replica also knows what it sent itself
since that tick (:class:`SentSinceScrape`). Cache knowledge is what distinguishes the
policies.

Index-free baselines, here:

* ``round-robin`` - the next pod in turn (per replica);
* ``random`` - a seeded uniform choice;
* ``least-loaded`` - fewest requests running + waiting (the scrape's, plus what this
  replica sent since);
* ``session-sticky`` - a hash of the session id (a conversation, a document, an agent
  task) picks the pod, as a gateway's consistent-hash affinity does;
* ``prefix-hash[:N]`` - consistent hashing with bounded loads (Mirrokni, Thorup and
  Zadimoghaddam 2018, capacity factor 1.25) keyed by the prompt's first N blocks
  (default 16 = 256 tokens): the same leading content goes to the same pod unless
  that pod holds more than 1.25 x its share of the requests in the system.

Cache-aware policies, ``kvindex-route`` (``POST /route``) among them, are in
:mod:`bench.sim.cache_policies`.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.sim.metrics import ScrapedPod
from bench.sim.pod import Job
from bench.sim.service import IndexClient
from bench.sim.workloads import KeyedRequest


class Policy:
    """Picks a pod index for a request, looking at the pods as a gateway can."""

    name: str = "policy"

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        raise NotImplementedError

    def first_token(self, job: Job) -> None:
        """A request this replica routed produced its first token (the response began)."""

    def finished(self, job: Job) -> None:
        """A request this replica routed is complete (or was rejected)."""


class SentSinceScrape:
    """What one replica routed to each pod since the scrape its view comes from: a
    gateway knows what it just sent, while the scrape shows it only from the next tick
    on. ``loads`` is the scrape's requests plus those; ``sent`` counts a decision."""

    def __init__(self) -> None:
        self._tick = -1
        self._sent: list[int] = []

    def loads(self, pods: Sequence[ScrapedPod]) -> list[int]:
        tick = pods[0].tick
        if tick != self._tick:
            self._tick, self._sent = tick, [0] * len(pods)
        return [p.load + n for p, n in zip(pods, self._sent, strict=True)]

    def sent(self, i: int) -> int:
        self._sent[i] += 1
        return i


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self, start: int = 0) -> None:
        self._next = start

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        choice = self._next % len(pods)
        self._next += 1
        return choice


class RandomChoice(Policy):
    name = "random"

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        return self._rng.randrange(len(pods))


class LeastLoaded(Policy):
    """Fewest requests in the system; ties go round the pods so none is favoured."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._turn = 0
        self._since = SentSinceScrape()

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        n = len(pods)
        self._turn += 1
        loads = self._since.loads(pods)
        return self._since.sent(min(range(n), key=lambda i: (loads[i], (i - self._turn) % n)))


class SessionSticky(Policy):
    name = "session-sticky"

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        return zlib.crc32(str(k.request.session).encode()) % len(pods)


class PrefixHash(Policy):
    """Consistent hashing with bounded loads over the prompt's first ``blocks`` blocks."""

    VNODES = 100
    CAPACITY = 1.25

    def __init__(self, pods: int, blocks: int = 16) -> None:
        self.blocks = blocks
        self.name = "prefix-hash" if blocks == 16 else f"prefix-hash:{blocks}"
        ring = sorted(
            (_h64(f"pod{p}#{v}".encode()), p) for p in range(pods) for v in range(self.VNODES)
        )
        self._points = [h for h, _ in ring]
        self._owners = [p for _, p in ring]
        self._since = SentSinceScrape()

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        n = len(pods)
        keys = k.keys[: min(self.blocks, k.prompt_blocks)] or [k.request.rid]
        point = _h64(b"".join(key.to_bytes(8, "little") for key in keys))
        loads = self._since.loads(pods)
        total = sum(loads) + 1
        bound = max(1, -(-self.CAPACITY * total // n))
        start = bisect.bisect(self._points, point)
        seen = set()
        for step in range(len(self._points)):
            owner = self._owners[(start + step) % len(self._points)]
            if owner in seen:
                continue
            seen.add(owner)
            if loads[owner] + 1 <= bound:
                return self._since.sent(owner)
        return self._since.sent(min(range(n), key=lambda i: loads[i]))


def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class PickRule:
    """How the ``precise`` and ``greedy-perfect`` policies trade cache hits against load.

    A pod is *overloaded* when it is saturated (at the last scrape a new request would
    have waited for a batch slot) or runs more than ``margin`` requests ahead of the
    least loaded pod (the scrape's requests plus what this replica sent since); the
    others are candidates (all pods, if none is). Each candidate is priced in prefill
    tokens: the prompt tokens it would compute (those beyond its cached prefix) plus
    ``load_tokens`` per request already running or waiting there - a router sees queue
    lengths, not their contents. The cheapest wins; remaining ties go round the pods.
    """

    load_tokens: int = 128
    margin: int = 8


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What building a policy may use; ``replica`` numbers the gateway replica."""

    pod_ids: Sequence[str]
    blocks_per_pod: int
    seed: int = 0
    rule: PickRule = field(default_factory=PickRule)
    approx_ratio: float = 1.0
    client: IndexClient | None = None
    model: str = "sim-model"
    replica: int = 0
    #: What kvindex-route sends as max_tokens: "client" or "true" (cp.KvindexRoute).
    route_max_tokens: str = "client"


#: name -> (needs kvindex, takes a numeric argument)
POLICIES: dict[str, tuple[bool, bool]] = {
    "round-robin": (False, False),
    "random": (False, False),
    "least-loaded": (False, False),
    "session-sticky": (False, False),
    "prefix-hash": (False, True),
    "approximate": (False, True),
    "llm-d": (False, True),
    "dynamo": (True, False),
    "llm-d-precise": (True, False),
    "precise": (True, False),
    "kvindex-route": (True, False),
    "greedy-perfect": (False, False),
}
POLICY_NAMES = tuple(POLICIES)


def parse_policy(text: str) -> tuple[str, float | None]:
    """``approximate:1.0`` -> ("approximate", 1.0); ``prefix-hash:8``, ``llm-d:2`` too."""
    name, _, arg = text.partition(":")
    if name == "oracle":
        raise ValueError("'oracle' is now 'greedy-perfect' (greedy with perfect cache knowledge)")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    if arg and not POLICIES[name][1]:
        raise ValueError(f"policy {name!r} takes no argument")
    try:
        value = float(arg) if arg else None
    except ValueError:
        raise ValueError(f"{name}:X needs a number X, got {arg!r}") from None
    if value is not None and value <= 0:
        raise ValueError(f"{name}:X needs X > 0, got {arg!r}")
    return name, value


def uses_index(text: str) -> bool:
    return POLICIES[parse_policy(text)[0]][0]


def build_policy(text: str, ctx: PolicyContext) -> Policy:
    """A fresh policy for one gateway replica of one run."""
    from bench.sim import cache_policies as cp  # they build on Policy and PickRule

    name, arg = parse_policy(text)
    n = len(ctx.pod_ids)
    seed = ctx.seed * 1000 + ctx.replica
    simple = {
        "round-robin": lambda: RoundRobin(start=ctx.replica),
        "random": lambda: RandomChoice(seed),
        "least-loaded": LeastLoaded,
        "session-sticky": SessionSticky,
        "prefix-hash": lambda: PrefixHash(n, int(arg) if arg else 16),
        "greedy-perfect": lambda: cp.GreedyPerfect(ctx.rule),
    }
    if name in simple:
        return simple[name]()
    ratio = ctx.approx_ratio if arg is None else arg
    capacity = int(ctx.blocks_per_pod * ratio)
    if name in ("approximate", "llm-d"):
        cls = cp.Approximate if name == "approximate" else cp.LlmD
        policy: Policy = cls(ctx.rule, n, capacity, seed)
        policy.name = text
        return policy
    if ctx.client is None:
        raise ValueError(f"the {name} policy needs a running kvindex")
    if name == "dynamo":
        return cp.Dynamo(ctx.client, ctx.model, ctx.pod_ids, seed)
    if name == "llm-d-precise":
        return cp.LlmDPrecise(ctx.client, ctx.model, ctx.pod_ids, seed)
    if name == "kvindex-route":
        tag = f"{ctx.pod_ids[0]}-{ctx.seed}-{ctx.replica}"
        return cp.KvindexRoute(ctx.client, ctx.model, ctx.pod_ids, tag, ctx.route_max_tokens)
    return cp.Precise(ctx.rule, ctx.client, ctx.model, ctx.pod_ids)

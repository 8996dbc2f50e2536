"""Cache-aware policies: where their prefix scores come from, and how they weigh load.

* ``approximate[:R]`` - remembers the prompt blocks this replica routed to each pod in
  an LRU of R x the pod's blocks (default 1x). A prompt's blocks are touched tail
  first, so its first block is the most recent and the LRU drops tails before heads,
  as vLLM's free queue does. It never learns what a pod evicted, what other replicas
  routed, or what traffic reached a pod around the router. Pick: :class:`PickRule`.
* ``llm-d[:R]`` - llm-d's default scheduling profile: the approximate prefix-cache
  scorer (matched blocks / prompt blocks, the same LRU as ``approximate``), the queue
  scorer ((max - waiting) / (max - min) over the pods) and the KV-cache utilisation
  scorer (1 - KV usage), weighted 2 : 1 : 1, its load as of the last scrape (llm-d's
  endpoint picker scrapes every 50 ms); the highest total wins, ties at random.
* ``dynamo`` - Dynamo's KV router cost (``KvScheduler``, overlap weight 1, temperature
  0), which reads no scrape (Dynamo's router tracks its own active sequences):
  overlap x uncached prefill blocks (its own and those of requests this replica
  sent that have not produced a token yet) + active blocks (requests this replica sent
  that are not done, plus this one's prompt); the lowest wins, ties at random. Overlap
  comes from KV events, as Dynamo's indexer does: here the real kvindex's ``/score``.
* ``precise`` - ``POST /score`` to the real kvindex, fed by the pods' ZMQ events (with
  the run's event lag). Pick: :class:`PickRule`.
* ``kvindex-route`` - ``POST /route`` on the real kvindex (see :class:`KvindexRoute`).
* ``greedy-perfect`` - the same pick as ``precise`` with every pod's true cache, read
  from its block pool at decision time: greedy with perfect cache knowledge. It is
  *not* a bound (it can be beaten by a policy that plans ahead); the bound on prefill is
  the ideal (every distinct block computed once), reported per scenario.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from bench.sim.metrics import ScrapedPod
from bench.sim.pod import Job
from bench.sim.policies import PickRule, Policy, SentSinceScrape
from bench.sim.service import IndexClient
from bench.sim.workloads import KeyedRequest


class CacheAware(Policy):
    """Policies that price pods with :class:`PickRule`; subclasses give the scores."""

    def __init__(self, rule: PickRule) -> None:
        self.rule = rule
        self._turn = 0
        self._since = SentSinceScrape()
        self.spills = 0  # decisions where the best-scoring pod was not chosen

    def scores(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> list[int]:
        raise NotImplementedError

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        choice = self.pick(k, self.scores(k, pods), pods)
        self.routed(k, choice)
        return choice

    def routed(self, k: KeyedRequest, choice: int) -> None:
        """Hook for policies that learn from their own decisions."""

    def pick(self, k: KeyedRequest, scores: Sequence[int], pods: Sequence[ScrapedPod]) -> int:
        n = len(pods)
        size = pods[0].pool.block_size
        prompt_blocks = k.prompt_blocks
        loads = self._since.loads(pods)
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
        return self._since.sent(best)


class RoutedBlocks:
    """Per pod, an LRU of the prompt blocks routed there (what a router *thinks*)."""

    def __init__(self, pods: int, capacity_blocks: int) -> None:
        self.capacity = max(capacity_blocks, 1)
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(pods)]

    def scores(self, keys: Sequence[int]) -> list[int]:
        out = []
        for lru in self._lru:
            matched = 0
            for key in keys:
                if key not in lru:
                    break
                matched += 1
            out.append(matched)
        return out

    def add(self, keys: Sequence[int], pod: int) -> None:
        lru = self._lru[pod]
        for key in reversed(keys):  # tail first: the head ends most recent
            lru[key] = None
            lru.move_to_end(key)
        while len(lru) > self.capacity:
            lru.popitem(last=False)


class Approximate(CacheAware):
    name = "approximate"

    def __init__(self, rule: PickRule, pods: int, capacity_blocks: int, seed: int = 0) -> None:
        super().__init__(rule)
        self.blocks = RoutedBlocks(pods, capacity_blocks)

    def scores(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> list[int]:
        return self.blocks.scores(k.prompt_keys)

    def routed(self, k: KeyedRequest, choice: int) -> None:
        self.blocks.add(k.prompt_keys, choice)


class LlmD(Policy):
    """llm-d's default profile: prefix 2 : queue 1 : KV utilisation 1, max wins."""

    name = "llm-d"
    WEIGHTS = (2.0, 1.0, 1.0)

    def __init__(self, rule: PickRule, pods: int, capacity_blocks: int, seed: int = 0) -> None:
        self.blocks = RoutedBlocks(pods, capacity_blocks)
        self._rng = random.Random(seed)

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        keys = k.prompt_keys
        matched = self.blocks.scores(keys)
        waiting = [p.waiting_count for p in pods]
        low, high = min(waiting), max(waiting)
        w_prefix, w_queue, w_kv = self.WEIGHTS
        totals = []
        for i, pod in enumerate(pods):
            prefix = matched[i] / len(keys) if keys else 0.0
            queue = (high - waiting[i]) / (high - low) if high > low else 1.0
            totals.append(w_prefix * prefix + w_queue * queue + w_kv * (1.0 - pod.kv_usage))
        best = max(totals)
        choice = self._rng.choice([i for i, t in enumerate(totals) if t >= best - 1e-12])
        self.blocks.add(keys, choice)
        return choice


class Precise(CacheAware):
    """Scores from the real kvindex. ``stale`` counts decisions where the index's score
    for some pod differed from that pod's true cache (0 without event lag)."""

    name = "precise"

    def __init__(self, rule: PickRule, client: IndexClient, model: str, pod_ids: Sequence[str]):
        super().__init__(rule)
        self.client = client
        self.model = model
        self.pod_ids = list(pod_ids)
        self.stale = 0

    def scores(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> list[int]:
        matched = self.client.score(self.model, k.request.prompt, self.pod_ids)
        out = [matched.get(pod_id, 0) for pod_id in self.pod_ids]
        keys = k.prompt_keys
        if any(pod.pool.match(keys) != score for pod, score in zip(pods, out, strict=True)):
            self.stale += 1
        return out


class GreedyPerfect(CacheAware):
    name = "greedy-perfect"

    def scores(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> list[int]:
        keys = k.prompt_keys
        return [pod.pool.match(keys) for pod in pods]


class Dynamo(Policy):
    """Dynamo's KV router: overlap-weighted prefill blocks + active blocks, predicted."""

    name = "dynamo"
    OVERLAP_WEIGHT = 1.0

    def __init__(self, client: IndexClient, model: str, pod_ids: Sequence[str], seed: int = 0):
        self.client = client
        self.model = model
        self.pod_ids = list(pod_ids)
        n = len(self.pod_ids)
        self._prefill_tokens = [0] * n
        self._active_blocks = [0] * n
        self._open: dict[int, tuple[int, int, int]] = {}  # rid -> (pod, prefill, blocks)
        self._rng = random.Random(seed)

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        size = pods[0].pool.block_size
        matched = self.client.score(self.model, k.request.prompt, self.pod_ids)
        prompt = len(k.request.prompt)
        blocks = -(-prompt // size)
        costs, news = [], []
        for i, pod_id in enumerate(self.pod_ids):
            overlap = min(matched.get(pod_id, 0), k.hit_limit)
            new = prompt - overlap * size
            news.append(new)
            prefill_blocks = (self._prefill_tokens[i] + new) / size
            decode_blocks = self._active_blocks[i] + blocks
            costs.append(self.OVERLAP_WEIGHT * prefill_blocks + decode_blocks)
        best = min(costs)
        choice = self._rng.choice([i for i, c in enumerate(costs) if c <= best + 1e-12])
        self._prefill_tokens[choice] += news[choice]
        self._active_blocks[choice] += blocks
        self._open[k.request.rid] = (choice, news[choice], blocks)
        return choice

    def first_token(self, job: Job) -> None:
        entry = self._open.get(job.keyed.request.rid)
        if entry is not None and entry[1]:
            pod, prefill, blocks = entry
            self._prefill_tokens[pod] -= prefill
            self._open[job.keyed.request.rid] = (pod, 0, blocks)

    def finished(self, job: Job) -> None:
        self.first_token(job)
        entry = self._open.pop(job.keyed.request.rid, None)
        if entry is not None:
            self._active_blocks[entry[0]] -= entry[2]


class KvindexRoute(Policy):
    """``POST /route`` on the real kvindex: its cost over the index's prefix match, the
    pods' load as kvindex scraped it from their ``/metrics`` pages (the same scrape tick
    every policy reads: :mod:`bench.sim.metrics`), its in-flight ledger, which every
    replica shares (one kvindex), and speculative entries; ``POST
    /route/{id}/first-token`` at the request's first token (as a gateway sees its answer
    begin) and ``POST /route/{id}/done`` when it completes. A 429 (no pod admissible)
    falls back to least-loaded (by the scrape) and is counted."""

    name = "kvindex-route"

    def __init__(self, client: IndexClient, model: str, pod_ids: Sequence[str], tag: str):
        self.client = client
        self.model = model
        self.pod_ids = list(pod_ids)
        self._index = {pod: i for i, pod in enumerate(self.pod_ids)}
        self._tag = tag  # makes route ids unique across runs sharing one kvindex
        self.refusals = 0
        self.reasons: dict[str, int] = {}

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        rid = f"{self._tag}-{k.request.rid}"
        answer = self.client.route(
            self.model, k.request.prompt, self.pod_ids, rid, len(k.request.output)
        )
        if answer is None:
            self.refusals += 1
            return min(range(len(pods)), key=lambda i: (pods[i].load, i))
        pod, reason = answer
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        return self._index[pod]

    def first_token(self, job: Job) -> None:
        self.client.route_first_token(f"{self._tag}-{job.keyed.request.rid}")

    def finished(self, job: Job) -> None:
        self.client.route_done(f"{self._tag}-{job.keyed.request.rid}")

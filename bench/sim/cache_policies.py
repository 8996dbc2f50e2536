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
* ``llm-d-precise`` - llm-d's "precise prefix cache aware" well-lit path: the precise
  prefix-cache scorer (matched blocks from KV events, min-max normalised over the pods
  that matched), the KV-cache utilisation scorer and the queue scorer, weighted
  2 : 1 : 1, max-score picker (:class:`LlmDPrecise`). Its matches are the ones
  ``precise`` reads: the real kvindex's ``/score``.
* ``dynamo`` - Dynamo's KV router cost (``KvScheduler``, overlap weight 1, temperature
  0), which reads no scrape (Dynamo's router tracks its own active sequences):
  overlap x prefill blocks (the uncached prompt tokens of this request and of the
  requests this replica sent there that have not produced a token yet, in blocks) +
  the worker's active blocks *after* adding this request, counted once per distinct
  block (Dynamo's ``ActiveSequences``: blocks shared with a request already active
  there add nothing); the lowest wins, ties at random. Overlap comes from KV events,
  as Dynamo's indexer does: here the real kvindex's ``/score``.
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
from collections import Counter, OrderedDict
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


def llmd_precise_scores(
    matched: Sequence[int],
    waiting: Sequence[int],
    kv_usage: Sequence[float],
    weights: tuple[float, float, float] = (2.0, 1.0, 1.0),
) -> list[float]:
    """llm-d's precise profile's total per pod (higher is better): prefix x its weight +
    KV utilisation x its + queue x its. The prefix score is min-max normalised over
    the pods the index matched at least one block on (the others score 0; one match
    value for all of them scores 1), as llm-d's precise-prefix-cache-scorer does; the
    queue score is (max - waiting) / (max - min) (1 when all are equal); KV
    utilisation scores 1 - usage."""
    w_prefix, w_kv, w_queue = weights
    hits = [m for m in matched if m > 0]
    low_hit, high_hit = (min(hits), max(hits)) if hits else (0, 0)
    low, high = min(waiting), max(waiting)
    totals = []
    for i, m in enumerate(matched):
        if m <= 0:
            prefix = 0.0
        else:
            prefix = (m - low_hit) / (high_hit - low_hit) if high_hit > low_hit else 1.0
        queue = (high - waiting[i]) / (high - low) if high > low else 1.0
        totals.append(w_prefix * prefix + w_kv * (1.0 - kv_usage[i]) + w_queue * queue)
    return totals


class LlmDPrecise(Policy):
    """llm-d's precise-prefix-cache-aware guide's scheduling profile
    (llm-d/llm-d ``guides/precise-prefix-cache-aware/scheduler/
    precise-prefix-cache-aware.values.yaml``: precise-prefix-cache-scorer 2.0,
    kv-cache-utilization-scorer 1.0, queue-scorer 1.0, max-score-picker; the guide's
    older ``gaie-kv-events/values.yaml`` had 3 : 2 : 2), over the index's matches from
    ``/score`` and the pods' load as of the last scrape. Ties are broken at random, as
    the max-score picker shuffles before it picks."""

    name = "llm-d-precise"
    WEIGHTS = (2.0, 1.0, 1.0)  # prefix, KV utilisation, queue

    def __init__(self, client: IndexClient, model: str, pod_ids: Sequence[str], seed: int = 0):
        self.client = client
        self.model = model
        self.pod_ids = list(pod_ids)
        self._rng = random.Random(seed)

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        found = self.client.score(self.model, k.request.prompt, self.pod_ids)
        totals = llmd_precise_scores(
            [found.get(pod_id, 0) for pod_id in self.pod_ids],
            [p.waiting_count for p in pods],
            [p.kv_usage for p in pods],
            self.WEIGHTS,
        )
        best = max(totals)
        return self._rng.choice([i for i, t in enumerate(totals) if t >= best - 1e-12])


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


class ActiveBlocks:
    """One worker's active blocks as Dynamo's router counts them (``ActiveSequences`` in
    ai-dynamo/dynamo ``lib/kv-router/src/sequence.rs``): each distinct prompt block of
    the requests in flight once, however many of them share it, and the uncached
    prompt tokens of those still in prefill."""

    def __init__(self) -> None:
        self._refs: Counter[int] = Counter()
        self.prefill_tokens = 0

    @property
    def blocks(self) -> int:
        return len(self._refs)

    def new_blocks(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` the worker does not hold for a request in flight."""
        return sum(1 for key in set(keys) if key not in self._refs)

    def add(self, keys: Sequence[int], prefill_tokens: int) -> None:
        self._refs.update(set(keys))
        self.prefill_tokens += prefill_tokens

    def prefilled(self, prefill_tokens: int) -> None:
        self.prefill_tokens -= prefill_tokens

    def remove(self, keys: Sequence[int]) -> None:
        self._refs.subtract(set(keys))
        for key in set(keys):
            if self._refs[key] <= 0:
                del self._refs[key]


def dynamo_cost(
    worker: ActiveBlocks, keys: Sequence[int], new_prefill_tokens: int, block_size: int
) -> float:
    """Dynamo's cost of a worker for a request (lower is better), overlap weight 1:
    the prefill blocks it would queue there plus the blocks active there with it."""
    prefill_blocks = (worker.prefill_tokens + new_prefill_tokens) / block_size
    return Dynamo.OVERLAP_WEIGHT * prefill_blocks + worker.blocks + worker.new_blocks(keys)


class Dynamo(Policy):
    """Dynamo's KV router: overlap-weighted prefill blocks + distinct active blocks."""

    name = "dynamo"
    OVERLAP_WEIGHT = 1.0

    def __init__(self, client: IndexClient, model: str, pod_ids: Sequence[str], seed: int = 0):
        self.client = client
        self.model = model
        self.pod_ids = list(pod_ids)
        self._workers = [ActiveBlocks() for _ in self.pod_ids]
        self._open: dict[int, tuple[int, int, list[int]]] = {}  # rid -> (pod, prefill, keys)
        self._rng = random.Random(seed)

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        size = pods[0].pool.block_size
        matched = self.client.score(self.model, k.request.prompt, self.pod_ids)
        prompt = len(k.request.prompt)
        keys = k.prompt_keys
        costs, news = [], []
        for i, pod_id in enumerate(self.pod_ids):
            overlap = min(matched.get(pod_id, 0), k.hit_limit)
            news.append(prompt - overlap * size)
            costs.append(dynamo_cost(self._workers[i], keys, news[-1], size))
        best = min(costs)
        choice = self._rng.choice([i for i, c in enumerate(costs) if c <= best + 1e-12])
        self._workers[choice].add(keys, news[choice])
        self._open[k.request.rid] = (choice, news[choice], keys)
        return choice

    def first_token(self, job: Job) -> None:
        entry = self._open.get(job.keyed.request.rid)
        if entry is not None and entry[1]:
            pod, prefill, keys = entry
            self._workers[pod].prefilled(prefill)
            self._open[job.keyed.request.rid] = (pod, 0, keys)

    def finished(self, job: Job) -> None:
        self.first_token(job)
        entry = self._open.pop(job.keyed.request.rid, None)
        if entry is not None:
            self._workers[entry[0]].remove(entry[2])


class KvindexRoute(Policy):
    """``POST /route`` on the real kvindex: its cost over the index's prefix match, the
    pods' load as kvindex scraped it from their ``/metrics`` pages (the same scrape tick
    every policy reads: :mod:`bench.sim.metrics`), its in-flight ledger, which every
    replica shares (one kvindex), and speculative entries; ``POST
    /route/{id}/first-token`` at the request's first token (as a gateway sees its answer
    begin) and ``POST /route/{id}/done`` when it completes. A 429 (no pod admissible)
    falls back to least-loaded (by the scrape) and is counted.

    ``max_tokens`` is what the gateway forwards from the client's request: by default
    (``client``) the request's own ``max_tokens`` field (:attr:`SimRequest.max_tokens`:
    none for chat, document QA, agents and the trace, as an OpenAI client sends none
    unless told; the output length for inference-perf's fixed-length prompts, which it
    sends with ``ignore_eos``); ``true`` sends the output length the request will
    actually produce, which no gateway knows (an upper bound on what that knowledge
    is worth)."""

    name = "kvindex-route"
    MAX_TOKENS = ("client", "true")

    def __init__(
        self,
        client: IndexClient,
        model: str,
        pod_ids: Sequence[str],
        tag: str,
        max_tokens: str = "client",
    ):
        if max_tokens not in self.MAX_TOKENS:
            raise ValueError(f"max_tokens must be one of {self.MAX_TOKENS}, got {max_tokens!r}")
        self.client = client
        self.model = model
        self.pod_ids = list(pod_ids)
        self._index = {pod: i for i, pod in enumerate(self.pod_ids)}
        self._tag = tag  # makes route ids unique across runs sharing one kvindex
        self._true_length = max_tokens == "true"
        self.refusals = 0
        self.reasons: dict[str, int] = {}

    def max_tokens(self, k: KeyedRequest) -> int | None:
        return len(k.request.output) if self._true_length else k.request.max_tokens

    def choose(self, k: KeyedRequest, pods: Sequence[ScrapedPod]) -> int:
        rid = f"{self._tag}-{k.request.rid}"
        answer = self.client.route(
            self.model, k.request.prompt, self.pod_ids, rid, self.max_tokens(k)
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

"""What serving one prompt on one pod costs, from its cached prefix and its load: a pure
function, the heart of ``POST /route``.

The cost (lower is better) estimates the latency a request adds if sent to the pod, its
own and what it inflicts on other requests, counted in units of this prompt's full
prefill (1.0 = the time to compute every token of the prompt)::

    cost = prefix_w * u / P  +  queue_w * Q / P  +  decode_w * R * (u + F) / P  +  kv_w * usage

- ``P``: the prompt's tokens; ``u``: those the pod must compute, past its cached prefix.
  Only ``(P - 1) // block_size`` blocks can be reused, as vLLM 0.33 always computes the
  prompt's last token (``KVCacheManager.get_computed_blocks``); cached blocks count by
  their tier weight (a CPU block must be copied back first).
  **Prefix term**, weight 2: computing ``u`` costs the request that time, and costs the
  pod's capacity as much again: the requests that reach the pod after it wait behind
  that work (the marginal delay a job adds to an M/M/1 queue is its own service time
  over ``1 - utilisation``: twice it at 50%, the load a router is there for). This is
  also what breaks the tie between waiting for a prefill of the same prompt queued on
  the pod holding it and computing the prompt afresh elsewhere, equal in latency alone:
  reuse wins. Dynamo's router prices the same thing (``overlap_weight x`` uncached
  prefill blocks); llm-d weighs its prefix scorer 2 against queue 1 too.
- ``Q``: prefill tokens queued on the pod ahead of this request, which it waits for
  before its own: the predicted uncached tokens of the requests kvindex routed there
  whose first token has not been reported (the in-flight ledger; a gateway reports it
  with ``POST /route/{id}/first-token``, else it counts until ``done``), plus, for
  waiting requests the scrape shows beyond those (traffic kvindex did not route), one
  prompt of this size each. **Queue term**, weight 1: counted in work, not in requests:
  three 5,000-token prefills queued weigh a hundred times three 50-token chat turns.
  Dynamo's router counts its predicted in-flight prefill blocks the same way.
- ``R``: requests on the pod that will share the engine's steps with this prefill:
  running + waiting as last scraped, or the ledger's in-flight count when that is
  higher (routes since the scrape), plus the sessions homed there between their turns
  (a chat user reading, an agent waiting on a tool: no request in flight, but back on
  this pod in a moment; :mod:`kvindex.scoring.sessions`), counted as the share of
  sessions that do come back. **Decode term**, weight 1: vLLM's chunked prefill
  batches a prefill with every running request's decode step, so each of them waits
  about as long as the prefill computes: ``R x u`` tokens of delay in all. Without it, a
  long shared prefix (an agent's 4,500-token preamble) sends every new session to the
  one pod holding it, whatever runs there, and every decode on that pod stalls behind
  every new session's prefill (bench/README, "Routing comparison"); with it, a new
  session goes to a quieter pod once the prefill it saves is smaller than the stall it
  causes, while a session's later turns, whose uncached part is small, stay with their
  cache. Dynamo's router counts active decode blocks next to prefill blocks; this term
  prices decode load by what actually slows it, a prefill landing on it.
- ``F``: where a session starts (its request continues none), the prefill tokens its
  later turns are expected to bring (a tool's result, the user's next message), from
  the traffic seen: the share of sessions that come back and the mean uncached tokens
  of a turn that continued one (:attr:`kvindex.scoring.sessions.SessionHomes.future_prefill`;
  0 where nothing returns). Each of those prefills stalls the ``R`` decodes on the pod,
  and theirs stall this session's: ``R x u`` prices only the first prefill of a
  session's life, which is where its later turns will live. Without it, at light agent
  load a new task went where the preamble was cached and one or two tasks already ran,
  and their tool results' prefills then shared steps with its decodes on every turn:
  5-6% slower end to end than session-sticky (bench/README, "Later turns' prefills").
  It is the same for every pod, so it moves decisions only where pods' ``R`` differ.
  A later turn (it claimed a home) takes ``F = 0``: it follows its history, and
  pricing its remaining turns there made turns leave their cache for an idler pod and
  recompute it, TTFT p90 +19% at that load for no gain end to end. Under P/D
  ``F = 0`` too: later turns prefill on the prefill pods.
- ``usage``: the fraction of the pod's KV cache in use (mean over its engines), llm-d's
  KV-utilisation scorer: a full cache means preemptions and evicting what others reuse.
  **KV term**, weight 1: a full cache costs as much as prefilling the prompt once.

The weights are operators' to change (``scoring.route_weights``), e.g. a lower ``decode``
when first-token latency matters more than inter-token latency. Unlike llm-d's scores,
which are normalised over the candidates and bounded, the queue and decode terms grow
with the work: a pod twice as busy costs twice as much. (The previous model here, 2 x
uncached fraction + queued requests / 4 + KV usage, counted requests, not work.)

Unknown load (no fresh scrape) is never idle, and never lighter than the busiest known
candidate's: its KV usage counts as full, its ``R`` as one request more than the ledger
holds and its ``Q`` as one prompt of this size more, or the largest ``R`` and ``Q`` of the
candidates whose load is known where those are higher. A pod that stopped answering its
scrapes (killed, blackholed, frozen) so never draws traffic away from busy live pods by
looking cheap. A ``pending`` pod (first scrape not tried yet:
:mod:`kvindex.scoring.targets`) counts one waiting request and an empty cache.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec


class CostWeights(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The cost model's weights; see the module docstring for why these defaults.

    The config file's ``scoring.route_weights`` decodes into this type (a negative
    weight is refused there, naming the field)."""

    prefix: float = 2.0  # the request's own prefill, u / P: its latency and capacity
    queue: float = 1.0  # prefill queued ahead of it, Q / P
    decode: float = 1.0  # the decodes its prefills stall, R x (u + F) / P
    kv: float = 1.0  # KV-cache usage

    def __post_init__(self) -> None:
        if min(self.prefix, self.queue, self.decode, self.kv) < 0:
            raise ValueError("route cost weights must not be negative")


class PodInputs(msgspec.Struct, frozen=True, gc=False):
    """What the cost of one pod is computed from."""

    pod: str
    matched_blocks: int  # the pod's consecutive cached prefix, in blocks
    tier_weighted_blocks: float  # the same blocks weighted by tier (the scorer's score)
    running: int | None  # scraped; None: load unknown (no fresh scrape)
    waiting: int | None  # scraped; None: load unknown
    kv_usage: float | None  # 0..1; None: unknown
    in_flight: int  # requests kvindex routed to the pod that have not finished
    prefilling: int = 0  # of those, the ones whose first token was not reported
    prefill_tokens: int = 0  # their predicted uncached prompt tokens
    sessions: float = 0.0  # expected returning sessions homed on the pod (the ledger's)


class CostTerms(msgspec.Struct, frozen=True, gc=False):
    """One pod's cost and the terms it is made of (shown in /route's answer)."""

    usable_blocks: int  # cached blocks vLLM can reuse for this prompt
    uncached_blocks: float  # blocks to prefill, tier weights applied to the cached ones
    prefix: float  # weighted own-prefill term
    queue: float  # weighted queued-prefill term
    decode: float  # weighted stalled-decodes term
    kv: float  # weighted KV-usage term
    total: float

    @property
    def load(self) -> float:
        return self.queue + self.decode + self.kv


def usable_blocks(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Cached blocks vLLM can reuse: it always computes the last prompt token, so a hit
    covers at most ``prompt_tokens - 1`` tokens (vLLM 0.33, ``get_computed_blocks``)."""
    if prompt_tokens <= 0:
        return 0
    return max(0, min(matched_blocks, (prompt_tokens - 1) // block_size))


def pod_cost(
    inputs: PodInputs,
    prompt_tokens: int,
    block_size: int,
    weights: CostWeights,
    load_only: bool = False,
    future_tokens: float = 0.0,
) -> CostTerms:
    """The cost of serving a ``prompt_tokens``-token prompt on one pod, whose session
    is expected to bring ``future_tokens`` of prefill in its later turns (``F``). With
    ``load_only`` (the index is not trusted) the prefix term is 0 for every pod and the
    decode term takes ``u = P``."""
    return pod_costs([inputs], prompt_tokens, block_size, weights, load_only, future_tokens)[0]


def pod_costs(
    pods: list[PodInputs],
    prompt_tokens: int,
    block_size: int,
    weights: CostWeights,
    load_only: bool = False,
    future_tokens: float = 0.0,
) -> list[CostTerms]:
    """:func:`pod_cost` of each of ``pods``, in one loop: the per-request constants are
    computed once and the loop body is plain arithmetic. The formula's one Python
    reference: ``scoring/_route_pass.c`` computes the same float operations in the same
    order, and ``tests/test_route_pass.py`` holds the two equal."""
    if prompt_tokens > 0:
        total_blocks = -(-prompt_tokens // block_size)
        cap = (prompt_tokens - 1) // block_size
        per_token = 1.0 / prompt_tokens
    else:
        total_blocks = cap = 0
        per_token = 0.0
    w_prefix = 0.0 if load_only else weights.prefix * per_token
    w_queue = weights.queue * per_token
    w_decode, w_kv = weights.decode * per_token, weights.kv
    busiest_sharing, busiest_queued = 0.0, 0
    if any(p.waiting is None for p in pods):
        busiest_sharing, busiest_queued = busiest_known(
            [(p.running or 0, p.waiting, p.in_flight, p.prefilling, p.prefill_tokens, p.sessions)
             for p in pods if p.waiting is not None],
            prompt_tokens,
        )  # fmt: skip
    out = []
    append = out.append
    for p in pods:
        matched = p.matched_blocks
        usable = matched if matched < cap else cap
        # Tier weights scale the reusable part only: the blocks past the cap are not reused.
        hit = p.tier_weighted_blocks * usable / matched if usable > 0 else 0.0
        uncached = total_blocks - hit if total_blocks > hit else 0.0
        # u: the tokens to compute here (all of them when the index is not trusted)
        own = prompt_tokens if load_only else prompt_tokens - hit * block_size
        waiting, flying = p.waiting, p.in_flight
        if waiting is None:  # unknown: never idle, never lighter than the busiest known
            sharing = flying + 1 + p.sessions
            if sharing < busiest_sharing:
                sharing = busiest_sharing
            queued = p.prefill_tokens + prompt_tokens
            if queued < busiest_queued:
                queued = busiest_queued
            usage = 1.0
        else:
            sharing = (p.running or 0) + waiting
            if flying > sharing:
                sharing = flying
            sharing = sharing + p.sessions
            foreign = waiting - p.prefilling
            queued = p.prefill_tokens + (foreign * prompt_tokens if foreign > 0 else 0)
            usage = p.kv_usage
            if usage is None:
                usage = 1.0
            elif usage < 0.0 or usage > 1.0:
                usage = 0.0 if usage < 0.0 else 1.0
        prefix = w_prefix * own
        queue = w_queue * queued
        decode = w_decode * sharing * (own + future_tokens)
        kv = w_kv * usage
        # Not rounded: the answer's floats encode exactly, and rounding costs per pod.
        append(CostTerms(usable, uncached, prefix, queue, decode, kv, prefix + queue + decode + kv))
    return out


def busiest_known(
    known: Iterable[tuple[int, int, int, int, int, float]], prompt_tokens: int
) -> tuple[float, int]:
    """The largest ``R`` and ``Q`` (:func:`pod_costs`'s sharing requests and queued
    tokens) among pods whose load is known, each given as ``(running, waiting,
    in_flight, prefilling, prefill_tokens, sessions)``: the floor of an unknown pod's."""
    most_sharing, most_queued = 0.0, 0
    for running, waiting, flying, prefilling, prefill_tokens, sessions in known:
        sharing = running + waiting
        if flying > sharing:
            sharing = flying
        sharing = sharing + sessions
        foreign = waiting - prefilling
        queued = prefill_tokens + (foreign * prompt_tokens if foreign > 0 else 0)
        if sharing > most_sharing:
            most_sharing = sharing
        if queued > most_queued:
            most_queued = queued
    return most_sharing, most_queued

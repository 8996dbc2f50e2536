"""What serving one prompt on one pod costs, from its cached prefix and its load: a pure
function, the heart of ``POST /route``. Lower is better, in units of this prompt's full
prefill::

    cost = prefix_w * u / P  +  queue_w * Q / P  +  decode_w * R * (u + F) / P  +  kv_w * usage

``P`` the prompt's tokens, ``u`` those the pod must compute past its reusable prefix,
``Q`` the prefill queued ahead of it, ``R`` the requests (and returning sessions) whose
decodes its prefill stalls, ``F`` the prefill its session's later turns will bring,
``usage`` its KV-cache usage. docs/routing.md ("Cost model") says why each term and
weight. A pod whose load is unknown is never idle, nor lighter than the busiest known
candidate. :func:`pod_costs` is the formula's one Python reference (``_route_pass.c``).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec


class CostWeights(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The cost model's weights; docs/routing.md ("Cost model") says why these defaults.

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


def request_constants(
    prompt_tokens: int, block_size: int, weights: CostWeights, load_only: bool
) -> tuple[int, int, float, float, float, float]:
    """What :func:`pod_costs` computes once per request: the prompt's blocks, the cap on
    reusable blocks, and each term's weight per prompt token (the prefix term's is 0
    when the index is not trusted). The compiled loop is handed the same values."""
    if prompt_tokens > 0:
        total_blocks = -(-prompt_tokens // block_size)
        cap = (prompt_tokens - 1) // block_size
        per_token = 1.0 / prompt_tokens
    else:
        total_blocks = cap = 0
        per_token = 0.0
    return (
        total_blocks, cap, 0.0 if load_only else weights.prefix * per_token,
        weights.queue * per_token, weights.decode * per_token, weights.kv,
    )  # fmt: skip


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
    reference: ``scoring/route/_route_pass.c`` computes the same float operations in the same
    order, and ``tests/test_route_pass.py`` holds the two equal."""
    total_blocks, cap, w_prefix, w_queue, w_decode, w_kv = request_constants(
        prompt_tokens, block_size, weights, load_only
    )
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

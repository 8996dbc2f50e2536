"""What serving one prompt on one pod costs, from its cached prefix and its load: a pure
function, the heart of ``POST /route``.

The cost (lower is better) is a weighted sum of three terms, each in 0..1::

    cost = prefix_w * uncached_fraction + queue_w * queue_term + kv_w * kv_usage

- ``uncached_fraction``: the share of the prompt's blocks the pod must prefill. This is
  Dynamo's router term (``overlap_weight * uncached prefill blocks``), divided by the
  prompt's blocks so that it weighs the same against load for a short prompt as for a
  long one. Only ``(num_tokens - 1) // block_size`` blocks can be reused, as vLLM 0.33
  always computes the prompt's last token (``KVCacheManager.get_computed_blocks``); cached
  blocks count by their tier weight (a CPU block must be copied back first).
- ``queue_term``: requests waiting for the pod, ``q / queue_unit`` with
  ``q = waiting + in_flight`` (the scrape's waiting queue plus what kvindex routed there
  and has not seen finish). Linear and unbounded, as a queue's wait grows with its
  length (Dynamo's cost is linear in a worker's load too), and not min-max normalised
  over the candidates (llm-d's queue scorer), so a pod's cost does not depend on who else
  is a candidate. An earlier saturating form, ``q / (q + 4)``, kept the queue term below
  1 while a prefix covering more than half the prompt is worth more than 1 (weight 2):
  such requests then went to the pod holding the prefix however deep its queue, and
  piled up there (bench/README "Noticed" under the simulator: linear, chat-load x1.5
  TTFT p90 2.15 -> 1.31 s, agent-load x1 ITL p50 29.2 -> 21.0 ms, light load unchanged).
- ``kv_usage``: the fraction of the pod's KV cache in use (mean over its engines), llm-d's
  KV-utilisation scorer; a full cache means preemption and evicting what others reuse.

Default weights 2 : 1 : 1 are llm-d's default scorer weights (prefix 2, queue 1, KV
utilisation 1): a full prefix hit is worth as much as going from an idle pod to one with
a deep queue and a full cache, so prefix wins at equal load, and load wins once the
prefix pod is clearly busier. Dynamo's default ``overlap_weight`` of 1 against active
blocks gives prefill and decode load equal say; kvindex cannot see active blocks per pod
(only the scraped usage fraction), so its two load terms play that role.

Unknown load (no fresh scrape) is never idle: its KV term is 1 (full) and its queue
term counts ``queue_unit`` assumed waiting requests on top of its in-flight ones, so it
costs 2 more than an idle pod at the default weights. A pod whose load kvindex cannot
see is chosen only for a strong prefix match or when every known pod is busy.
"""

from __future__ import annotations

import msgspec


class CostWeights(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The cost model's weights; see the module docstring for why these defaults.

    The config file's ``scoring.route_weights`` decodes into this type (a negative
    weight is refused there, naming the field)."""

    prefix: float = 2.0
    queue: float = 1.0
    kv: float = 1.0
    #: Waiting + in-flight requests that cost as much as ``queue`` (the weight): with the
    #: defaults, a pod 8 requests busier costs as much as a full prefix miss.
    queue_unit: float = 4.0

    def __post_init__(self) -> None:
        if min(self.prefix, self.queue, self.kv) < 0:
            raise ValueError("route cost weights must not be negative")
        if self.queue_unit <= 0:
            raise ValueError("queue_unit must be positive")


class PodInputs(msgspec.Struct, frozen=True, gc=False):
    """What the cost of one pod is computed from."""

    pod: str
    matched_blocks: int  # the pod's consecutive cached prefix, in blocks
    tier_weighted_blocks: float  # the same blocks weighted by tier (the scorer's score)
    waiting: int | None  # None: load unknown (no fresh scrape)
    kv_usage: float | None  # 0..1; None: unknown
    in_flight: int  # requests kvindex routed to the pod that have not finished


class CostTerms(msgspec.Struct, frozen=True, gc=False):
    """One pod's cost and the terms it is made of (shown in /route's answer)."""

    usable_blocks: int  # cached blocks vLLM can reuse for this prompt
    uncached_blocks: float  # blocks to prefill, tier weights applied to the cached ones
    prefix: float  # weighted uncached fraction
    queue: float  # weighted queue term
    kv: float  # weighted KV-usage term
    total: float

    @property
    def load(self) -> float:
        return self.queue + self.kv


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
) -> CostTerms:
    """The cost of serving a ``prompt_tokens``-token prompt on one pod. With
    ``load_only`` the prefix term is 0 for every pod (the index is not trusted)."""
    return pod_costs([inputs], prompt_tokens, block_size, weights, load_only)[0]


def pod_costs(
    pods: list[PodInputs],
    prompt_tokens: int,
    block_size: int,
    weights: CostWeights,
    load_only: bool = False,
) -> list[CostTerms]:
    """:func:`pod_cost` of each of ``pods``, in one loop: it runs for every candidate of
    every /route request, so the per-request constants are computed once and the loop
    body is plain arithmetic."""
    if prompt_tokens > 0:
        total_blocks = -(-prompt_tokens // block_size)
        cap = (prompt_tokens - 1) // block_size
    else:
        total_blocks = cap = 0
    w_prefix = 0.0 if load_only or not total_blocks else weights.prefix / total_blocks
    w_queue, w_kv, unit = weights.queue, weights.kv, weights.queue_unit
    out = []
    append = out.append
    for p in pods:
        matched = p.matched_blocks
        usable = matched if matched < cap else cap
        # Tier weights scale the reusable part only: the blocks past the cap are not reused.
        hit = p.tier_weighted_blocks * usable / matched if usable > 0 else 0.0
        uncached = total_blocks - hit if total_blocks > hit else 0.0
        prefix = w_prefix * uncached
        waiting = p.waiting
        pending = p.in_flight + (unit if waiting is None else waiting)  # unknown: never idle
        queue = w_queue * pending / unit
        usage = p.kv_usage
        if usage is None:
            usage = 1.0
        elif usage < 0.0 or usage > 1.0:
            usage = 0.0 if usage < 0.0 else 1.0
        kv = w_kv * usage
        # Not rounded: the answer's floats encode exactly, and rounding costs per pod.
        append(CostTerms(usable, uncached, prefix, queue, kv, prefix + queue + kv))
    return out

"""``/route``'s decision in one pass over its candidate pods: each pod's target, cost
terms, admission and answer row together, then the choice.

Why a second path: the general one builds, per candidate, a routing target
(:func:`kvindex.scoring.targets.build_targets`), its cost inputs, its cost terms and a
router candidate, and only then the answer row: five objects and five passes per pod,
about half of what ``/route`` costs beyond ``/score`` at 64 pods. Here a pod is read
once and its row written once. It covers the common case, pods without data-parallel
ranks and no P/D; :func:`one_pass` answers None otherwise, and the caller takes the
general path, before anything is drawn from the router's RNG.

Same decision, same rows: the cost is :mod:`kvindex.scoring.route_cost`'s formula
term for term (the same float operations in the same order), admission is
:class:`~kvindex.scoring.router.Admission`'s, the choice is
:meth:`~kvindex.scoring.router.Router.choose` itself, and a pod's inputs are what
``build_targets`` gives a rank-0 target. ``tests/test_route_pass.py`` checks both paths
against each other over random fleets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvindex.scoring.inflight import InFlight
from kvindex.scoring.load import PodLoad, Unknown
from kvindex.scoring.router import Reason, Router
from kvindex.scoring.scorer import PodScore
from kvindex.scoring.targets import PENDING_WAITING, has_ranks

R = TypeVar("R")

#: ``row(pod, rank, role, matched_blocks, speculative_blocks, usable_blocks,
#: uncached_blocks, load, running, waiting, kv_usage, in_flight, queued_tokens,
#: prefix_cost, queue_cost, decode_cost, kv_cost, cost, admitted, refused)``: one answer
#: row (``/route``'s RouteCandidate, positionally).
RowMaker = Callable[..., R]


@dataclass(slots=True)
class Pass(Generic[R]):
    """The decision and every candidate's row, in the order of the pods."""

    chosen: int | None  # index into rows and pods; None: no pod admissible
    reason: Reason
    rows: list[R]
    confirmed: int  # the chosen pod's confirmed prefix (its index match)


def one_pass(
    router: Router,
    pods: Sequence[str],
    matches: Mapping[str, PodScore],
    speculative: Mapping[str, int],
    loads: Mapping[str, PodLoad | Unknown],
    in_flight: Mapping[str, InFlight],
    prompt_tokens: int,
    block_size: int,
    fallback: Reason | None,
    row: RowMaker[R],
) -> Pass[R] | None:
    """The decision over ``pods`` (each one routing target, rank 0, role ``both``: no
    P/D) and their answer rows; None when a pod has data-parallel ranks (the general
    path handles them)."""
    if has_ranks(matches) or has_ranks(speculative):
        return None
    weights, admission = router.weights, router.admission
    max_kv, max_waiting = admission.max_kv_usage, admission.max_waiting
    # route_cost.pod_costs's per-request constants
    load_only = fallback is not None
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
    rows: list[R] = []
    append = rows.append
    totals: list[float] = []
    loads_terms: list[float] = []  # only load-only decisions read them
    usables: list[int] = []
    admitted: list[int] = []
    get_match, get_extra, get_flying = matches.get, speculative.get, in_flight.get
    i = -1
    for pod in pods:
        i += 1
        load = loads[pod]
        if type(load) is PodLoad:
            if len(load.engines) > 1:  # one target per engine: the general path
                return None
            state, running = "known", load.running
            waiting, kv_usage, kv_max = load.waiting, load.kv_usage, load.kv_usage_max
        else:
            state, kv_max = load.reason, None
            if state == "pending":
                running, waiting, kv_usage = 0, PENDING_WAITING, 0.0
            else:
                running = waiting = kv_usage = None
        match = get_match(pod)
        extra = get_extra(pod, 0)
        flying_entry = get_flying(pod)
        if flying_entry is None:
            flying = prefilling = prefill_tokens = 0
        else:
            flying, prefilling = flying_entry.requests, flying_entry.prefilling
            prefill_tokens = flying_entry.prefill_tokens
        if match is None:
            confirmed, weighted = 0, 0.0
        else:
            confirmed, weighted = match.matched_blocks, match.score
        # route_cost.pod_costs, term for term
        matched = confirmed + extra
        weighted = weighted + extra
        usable = matched if matched < cap else cap
        hit = weighted * usable / matched if usable > 0 else 0.0
        uncached = total_blocks - hit if total_blocks > hit else 0.0
        own = prompt_tokens if load_only else prompt_tokens - hit * block_size
        if waiting is None:
            sharing = flying + 1
            queued = prefill_tokens + prompt_tokens
            usage = 1.0
        else:
            sharing = (running or 0) + waiting
            if flying > sharing:
                sharing = flying
            foreign = waiting - prefilling
            queued = prefill_tokens + (foreign * prompt_tokens if foreign > 0 else 0)
            usage = kv_usage
            if usage is None:
                usage = 1.0
            elif usage < 0.0 or usage > 1.0:
                usage = 0.0 if usage < 0.0 else 1.0
        prefix = w_prefix * own
        queue = w_queue * queued
        decode = w_decode * sharing * own
        kv = w_kv * usage
        total = prefix + queue + decode + kv
        if (kv_max is not None and kv_max > max_kv) or (
            max_waiting and waiting is not None and waiting > max_waiting
        ):
            refused = admission.refusal(kv_max, waiting)
        else:
            refused = None
            admitted.append(i)
        totals.append(total)
        if load_only:
            loads_terms.append(queue + decode + kv)
        usables.append(usable)
        append(
            row(
                pod, 0, "both", confirmed, extra, usable, uncached, state,
                running if state == "known" else None, waiting, kv_usage, flying,
                prefill_tokens, prefix, queue, decode, kv, total, refused is None, refused,
            )
        )  # fmt: skip
    chosen, reason = router.choose(
        pods if isinstance(pods, list) else list(pods),
        totals,
        loads_terms,
        usables,
        admitted,
        fallback,
    )
    if chosen is None:
        return Pass(None, reason, rows, 0)
    match = get_match(pods[chosen])
    return Pass(chosen, reason, rows, 0 if match is None else match.matched_blocks)

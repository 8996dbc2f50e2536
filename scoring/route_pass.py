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

The candidate loop itself is compiled (``scoring/_route_pass.c``: the Python loop cost
~4 us per pod, more than ``/route``'s whole 0.2 ms budget over ``/score`` at 64 pods);
:func:`_rows_python` is the same loop for builds without a compiler, and the tests run
both. The loop also leaves out the index entries of a pod that restarted unheard, which
the general path does beforehand (``api/route.py``'s ``_drop_restarted``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Generic, TypeVar

from kvindex.scoring.event_lag import Lag
from kvindex.scoring.inflight import InFlight
from kvindex.scoring.load import PodLoad, Unknown
from kvindex.scoring.route_cost import busiest_known
from kvindex.scoring.router import Reason, Router, prefer_included
from kvindex.scoring.scorer import PodScore
from kvindex.scoring.targets import PENDING_WAITING, has_ranks

try:
    from kvindex.scoring import _route_pass as _compiled
except ImportError:  # built without a compiler: the loop runs in Python
    _compiled = None

#: The compiled candidate loop (scoring/_route_pass.c), or None: the Python loop runs.
#: Both give the same rows and decisions (tests/test_route_pass.py swaps them).
compiled = _compiled

R = TypeVar("R")

#: The largest per-pod count (requests, in-flight routes and their prefill tokens,
#: matched and speculative blocks) the candidate loop reads as it is; beyond it, and
#: below 0, a count is clamped. Real counts are far below it (the scraper refuses a page
#: past a million requests); the bound keeps the compiled loop's 64-bit arithmetic from
#: overflowing on a figure that got past those checks, which would fail every /route.
COUNT_MAX = 2**31 - 1


def _count(value: int) -> int:
    """``value`` clamped to 0..COUNT_MAX (``as_count`` in scoring/_route_pass.c)."""
    return value if 0 <= value <= COUNT_MAX else (0 if value < 0 else COUNT_MAX)


def implementation() -> str:
    """``"compiled"`` or ``"python"``: which candidate loop ``/route`` runs."""
    return "compiled" if compiled is not None else "python"


#: ``row(pod, rank, role, matched_blocks, speculative_blocks, usable_blocks,
#: uncached_blocks, load, running, waiting, kv_usage, in_flight, sessions, queued_tokens,
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
    usable: int  # the chosen pod's usable prefix (blocks it need not prefill)
    dropped: list[str]  # pods that restarted unheard: their index entries were ignored
    refused: list[str]  # "pod: why" for each pod refused admission
    saturated: bool = False  # no candidate had KV room: the KV limit was lifted


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
    heard: Mapping[str, Lag] | None = None,
    future_tokens: float = 0.0,
    excluded: Collection[str] = (),
) -> Pass[R] | None:
    """The decision over ``pods`` (each one routing target, rank 0, role ``both``: no
    P/D) and their answer rows; None when a pod has data-parallel ranks (the general
    path handles them).

    ``heard`` (:meth:`kvindex.scoring.event_lag.EventLag.batches`): a pod whose server
    started (``PodLoad.started``) after the engine timestamp of the last batch the index
    applied from it restarted unheard; its match and speculative blocks are left out of
    the decision and it is named in :attr:`Pass.dropped` (``api/route.py``'s
    ``_drop_restarted`` says why, for the general path). ``future_tokens``: the prefill
    the request's session will bring in later turns (the cost's ``F``); ``excluded``:
    the ejected pods (:func:`~kvindex.scoring.router.prefer_included`)."""
    if has_ranks(matches) or has_ranks(speculative):
        return None
    weights, admission = router.weights, router.admission
    # route_cost.pod_costs's per-request constants
    load_only = fallback is not None
    if prompt_tokens > 0:
        total_blocks = -(-prompt_tokens // block_size)
        cap = (prompt_tokens - 1) // block_size
        per_token = 1.0 / prompt_tokens
    else:
        total_blocks = cap = 0
        per_token = 0.0
    max_kv = admission.kv_limit(_known_room(pods, loads))
    saturated = admission.saturated(max_kv)
    refusal = partial(admission.refusal, kv_limit=max_kv)  # names KV only past max_kv
    consts = (
        load_only, prompt_tokens, block_size, total_blocks, cap,
        0.0 if load_only else weights.prefix * per_token, weights.queue * per_token,
        weights.decode * per_token, weights.kv,
        max_kv, admission.max_waiting, PENDING_WAITING,
        float(future_tokens), *_busiest(pods, loads, in_flight, prompt_tokens),
    )  # fmt: skip
    pods = pods if type(pods) is list else list(pods)
    heard = {} if heard is None else heard
    inputs = (pods, matches, speculative, loads, in_flight, heard)
    if compiled is not None and all(type(m) is dict for m in inputs[1:]):
        done = compiled.rows(*inputs, PodLoad, row, refusal, consts)
    else:
        done = _rows_python(*inputs, row, refusal, consts)
    if done is None:
        return None
    rows, totals, loads_terms, usables, admitted, dropped, refused = done
    admitted = prefer_included(pods, admitted, excluded)
    chosen, reason = router.choose(pods, totals, loads_terms, usables, admitted, fallback)
    if chosen is None:
        return Pass(None, reason, rows, 0, 0, dropped, refused, saturated)
    match = matches.get(pods[chosen])
    confirmed = 0 if match is None or pods[chosen] in dropped else match.matched_blocks
    return Pass(chosen, reason, rows, confirmed, usables[chosen], dropped, refused, saturated)


def _known_room(
    pods: Sequence[str], loads: Mapping[str, PodLoad | Unknown]
) -> Iterator[tuple[float | None, int]]:
    """(fullest engine's KV usage, waiting) of each candidate whose load is known, read
    as the candidate loop reads them, for :meth:`~kvindex.scoring.router.Admission.kv_limit`."""
    for pod in pods:
        load = loads[pod]
        if type(load) is PodLoad:
            yield load.kv_usage_max, _count(load.waiting)


def _busiest(
    pods: list[str],
    loads: Mapping[str, PodLoad | Unknown],
    in_flight: Mapping[str, InFlight],
    prompt_tokens: int,
) -> tuple[float, int]:
    """:func:`~kvindex.scoring.route_cost.busiest_known` over the candidates, read as the
    candidate loop reads them; (0, 0) when every candidate's load is known (the usual
    case: no second pass)."""
    if all(type(load) is PodLoad for load in loads.values()):
        return 0.0, 0
    known = []
    for pod in pods:
        load = loads[pod]
        if type(load) is PodLoad:
            running, waiting = _count(load.running), _count(load.waiting)
        elif load.reason == "pending":
            running, waiting = 0, PENDING_WAITING
        else:
            continue
        entry = in_flight.get(pod)
        if entry is None:
            known.append((running, waiting, 0, 0, 0, 0.0))
        else:
            known.append((
                running, waiting, _count(entry.requests), _count(entry.prefilling),
                _count(entry.prefill_tokens), entry.sessions,
            ))  # fmt: skip
    return busiest_known(known, prompt_tokens)


def _rows_python(
    pods: list[str],
    matches: Mapping[str, PodScore],
    speculative: Mapping[str, int],
    loads: Mapping[str, PodLoad | Unknown],
    in_flight: Mapping[str, InFlight],
    heard: Mapping[str, Lag],
    row: RowMaker[R],
    refusal: Callable[[float | None, int | None], str | None],
    consts: tuple,
) -> tuple[list[R], list[float], list[float], list[int], list[int], list[str], list[str]] | None:
    """The candidate loop (``scoring/_route_pass.c`` when compiled): each pod's cost
    terms, admission and row; None when a pod has several engines."""
    (
        load_only, prompt_tokens, block_size, total_blocks, cap, w_prefix, w_queue,
        w_decode, w_kv, max_kv, max_waiting, pending_waiting, future, busiest_sharing,
        busiest_queued,
    ) = consts  # fmt: skip
    rows: list[R] = []
    append = rows.append
    totals: list[float] = []
    loads_terms: list[float] = []  # only load-only decisions read them
    usables: list[int] = []
    admitted: list[int] = []
    dropped: list[str] = []
    refusals: list[str] = []
    get_match, get_extra, get_flying = matches.get, speculative.get, in_flight.get
    i = -1
    for pod in pods:
        i += 1
        load = loads[pod]
        started = None
        if type(load) is PodLoad:
            if len(load.engines) > 1:  # one target per engine: the general path
                return None
            state, running = "known", _count(load.running)
            waiting, kv_usage, kv_max = _count(load.waiting), load.kv_usage, load.kv_usage_max
            started = load.started
        else:
            state, kv_max = load.reason, None
            if state == "pending":
                running, waiting, kv_usage = 0, pending_waiting, 0.0
            else:
                running = waiting = kv_usage = None
        match = get_match(pod)
        extra = _count(get_extra(pod, 0))
        if started is not None and (match is not None or pod in speculative):
            lag = heard.get(pod)
            if lag is not None and lag.ts is not None and lag.ts < started:
                dropped.append(pod)  # restarted unheard: its entries are the old engine's
                match, extra = None, 0
        flying_entry = get_flying(pod)
        if flying_entry is None:
            flying = prefilling = prefill_tokens = 0
            sessions = 0.0
        else:
            flying, prefilling = _count(flying_entry.requests), _count(flying_entry.prefilling)
            prefill_tokens = _count(flying_entry.prefill_tokens)
            sessions = flying_entry.sessions
        if match is None:
            confirmed, weighted = 0, 0.0
        else:
            confirmed, weighted = _count(match.matched_blocks), match.score
        # route_cost.pod_costs, term for term
        matched = confirmed + extra
        weighted = weighted + extra
        usable = matched if matched < cap else cap
        hit = weighted * usable / matched if usable > 0 else 0.0
        uncached = total_blocks - hit if total_blocks > hit else 0.0
        own = prompt_tokens if load_only else prompt_tokens - hit * block_size
        if waiting is None:
            sharing = flying + 1 + sessions
            if sharing < busiest_sharing:
                sharing = busiest_sharing
            queued = prefill_tokens + prompt_tokens
            if queued < busiest_queued:
                queued = busiest_queued
            usage = 1.0
        else:
            sharing = (running or 0) + waiting
            if flying > sharing:
                sharing = flying
            sharing = sharing + sessions
            foreign = waiting - prefilling
            queued = prefill_tokens + (foreign * prompt_tokens if foreign > 0 else 0)
            usage = kv_usage
            if usage is None:
                usage = 1.0
            elif usage < 0.0 or usage > 1.0:
                usage = 0.0 if usage < 0.0 else 1.0
        prefix = w_prefix * own
        queue = w_queue * queued
        decode = w_decode * sharing * (own + future)
        kv = w_kv * usage
        total = prefix + queue + decode + kv
        if (kv_max is not None and kv_max > max_kv) or (
            max_waiting and waiting is not None and waiting > max_waiting
        ):
            refused = refusal(kv_max, waiting)
            refusals.append(f"{pod}: {refused}")
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
                running if state == "known" else None, waiting, kv_usage, flying, sessions,
                prefill_tokens, prefix, queue, decode, kv, total, refused is None, refused,
            )
        )  # fmt: skip
    return rows, totals, loads_terms, usables, admitted, dropped, refusals

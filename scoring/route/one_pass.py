"""``/route``'s decision in one pass over its candidate pods: each pod's cost terms,
admission and answer row together, then the choice.

The general path (:mod:`kvindex.scoring.route.routing`) builds a routing target, cost inputs,
cost terms and a router candidate per pod before its row; this path reads each pod once
and writes its row once. It covers pods without data-parallel ranks and without P/D;
:func:`one_pass` answers None otherwise, before anything is drawn from the router's RNG.
The loop is compiled (``scoring/route/_route_pass.c``); :func:`_rows_python` runs it where
the extension is not built, costing each pod by the formula's one Python reference,
:func:`~kvindex.scoring.route.cost.pod_costs`. ``tests/test_route_pass.py`` holds both
loops and the general path to the same decisions and rows, float for float.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Generic, TypeVar

from kvindex.scoring.load import PodLoad, Unknown
from kvindex.scoring.route.cost import (
    CostWeights,
    PodInputs,
    busiest_known,
    pod_costs,
    request_constants,
)
from kvindex.scoring.route.decision import Reason, Router, prefer_included
from kvindex.scoring.route.event_lag import Lag
from kvindex.scoring.route.inflight import InFlight
from kvindex.scoring.route.targets import PENDING_WAITING, has_ranks
from kvindex.scoring.scorer import PodScore

try:
    from kvindex.scoring.route import _route_pass as _compiled
except ImportError:  # built without a compiler: the loop runs in Python
    _compiled = None

#: The compiled candidate loop (scoring/route/_route_pass.c), or None: the Python loop runs.
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
    """``value`` clamped to 0..COUNT_MAX (``as_count`` in scoring/route/_route_pass.c)."""
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
    preferred: str | None = None,
) -> Pass[R] | None:
    """The decision over ``pods`` (each one routing target, rank 0, role ``both``: no
    P/D) and their answer rows; None when a pod has data-parallel ranks (the general
    path handles them).

    ``heard`` (:meth:`kvindex.scoring.route.event_lag.EventLag.batches`): a pod whose server
    started (``PodLoad.started``) after the engine timestamp of the last batch the index
    applied from it restarted unheard; its match and speculative blocks are left out of
    the decision and it is named in :attr:`Pass.dropped` (the general path drops them
    beforehand: :class:`kvindex.scoring.route.routing.Routing`). ``future_tokens``: the prefill
    the request's session will bring in later turns (the cost's ``F``); ``excluded``:
    the ejected pods (:func:`~kvindex.scoring.route.decision.prefer_included`);
    ``preferred``: the request's session's pod
    (:meth:`~kvindex.scoring.route.decision.Router.choose`)."""
    if has_ranks(matches) or has_ranks(speculative):
        return None
    weights, admission = router.weights, router.admission
    load_only = fallback is not None
    max_kv = admission.kv_limit(_known_room(pods, loads))
    saturated = admission.saturated(max_kv)
    refusal = partial(admission.refusal, kv_limit=max_kv)  # names KV only past max_kv
    pods = pods if type(pods) is list else list(pods)
    heard = {} if heard is None else heard
    inputs = (pods, matches, speculative, loads, in_flight, heard)
    if compiled is not None and all(type(m) is dict for m in inputs[1:]):
        consts = _kernel_consts(
            weights, load_only, prompt_tokens, block_size, max_kv, admission.max_waiting,
            float(future_tokens), _busiest(pods, loads, in_flight, prompt_tokens),
        )  # fmt: skip
        done = compiled.rows(*inputs, PodLoad, row, refusal, consts)
    else:
        done = _rows_python(
            *inputs, row, refusal, weights, load_only, prompt_tokens, block_size,
            float(future_tokens), max_kv, admission.max_waiting,
        )  # fmt: skip
    if done is None:
        return None
    rows, totals, loads_terms, usables, admitted, dropped, refused = done
    admitted = prefer_included(pods, admitted, excluded)
    session = None if preferred is None or saturated else pods.index(preferred)
    chosen, reason = router.choose(pods, totals, loads_terms, usables, admitted, fallback, session)
    if chosen is None:
        return Pass(None, reason, rows, 0, 0, dropped, refused, saturated)
    match = matches.get(pods[chosen])
    confirmed = 0 if match is None or pods[chosen] in dropped else match.matched_blocks
    return Pass(chosen, reason, rows, confirmed, usables[chosen], dropped, refused, saturated)


def _kernel_consts(
    weights: CostWeights,
    load_only: bool,
    prompt_tokens: int,
    block_size: int,
    max_kv: float,
    max_waiting: int,
    future_tokens: float,
    busiest: tuple[float, int],
) -> tuple:
    """The compiled loop's per-request constants: :func:`~kvindex.scoring.route.cost.pod_costs`'s
    (:func:`~kvindex.scoring.route.cost.request_constants`) and admission's limits."""
    return (
        load_only, prompt_tokens, block_size,
        *request_constants(prompt_tokens, block_size, weights, load_only),
        max_kv, max_waiting, PENDING_WAITING, future_tokens, *busiest,
    )  # fmt: skip


def _known_room(
    pods: Sequence[str], loads: Mapping[str, PodLoad | Unknown]
) -> Iterator[tuple[float | None, int]]:
    """(fullest engine's KV usage, waiting) of each candidate whose load is known, read
    as the candidate loop reads them, for
    :meth:`~kvindex.scoring.route.decision.Admission.kv_limit`."""
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
    """:func:`~kvindex.scoring.route.cost.busiest_known` over the candidates, read as the
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
    weights: CostWeights,
    load_only: bool,
    prompt_tokens: int,
    block_size: int,
    future_tokens: float,
    max_kv: float,
    max_waiting: int,
) -> tuple[list[R], list[float], list[float], list[int], list[int], list[str], list[str]] | None:
    """The candidate loop without the compiler: each pod read as ``scoring/route/_route_pass.c``
    reads it, costed by :func:`~kvindex.scoring.route.cost.pod_costs` (the formula's
    reference), then admitted and given its row; None when a pod has several engines."""
    inputs: list[PodInputs] = []
    shown: list[tuple[str, int | None, float | None, float | None, int, int]] = []
    dropped: list[str] = []
    for pod in pods:
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
                running, waiting, kv_usage = 0, PENDING_WAITING, 0.0
            else:
                running = waiting = kv_usage = None
        match = matches.get(pod)
        extra = _count(speculative.get(pod, 0))
        if started is not None and (match is not None or pod in speculative):
            lag = heard.get(pod)
            if lag is not None and lag.ts is not None and lag.ts < started:
                dropped.append(pod)  # restarted unheard: its entries are the old engine's
                match, extra = None, 0
        flying = in_flight.get(pod)
        if flying is None:
            requests = prefilling = prefill_tokens = 0
            sessions = 0.0
        else:
            requests, prefilling = _count(flying.requests), _count(flying.prefilling)
            prefill_tokens = _count(flying.prefill_tokens)
            sessions = flying.sessions
        if match is None:
            confirmed, weighted = 0, 0.0
        else:
            confirmed, weighted = _count(match.matched_blocks), match.score
        inputs.append(
            PodInputs(
                pod, confirmed + extra, weighted + extra, running, waiting, kv_usage,
                requests, prefilling, prefill_tokens, sessions,
            )
        )  # fmt: skip
        running_shown = running if state == "known" else None
        shown.append((state, running_shown, kv_usage, kv_max, confirmed, extra))
    costs = pod_costs(inputs, prompt_tokens, block_size, weights, load_only, future_tokens)
    rows: list[R] = []
    totals: list[float] = []
    loads_terms: list[float] = []  # only load-only decisions read them
    usables: list[int] = []
    admitted: list[int] = []
    refusals: list[str] = []
    for i, (p, terms, (state, running, kv_usage, kv_max, confirmed, extra)) in enumerate(
        zip(inputs, costs, shown, strict=True)
    ):
        waiting = p.waiting
        if (kv_max is not None and kv_max > max_kv) or (
            max_waiting and waiting is not None and waiting > max_waiting
        ):
            refused = refusal(kv_max, waiting)
            refusals.append(f"{p.pod}: {refused}")
        else:
            refused = None
            admitted.append(i)
        totals.append(terms.total)
        if load_only:
            loads_terms.append(terms.load)
        usables.append(terms.usable_blocks)
        rows.append(
            row(
                p.pod, 0, "both", confirmed, extra, terms.usable_blocks, terms.uncached_blocks,
                state, running, waiting, kv_usage, p.in_flight, p.sessions, p.prefill_tokens,
                terms.prefix, terms.queue, terms.decode, terms.kv, terms.total, refused is None,
                refused,
            )
        )  # fmt: skip
    return rows, totals, loads_terms, usables, admitted, dropped, refusals

"""``POST /route``, ``POST /route/{route_id}/first-token`` and ``POST /route/{route_id}/done``:
which pod should serve this request now, from the index's matches, each pod's scraped
load and kvindex's in-flight ledger.

This module only gathers inputs and enters the decision (the HTTP side is
``api/hot_path.py``); the rules are in :mod:`kvindex.scoring.router` and the cost model
in :mod:`kvindex.scoring.route_cost`.
It degrades instead of failing: an unknown model, a tokenizer or index backend that is
unavailable, or messages kvindex cannot tokenize (multimodal content, a template
failing) give a load-only decision whose ``reason`` says why. A candidate whose
entries are in doubt (its stream not in step with its engine, its events late, its
hashes wrong) costs that candidate alone its prefix credit, by the rule of
:mod:`kvindex.scoring.doubt`: the others' prefixes still decide, and its row's ``doubt``
says why. Only bad input (400) and no admissible pod (429 with ``Retry-After``) are
refused. The handler does not await between reading the ledger and entering its
decision, so concurrent requests see each other's routes.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from kvindex.api.json_tokens import decode_prompt
from kvindex.api.offload import BackendBusy, BackendTimeout
from kvindex.api.schemas import RouteCandidate, RouteDone, RouteRequest, RouteResponse
from kvindex.api.score import UntokenizablePrompt, candidate_pods, tokens_of
from kvindex.api.score_inputs import block_keys, hashed_keys, mm_features_of, prompt_form
from kvindex.events.errors import NotFound, TooManyRequests, Unavailable
from kvindex.events.identity import member_pod
from kvindex.indexer.backend import BackendUnavailable
from kvindex.indexer.pods import UNHEARD, UNHEARD_REASON
from kvindex.scoring.doubt import LAGGING, credits_prefix, discredit
from kvindex.scoring.inflight import InFlight
from kvindex.scoring.load import PodLoad, Unknown
from kvindex.scoring.outlier import Outcome
from kvindex.scoring.pd import Role, decide_pd, disaggregated, of_role
from kvindex.scoring.route_pass import Pass, one_pass
from kvindex.scoring.router import Decision, Reason
from kvindex.scoring.scorer import PodScore, ScoreResult
from kvindex.scoring.speculative import annotate
from kvindex.scoring.targets import Target, build_targets
from kvindex.scoring.tokenize import TokenizerUnavailable

if TYPE_CHECKING:
    from kvindex.api.service import Service

DOWN = Reason.FALLBACK_BACKEND_DOWN
_PREFILL = "#prefill"  # the ledger id of a P/D route's prefill share
_route_decoder = msgspec.json.Decoder(RouteRequest)


def decode_route(body: bytes) -> RouteRequest:
    """A JSON ``/route`` body, every decode failure a 400."""
    return decode_prompt(_route_decoder, body)


class NoCapacity(TooManyRequests):
    """No candidate pod is admissible now; ``retry_after`` is the seconds until the
    next scrape may change that."""

    code = "no_capacity"

    def __init__(self, detail: str, retry_after: int) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


@dataclass(slots=True)
class RouteInputs:
    """What a decision needs from the index: the candidate pods and what it says."""

    pods: list[str]
    view: _IndexView


async def route_inputs(service: Service, req: RouteRequest) -> RouteInputs:
    """:func:`index_inputs` under ``service.index_work``'s deadline and cap; past them,
    the pods known without the index and a load-only decision (``fallback`` backend
    down), as when the backend refuses."""
    try:
        return await service.index_work.run(index_inputs, service, req)
    except (BackendTimeout, BackendBusy) as exc:
        known = service.route_view.last_pods()
        pods, ignored = _candidates(
            service, req, known, lambda: {*known, *service.known_without_index()}
        )
        given = len(req.token_ids or [])
        view = _IndexView(given, fallback=DOWN, warnings=[*ignored, exc.detail])
        return RouteInputs(pods, view)


def index_inputs(service: Service, req: RouteRequest) -> RouteInputs:
    """The candidate pods (named, or known: that may read the index) and the index's
    view of ``req``: the part of a route that may wait on the backend or the tokenizer.
    Thread-safe: it reads caches and the backend, and writes only memos."""
    route_view = service.route_view
    pods, ignored = _candidates(service, req, route_view.pods(), route_view.known)
    view = _index_view(service, req, pods) if pods else _IndexView(0)
    if ignored:
        view.warnings[:0] = ignored
    return RouteInputs(pods, view)


def _candidates(
    service: Service,
    req: RouteRequest,
    known_pods: list[str],
    known: Callable[[], Collection[str]],
) -> tuple[list[str], list[str]]:
    """The candidate pods (the named ones kvindex knows, else every known pod) and the
    warning for named pods it does not know, which are left out.

    kvindex scrapes its candidates' metrics and sends traffic to the chosen one, so a
    pod only a request names is never one: it would make kvindex GET any address a
    client writes (cloud metadata, internal services), answer with what it found, and
    count the failures per address for anyone reading /metrics. Pods are known by
    configuration (--zmq-connect, --pod-role), discovery, or the KV events they
    published (:meth:`kvindex.api.service.Service.known_pods`). Raises Unavailable
    (503 ``no_pods``, as when none is known) when no named pod is known."""
    settings = service.settings
    named = candidate_pods(req.pods, settings.events.serving_port, settings.http.max_pods)
    if not named:
        return known_pods, []
    allowed = known()
    pods: list[str] = []
    unknown: list[str] = []
    for pod in dict.fromkeys(named):
        (pods if pod in allowed else unknown).append(pod)
    if not unknown:
        return pods, []
    shown = ", ".join(unknown[:_SHOWN_UNKNOWN])
    if len(unknown) > _SHOWN_UNKNOWN:
        shown += f" and {len(unknown) - _SHOWN_UNKNOWN} more"
    why = "not configured, discovered or publishing KV events"
    if not pods:
        raise Unavailable(
            f"none of the pods named is known to kvindex ({why}): {shown}", code="no_pods"
        )
    return pods, [f"pods not known to kvindex ({why}), ignored: {shown}"]


_SHOWN_UNKNOWN = 8  # unknown pods a warning names (the rest are counted): answers stay small


def decide_route(service: Service, req: RouteRequest, inputs: RouteInputs) -> RouteResponse:
    """The decision over ``inputs``, entered in the ledger and the speculative entries.
    In memory only, and it never awaits: concurrent requests see each other's routes.

    Pods without data-parallel ranks and without P/D take the one-pass path
    (:mod:`kvindex.scoring.route_pass`: each candidate's answer row built once);
    the others the general one (:func:`_decide_targets`). Both decide alike."""
    pods = inputs.pods
    if not pods:
        raise Unavailable(
            "no pods given and none known (configured, discovered or indexed)", code="no_pods"
        )
    view = inputs.view
    view.speculative = annotate(view.result, service.speculative) if view.result else {}
    discredit(view.matches, view.speculative, view.doubts)
    block_size = service.catalog.keying(req.model).hash.block_size
    ledger = service.load.ledger
    view.continues = ledger.arrive(view.keys)  # the session this request continues is back
    loads, in_flight = service.load.snapshot(pods), ledger.all()
    roles = service.roles()
    split = disaggregated(roles, pods)
    # Later turns are priced where a session starts: a later turn follows its history
    # (its u decides), and under P/D later turns prefill on the prefill pods.
    view.future_prefill = 0.0 if view.continues or split else ledger.future_prefill()
    excluded = service.load.outliers.excluded(pods)  # pods ejected after failures
    if req.role is None and not split:
        done = one_pass(
            service.router, pods, view.matches, view.speculative, loads, in_flight,
            view.prompt_tokens, block_size, view.fallback, RouteCandidate,
            service.event_lag.batches(), view.future_prefill, excluded,
        )  # fmt: skip
        if done is not None:
            for pod in done.dropped:  # each a PodLoad with a start time (the loop's rule)
                _ignore_restarted(view, pod, loads[pod].started)  # type: ignore[union-attr]
            answer = _answer_pass(service, req, view, pods, done, block_size)
            return _with_rows_state(service, answer, view.doubts, excluded)
    _drop_restarted(service, loads, view)
    answer = _decide_targets(
        service, req, view, pods, loads, in_flight, roles, block_size, excluded
    )
    return _with_rows_state(service, answer, view.doubts, excluded)


def _with_rows_state(
    service: Service, answer: RouteResponse, doubts: dict[str, str], excluded: dict[str, str]
) -> RouteResponse:
    """Each candidate's doubt, ejection and stream state, and a warning for each
    candidate not heard from since kvindex started: its engine may hold the prompt's
    prefix though the index says nothing of it (doubt ``unheard``: its matches, a lower
    bound, count)."""
    states = service.directory.stream_states()
    if not (doubts or excluded or states):
        return answer
    unheard = set()
    for candidate in answer.candidates:
        pod = candidate.pod
        candidate.ejected = excluded.get(pod)
        state = candidate.stream_state = states.get(pod)
        candidate.doubt = doubts.get(pod) or (UNHEARD if state == UNHEARD else None)
        if state == UNHEARD:
            unheard.add(pod)
    answer.warnings.extend(f"pod {pod}: {UNHEARD_REASON}" for pod in sorted(unheard))
    return answer


def _drop_restarted(
    service: Service, loads: dict[str, PodLoad | Unknown], view: _IndexView
) -> None:
    """A pod whose server started (``process_start_time_seconds``, its clock) after the
    engine timestamp of the last KV-event batch the index applied live from it restarted
    and has not published since: its engine's cache is empty, while the index still holds
    the old engine's blocks until the new engine's first batch arrives (which resets the
    stream). Its matches and speculative entries are dropped from this decision, with a
    warning, so requests whose history it held are not sent back to it for a cache it
    lost. A pod whose page has no start time (several API server processes), or with no
    live batch recorded (none yet, or its stream was just reset), is taken as it is."""
    matches, speculative = view.matches, view.speculative
    if not matches and not speculative:
        return
    last_ts = service.event_lag.last_batch_ts
    for member in [*matches, *(m for m in speculative if m not in matches)]:
        load = loads.get(member_pod(member))
        if type(load) is not PodLoad or load.started is None:
            continue
        heard = last_ts(member)
        if heard is None or heard >= load.started:
            continue
        _ignore_restarted(view, member, load.started)


def _ignore_restarted(view: _IndexView, member: str, started: float) -> None:
    """``member``'s server started at ``started`` and the index has not heard from it
    since: its index entries are left out, with a warning (the one-pass path left them
    out of its decision already)."""
    view.matches.pop(member, None)
    view.speculative.pop(member, None)
    view.warnings.append(
        f"pod {member}: restarted (process start {started:.0f}) and no KV events "
        "since; its index entries are ignored"
    )


def _answer_pass(
    service: Service,
    req: RouteRequest,
    view: _IndexView,
    pods: list[str],
    done: Pass[RouteCandidate],
    block_size: int,
) -> RouteResponse:
    """The one-pass decision entered and answered: its rows are the candidates."""
    service.route_metrics.decided(done.reason)
    if done.saturated:
        _saturated(service, view)
    if done.chosen is None:
        _no_capacity(service, "; ".join(done.refused))
    pod = pods[done.chosen]
    route_id = _enter(
        service, req, view, pod, done.confirmed, view.prompt_tokens, block_size, done.usable
    )
    return RouteResponse(
        route_id=route_id,
        pod=pod,
        rank=0,
        reason=done.reason.value,
        model=req.model,
        block_size=block_size,
        prompt_tokens=view.prompt_tokens,
        prompt_blocks=view.prompt_tokens // block_size,
        candidates=done.rows,
        warnings=view.warnings,
        future_prefill_tokens=view.future_prefill,
    )


def _decide_targets(
    service: Service,
    req: RouteRequest,
    view: _IndexView,
    pods: list[str],
    loads: dict[str, PodLoad | Unknown],
    in_flight: dict[str, InFlight],
    roles: dict[str, Role],
    block_size: int,
    excluded: dict[str, str],
) -> RouteResponse:
    """The general path: one routing target per engine (data-parallel ranks), a role
    filter, P/D."""
    settings = service.settings
    targets = build_targets(pods, view.matches, view.speculative, loads, in_flight)
    if req.role is not None:
        targets = of_role(targets, roles, Role(req.role))
    if not targets:
        raise Unavailable(f"no candidate pod has role {req.role} or both", code="no_pods")
    tokens = view.prompt_tokens
    ejected = {t.member for t in targets if t.pod in excluded}
    if req.role is None and disaggregated(roles, pods):
        pd = decide_pd(
            service.router, targets, roles, tokens, block_size, view.fallback,
            settings.scoring.pd_threshold, ejected,
        )  # fmt: skip
        decision, prefill = pd.decode, pd.prefill
        if decision.pod is not None:
            service.route_metrics.prefill.labels("local" if prefill is None else "remote").inc()
    else:
        pd, prefill = None, None
        decision = service.router.decide(
            [t.inputs for t in targets],
            {t.member: t.kv_usage_max for t in targets},
            tokens,
            block_size,
            view.fallback,
            view.future_prefill,
            ejected,
        )
    service.route_metrics.decided(decision.reason)
    if decision.saturated or (prefill is not None and prefill.saturated):
        _saturated(service, view)
    if decision.pod is None:
        _no_capacity(
            service, "; ".join(f"{c.inputs.pod}: {c.refused}" for c in decision.candidates)
        )
    by_member = {t.member: t for t in targets}
    chosen = by_member[decision.pod]
    terms = next(c.terms for c in decision.candidates if c.inputs.pod == decision.pod)
    remote = prefill is not None and prefill.pod is not None
    route_id = _enter(
        service, req, view, chosen.member, chosen.confirmed_blocks, tokens, block_size,
        None if remote else terms.usable_blocks,
    )  # fmt: skip
    answer = RouteResponse(
        route_id=route_id,
        pod=chosen.pod,
        rank=chosen.rank,
        reason=decision.reason.value,
        model=req.model,
        block_size=block_size,
        prompt_tokens=tokens,
        prompt_blocks=tokens // block_size,
        candidates=_candidates_of(decision, prefill, by_member, roles),
        warnings=view.warnings,
        future_prefill_tokens=view.future_prefill,
    )
    if pd is not None:
        answer.decode_pod = chosen.pod
        answer.prefill_reason = pd.local_why
        if prefill is not None and prefill.pod is not None:
            source = by_member[prefill.pod]
            answer.prefill_pod, answer.prefill_rank = source.pod, source.rank
            answer.prefill_reason = prefill.reason.value
            usable = next(c.terms for c in prefill.candidates if c.inputs.pod == prefill.pod)
            _enter(
                service, req, view, source.member, source.confirmed_blocks, tokens, block_size,
                usable.usable_blocks, prefill_leg=route_id + _PREFILL,
            )  # fmt: skip
    return answer


def _saturated(service: Service, view: _IndexView) -> None:
    """No candidate had KV room, so KV usage refused none of them
    (:meth:`~kvindex.scoring.router.Admission.kv_limit`): say so, and count it."""
    service.route_metrics.saturated.inc()
    limit = service.router.admission.max_kv_usage
    view.warnings.append(
        f"every candidate's KV cache is above --max-kv-usage {limit} (saturated): "
        "all admitted, chosen by cost"
    )


def _no_capacity(service: Service, refused: str) -> None:
    raise NoCapacity(
        f"no pod admissible ({refused or 'no candidate decodes'})",
        max(1, math.ceil(service.settings.scoring.load_interval)),
    )


def _enter(
    service: Service,
    req: RouteRequest,
    view: _IndexView,
    member: str,
    confirmed_blocks: int,
    tokens: int,
    block_size: int,
    usable_blocks: int | None,
    *,
    prefill_leg: str | None = None,
) -> str:
    """Count a routed request against ``member`` in the ledger (under the request's id
    or a new one, which is returned; under ``prefill_leg`` for P/D's prefill share),
    with the prompt tokens past its ``usable_blocks`` as the prefill it queues there
    (none when None: under P/D another pod prefills), and enter the prompt's blocks past
    its confirmed prefix as speculative entries."""
    settings = service.settings
    route_id = prefill_leg or req.request_id or uuid.uuid4().hex
    # The blocks the request will hold at its end: its prompt and expected output.
    held = -(-(tokens + (req.max_tokens or 0)) // block_size)
    prefill = 0 if usable_blocks is None else max(0, tokens - usable_blocks * block_size)
    # Once done, the request's session is homed on the pod that holds its context: the
    # decode pod, not P/D's prefill leg.
    tail = view.keys[-1] if view.keys and prefill_leg is None else None
    # A continuation turn's prefill, once per request: where it is computed.
    turn = view.continues and usable_blocks is not None
    service.load.ledger.begin(
        member, route_id, held, settings.scoring.route_ttl, prefill, tail, continues=turn
    )
    # Speculative: the blocks past what the chosen engine's index entries already hold.
    if len(view.keys) > confirmed_blocks:
        service.speculative.add(req.model, member, view.keys, confirmed_blocks)
    return route_id


def release_route(service: Service, route_id: str, outcome: Outcome | None = None) -> RouteDone:
    """``POST /route/{route_id}/done`` without HTTP; NotFound when it is not open.
    ``outcome``: how the pod answered, for its failure record (:mod:`~kvindex.scoring.outlier`)."""
    member = service.load.ledger.done(route_id)
    service.load.ledger.done(route_id + _PREFILL)  # P/D: the prefill pod's share
    if member is None:
        raise _unknown_route(route_id)
    pod = member_pod(member)
    if outcome is not None:
        service.load.outliers.report(pod, outcome)
    return RouteDone(route_id, pod)


def release_prefill(service: Service, route_id: str) -> RouteDone:
    """``POST /route/{route_id}/first-token`` without HTTP: the request's first token is
    out, so its prefill no longer counts as queued on its pod (and under P/D the prefill
    pod's share ends: its work is done); it counts as a request until ``done``.
    NotFound when the route is not open."""
    ledger = service.load.ledger
    member = ledger.first_token(route_id)
    ledger.done(route_id + _PREFILL)
    if member is None:
        raise _unknown_route(route_id)
    return RouteDone(route_id, member_pod(member))


def _unknown_route(route_id: str) -> NotFound:
    return NotFound(
        f"no open route {route_id!r} (never routed, already done, or past --route-ttl)",
        code="unknown_route",
    )


@dataclass(slots=True)
class _IndexView:
    """What the index says about a request, or why it cannot say (``fallback``)."""

    prompt_tokens: int
    keys: list[int] = field(default_factory=list)
    matches: dict[str, PodScore] = field(default_factory=dict)
    speculative: dict[str, int] = field(default_factory=dict)
    fallback: Reason | None = None
    warnings: list[str] = field(default_factory=list)
    doubts: dict[str, str] = field(default_factory=dict)  # pod -> why its entries are doubted
    # The lookup's answer, for the speculative entries: annotated on the event loop.
    result: ScoreResult | None = None
    continues: bool = False  # the request claimed a session's home (set by the decision)
    future_prefill: float = 0.0  # the cost's F: its session's later turns' prefill tokens


def _index_view(service: Service, req: RouteRequest, pods: list[str]) -> _IndexView:
    """The prompt's tokens and keys, each member's match (and speculative blocks past
    it), and the fallback when the index cannot be trusted or asked for this request."""
    try:
        known_model = service.knows_model(req.model)
    except BackendUnavailable as exc:  # it asks the index for the models it holds
        return _IndexView(0, fallback=DOWN, warnings=[f"index backend unavailable: {exc}"])
    if not known_model:
        form = prompt_form(req)
        if form == "block_hashes":  # a load-only decision, but for a well-formed request
            blocks = len(block_keys(req.block_hashes or []))
            given = blocks * service.catalog.keying(req.model).hash.block_size
        else:
            given = len(req.token_ids or [])
        return _IndexView(given, fallback=Reason.FALLBACK_UNKNOWN_MODEL)
    settings = service.settings
    keys = None
    try:
        if req.block_hashes is not None:
            keys = hashed_keys(service, req, settings.http.max_prompt_tokens)
        else:
            tokens = tokens_of(
                service, req, settings.http.max_prompt_tokens, settings.http.max_prompt_chars
            )
    except TokenizerUnavailable as exc:
        return _IndexView(0, fallback=Reason.FALLBACK_TOKENIZER_UNAVAILABLE, warnings=[exc.detail])
    except UntokenizablePrompt as exc:  # the pod may serve it: a router must not refuse it
        reason = Reason.FALLBACK_MULTIMODAL if exc.multimodal else Reason.FALLBACK_UNTOKENIZABLE
        return _IndexView(0, fallback=reason, warnings=[exc.detail])
    if keys is None:
        prompt_tokens = len(tokens)
    else:
        prompt_tokens = len(keys) * service.catalog.keying(req.model).hash.block_size
    try:  # bad keys (an unknown LoRA, token ids out of range) are ClientErrors: 400
        # No member filter: a pod's data-parallel ranks are members of their own.
        if keys is not None:
            result = service.scorer.score_keys(req.model, keys)
        else:
            result = service.scorer.score(
                req.model,
                tokens,
                lora_name=req.lora_name,
                cache_salt=req.cache_salt,
                mm_features=mm_features_of(req, len(tokens)),
            )
    except BackendUnavailable as exc:
        return _IndexView(
            prompt_tokens, fallback=DOWN, warnings=[f"index backend unavailable: {exc}"]
        )
    wanted = set(pods)
    matches = {p.pod: p for p in result.pods if p.pod in wanted or member_pod(p.pod) in wanted}
    view = _IndexView(prompt_tokens, result.keys, matches, result=result)
    doubts = service.route_view.doubts(req.model, pods)
    max_lag = settings.scoring.max_event_lag
    for pod, lag in service.event_lag.lagging(pods, max_lag).items():
        doubts.setdefault(
            pod, (LAGGING, f"event lag {lag:.1f} s, above --max-event-lag {max_lag:g}")
        )
    if doubts:
        view.doubts = {pod: doubt for pod, (doubt, _) in doubts.items()}
        view.warnings = [
            f"pod {pod}: {why}"
            + ("" if credits_prefix(doubt) else "; its index entries are not credited")
            for pod, (doubt, why) in sorted(doubts.items())
        ]
    return view


def _candidates_of(
    decision: Decision,
    prefill: Decision | None,
    targets: dict[str, Target],
    roles: dict[str, Role],
) -> list[RouteCandidate]:
    """Every costed target once: the decode (or only) decision's, then the prefill
    decision's targets that only prefill. One row per candidate of every request:
    positional construction, no per-row lookups beyond the target's."""
    out: list[RouteCandidate] = []
    seen: set[str] = set()
    both = Role.BOTH.value
    role_of = {pod: role.value for pod, role in roles.items()}
    for made in (decision, prefill):
        for c in made.candidates if made is not None else ():
            member = c.inputs.pod
            if prefill is not None:  # only P/D's two decisions can share a member
                if member in seen:
                    continue
                seen.add(member)
            target = targets[member]
            load = target.load
            known = type(load) is PodLoad
            terms, inputs = c.terms, c.inputs
            out.append(
                RouteCandidate(
                    target.pod,
                    target.rank,
                    role_of.get(target.pod, both),
                    target.confirmed_blocks,
                    target.speculative_blocks,
                    terms.usable_blocks,
                    terms.uncached_blocks,
                    "known" if known else load.reason,
                    load.running if known else None,
                    inputs.waiting,
                    inputs.kv_usage,
                    inputs.in_flight,
                    inputs.sessions,
                    inputs.prefill_tokens,
                    terms.prefix,
                    terms.queue,
                    terms.decode,
                    terms.kv,
                    terms.total,
                    c.refused is None,
                    c.refused,
                )
            )
    return out

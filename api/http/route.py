"""``POST /route``, ``POST /route/{route_id}/first-token`` and ``POST /route/{route_id}/done``
over HTTP's inputs: which pod should serve this request now.

This module gathers a request's inputs (its candidate pods and the index's view of its
prompt), hands them to :class:`kvindex.scoring.route.routing.Routing`, which decides and keeps
the routing state, and renders the answer; the HTTP side is ``api/http/hot_path.py``.
It degrades instead of failing: an unknown model, an index backend or tokenizer that is
unavailable, or messages kvindex cannot tokenize give a load-only decision whose
``reason`` says why. A candidate whose entries are in doubt loses its prefix credit
alone (:mod:`kvindex.scoring.route.doubt`). Only bad input (400), no known pod (503) and no
admissible pod (429 with ``Retry-After``) are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvindex.api.http.json_tokens import decode_prompt
from kvindex.api.http.offload import BackendBusy, BackendTimeout
from kvindex.api.http.schemas import RouteCandidate, RouteDone, RouteRequest, RouteResponse
from kvindex.api.http.score import UntokenizablePrompt, candidate_pods, tokens_of
from kvindex.api.http.score_inputs import block_keys, hashed_keys, mm_features_of, prompt_form
from kvindex.events.errors import NotFound, TooManyRequests, Unavailable
from kvindex.events.wire.identity import member_pod
from kvindex.indexer.backend import BackendUnavailable
from kvindex.indexer.pods import UNHEARD, UNHEARD_REASON
from kvindex.scoring.prompt.tokenize import TokenizerUnavailable
from kvindex.scoring.route.decision import Reason
from kvindex.scoring.route.doubt import LAGGING, credits_prefix
from kvindex.scoring.route.outlier import Outcome
from kvindex.scoring.route.routing import IndexView, NoRoom

if TYPE_CHECKING:
    from kvindex.api.serve.service import Service

DOWN = Reason.FALLBACK_BACKEND_DOWN
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
    view: IndexView


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
        view = IndexView(given, fallback=DOWN, warnings=[*ignored, exc.detail])
        return RouteInputs(pods, view)


def index_inputs(service: Service, req: RouteRequest) -> RouteInputs:
    """The candidate pods (named, or known: that may read the index) and the index's
    view of ``req``: the part of a route that may wait on the backend or the tokenizer.
    Thread-safe: it reads caches and the backend, and writes only memos."""
    route_view = service.route_view
    pods, ignored = _candidates(service, req, route_view.pods(), route_view.known)
    view = _index_view(service, req, pods) if pods else IndexView(0)
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
    published (:meth:`kvindex.api.serve.service.Service.known_pods`). Raises Unavailable
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
    """The decision over ``inputs`` (:meth:`kvindex.scoring.route.routing.Routing.decide`),
    answered; NoCapacity (429) when no candidate is admissible. It never awaits:
    concurrent requests see each other's routes."""
    pods = inputs.pods
    if not pods:
        raise Unavailable(
            "no pods given and none known (configured, discovered or indexed)", code="no_pods"
        )
    view = inputs.view
    block_size = service.catalog.keying(req.model).hash.block_size
    try:
        routed = service.routing.decide(req, pods, view, block_size, RouteCandidate)
    except NoRoom as exc:
        raise NoCapacity(
            f"no pod admissible ({exc.refused or 'no candidate decodes'})",
            max(1, math.ceil(service.settings.scoring.load_interval)),
        ) from None
    tokens = view.prompt_tokens
    answer = RouteResponse(
        route_id=routed.route_id,
        pod=routed.pod,
        rank=routed.rank,
        reason=routed.reason.value,
        model=req.model,
        block_size=block_size,
        prompt_tokens=tokens,
        prompt_blocks=tokens // block_size,
        candidates=routed.rows,
        warnings=routed.warnings,
        future_prefill_tokens=routed.future_prefill,
    )
    if routed.pd:
        answer.decode_pod = routed.pod
        answer.prefill_reason = routed.prefill_reason
        if routed.prefill_pod is not None:
            answer.prefill_pod, answer.prefill_rank = routed.prefill_pod, routed.prefill_rank
    return _with_rows_state(service, answer, view.doubts, routed.excluded)


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


def release_route(service: Service, route_id: str, outcome: Outcome | None = None) -> RouteDone:
    """``POST /route/{route_id}/done`` without HTTP; NotFound when it is not open.
    ``outcome``: how the pod answered, for its failure record
    (:mod:`~kvindex.scoring.route.outlier`)."""
    pod = service.routing.done(route_id, outcome)
    if pod is None:
        raise _unknown_route(route_id)
    return RouteDone(route_id, pod)


def release_prefill(service: Service, route_id: str) -> RouteDone:
    """``POST /route/{route_id}/first-token`` without HTTP: the request's first token is
    out (:meth:`kvindex.scoring.route.routing.Routing.first_token`). NotFound when the route is
    not open."""
    pod = service.routing.first_token(route_id)
    if pod is None:
        raise _unknown_route(route_id)
    return RouteDone(route_id, pod)


def _unknown_route(route_id: str) -> NotFound:
    return NotFound(
        f"no open route {route_id!r} (never routed, already done, or past --route-ttl)",
        code="unknown_route",
    )


def _index_view(service: Service, req: RouteRequest, pods: list[str]) -> IndexView:
    """The prompt's tokens and keys, each member's match (and speculative blocks past
    it), and the fallback when the index cannot be trusted or asked for this request."""
    try:
        known_model = service.knows_model(req.model)
    except BackendUnavailable as exc:  # it asks the index for the models it holds
        return IndexView(0, fallback=DOWN, warnings=[f"index backend unavailable: {exc}"])
    if not known_model:
        form = prompt_form(req)
        if form == "block_hashes":  # a load-only decision, but for a well-formed request
            blocks = len(block_keys(req.block_hashes or []))
            given = blocks * service.catalog.keying(req.model).hash.block_size
        else:
            given = len(req.token_ids or [])
        return IndexView(given, fallback=Reason.FALLBACK_UNKNOWN_MODEL)
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
        fallback, warnings = Reason.FALLBACK_TOKENIZER_UNAVAILABLE, [exc.detail]
        return _unscored(service, req, pods, fallback, warnings)
    except UntokenizablePrompt as exc:  # the pod may serve it: a router must not refuse it
        reason = Reason.FALLBACK_MULTIMODAL if exc.multimodal else Reason.FALLBACK_UNTOKENIZABLE
        return _unscored(service, req, pods, reason, [exc.detail])
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
        return IndexView(
            prompt_tokens, fallback=DOWN, warnings=[f"index backend unavailable: {exc}"]
        )
    wanted = set(pods)
    matches = {p.pod: p for p in result.pods if p.pod in wanted or member_pod(p.pod) in wanted}
    view = IndexView(prompt_tokens, result.keys, matches, result=result)
    doubts = _doubts(service, req, pods)
    if doubts:
        view.doubts = {pod: doubt for pod, (doubt, _) in doubts.items()}
        view.warnings = [
            f"pod {pod}: {why}"
            + ("" if credits_prefix(doubt) else "; its index entries are not credited")
            for pod, (doubt, why) in sorted(doubts.items())
        ]
    return view


def _doubts(service: Service, req: RouteRequest, pods: list[str]) -> dict[str, tuple[str, str]]:
    """Of ``pods``, those whose entries for the model are in doubt: (doubt, why)."""
    doubts = service.route_view.doubts(req.model, pods)
    max_lag = service.settings.scoring.max_event_lag
    for pod, lag in service.event_lag.lagging(pods, max_lag).items():
        doubts.setdefault(
            pod, (LAGGING, f"event lag {lag:.1f} s, above --max-event-lag {max_lag:g}")
        )
    return doubts


def _unscored(
    service: Service, req: RouteRequest, pods: list[str], fallback: Reason, warnings: list[str]
) -> IndexView:
    """The view of a prompt the index cannot score: a load-only decision, unless the
    request's session id names a pod (the routing decides; a pod in doubt does not
    count, so the doubts are read then)."""
    view = IndexView(0, fallback=fallback, warnings=warnings)
    if req.session_id is not None:
        view.doubts = {pod: doubt for pod, (doubt, _) in _doubts(service, req, pods).items()}
    return view

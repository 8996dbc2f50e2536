"""``POST /route`` and ``POST /route/{route_id}/done``: which pod should serve this request
now, from the index's matches, each pod's scraped load and kvindex's in-flight ledger.

The handler only gathers inputs and turns the decision into HTTP; the rules are in
:mod:`kvindex.scoring.router` and the cost model in :mod:`kvindex.scoring.route_cost`.
It degrades instead of failing: an unknown model, a tokenizer or index backend that is
unavailable, or a candidate whose stream is not in step with its engine, all give a
load-only decision whose ``reason`` says why. Only bad input (400) and no admissible pod
(429 with ``Retry-After``) are refused. The handler does not await between reading the
ledger and entering its decision, so concurrent requests see each other's routes.
"""

from __future__ import annotations

import math
import uuid
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvindex.api.app import _candidates, _json, _require_json, _tokens_of
from kvindex.api.errors import JSON, error_response, error_responses
from kvindex.api.schemas import (
    ErrorBody,
    RouteCandidate,
    RouteDone,
    RouteRequest,
    RouteResponse,
    openapi_schema,
)
from kvindex.events.errors import ClientError, NotFound, TooManyRequests, Unavailable
from kvindex.indexer.backend import BackendUnavailable
from kvindex.scoring.load import PodLoad
from kvindex.scoring.route_cost import PodInputs
from kvindex.scoring.router import Candidate, Reason
from kvindex.scoring.scorer import PodScore
from kvindex.scoring.tokenize import TokenizerUnavailable

if TYPE_CHECKING:
    from kvindex.api.service import Service

_JSON = JSON


def install_route(app: FastAPI, service: Service) -> dict[str, Any]:
    """Add /route and /route/{route_id}/done to ``app``; returns the OpenAPI components
    they use, for the app's schema."""
    decoder = msgspec.json.Decoder(RouteRequest)
    (request_schema, response_schema, error_schema, done_schema), components = openapi_schema(
        RouteRequest, RouteResponse, ErrorBody, RouteDone
    )

    def error(text: str) -> dict[str, Any]:
        return {"description": text, "content": {_JSON: {"schema": error_schema}}}

    def decode(body: bytes) -> RouteRequest:
        try:
            return decoder.decode(body)
        except msgspec.ValidationError as exc:
            raise ClientError(str(exc)) from None
        except msgspec.DecodeError as exc:
            raise ClientError(f"body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:
            raise ClientError("body is nested too deeply", code="invalid_json") from None

    @app.post(
        "/route",
        summary="Choose the pod that should serve a prompt now: cached prefix against load",
        openapi_extra={
            "requestBody": {"required": True, "content": {_JSON: {"schema": request_schema}}},
            "responses": {
                "200": {"description": "Decision", "content": {_JSON: {"schema": response_schema}}},
                **error_responses(error_schema, 400, 408, 413, 415),
                "429": error(
                    "no_capacity: no pod admissible (KV cache or queue over the limit), see "
                    "Retry-After; or too many requests in flight (--max-in-flight)"
                ),
                "503": error("no_pods: no pods given and none known"),
            },
        },
    )
    async def route(request: Request) -> Response:
        _require_json(request)
        req = decode(await request.body())
        try:
            answer = route_request(service, req)
        except NoCapacity as exc:
            return error_response(
                429, exc.code, exc.detail, headers={"Retry-After": str(exc.retry_after)}
            )
        return _json(answer)

    @app.post(
        "/route/{route_id}/done",
        summary="The routed request finished: stop counting it against its pod",
        openapi_extra={
            "responses": {
                "200": {"description": "Released", "content": {_JSON: {"schema": done_schema}}},
                "404": error("Unknown route id (never routed, already done, or expired)"),
            }
        },
    )
    def route_done(route_id: str) -> Response:
        return _json(release_route(service, route_id))

    return components


class NoCapacity(TooManyRequests):
    """No candidate pod is admissible now; ``retry_after`` is the seconds until the
    next scrape may change that."""

    code = "no_capacity"

    def __init__(self, detail: str, retry_after: int) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


def route_request(service: Service, req: RouteRequest) -> RouteResponse:
    """Decide where ``req`` goes and enter it in the in-flight ledger: ``POST /route``
    without HTTP, for the gateway running in the same process. Raises NoCapacity (429),
    ClientError (400) or Unavailable (503, no pods known)."""
    settings = service.settings
    pods = _candidates(req.pods, settings.events.serving_port, settings.http.max_pods)
    pods = pods or service.known_pods()
    if not pods:
        raise Unavailable(
            "no pods given and none known (configured, discovered or indexed)", code="no_pods"
        )
    pods = list(dict.fromkeys(pods))
    tokens, matches, fallback, warnings = _index_view(service, req, pods)
    block_size = service.catalog.keying(req.model).hash.block_size
    loads = service.load.snapshot(pods)
    inputs, kv_max = [], {}
    for pod in pods:
        load = loads[pod]
        match = matches.get(pod)
        known = isinstance(load, PodLoad)
        inputs.append(
            PodInputs(
                pod,
                match.matched_blocks if match else 0,
                match.score if match else 0.0,
                load.waiting if known else None,
                load.kv_usage if known else None,
                load.in_flight.requests,
            )
        )
        kv_max[pod] = load.kv_usage_max if known else None
    decision = service.router.decide(inputs, kv_max, len(tokens), block_size, fallback)
    service.route_metrics.decided(decision.reason)
    if decision.pod is None:
        refused = "; ".join(f"{c.inputs.pod}: {c.refused}" for c in decision.candidates)
        raise NoCapacity(
            f"no pod admissible ({refused})", max(1, math.ceil(settings.scoring.load_interval))
        )
    route_id = req.request_id or uuid.uuid4().hex
    # The blocks the request will hold at its end: its prompt and expected output.
    held_tokens = len(tokens) + (req.max_tokens or 0)
    service.load.ledger.begin(
        decision.pod, route_id, -(-held_tokens // block_size), settings.scoring.route_ttl
    )
    return RouteResponse(
        route_id,
        decision.pod,
        decision.reason.value,
        req.model,
        block_size,
        len(tokens),
        len(tokens) // block_size,
        [_candidate(c, loads[c.inputs.pod]) for c in decision.candidates],
        warnings,
    )


def release_route(service: Service, route_id: str) -> RouteDone:
    """``POST /route/{route_id}/done`` without HTTP; NotFound when it is not open."""
    pod = service.load.ledger.done(route_id)
    if pod is None:
        raise NotFound(
            f"no open route {route_id!r} (never routed, already done, or past --route-ttl)",
            code="unknown_route",
        )
    return RouteDone(route_id, pod)


def _index_view(
    service: Service, req: RouteRequest, pods: list[str]
) -> tuple[list[int], dict[str, PodScore], Reason | None, list[str]]:
    """The prompt's tokens, each pod's match, and the fallback when the index cannot be
    trusted or asked for this request."""
    try:
        known_model = service.knows_model(req.model)
    except BackendUnavailable as exc:  # it asks the index for the models it holds
        return [], {}, Reason.FALLBACK_BACKEND_DOWN, [f"index backend unavailable: {exc}"]
    if not known_model:
        given = [n for n in ("token_ids", "prompt", "messages") if getattr(req, n) is not None]
        if len(given) != 1:
            raise ClientError("give exactly one of token_ids, prompt, messages")
        tokens = req.token_ids or []
        return tokens, {}, Reason.FALLBACK_UNKNOWN_MODEL, []
    settings = service.settings
    try:
        tokens = _tokens_of(
            service, req, settings.http.max_prompt_tokens, settings.http.max_prompt_chars
        )
    except TokenizerUnavailable as exc:
        return [], {}, Reason.FALLBACK_TOKENIZER_UNAVAILABLE, [exc.detail]
    try:  # bad keys (an unknown LoRA, token ids out of range) are ClientErrors: 400
        result = service.scorer.score(
            req.model, tokens, lora_name=req.lora_name, cache_salt=req.cache_salt, candidates=pods
        )
    except BackendUnavailable as exc:
        return tokens, {}, Reason.FALLBACK_BACKEND_DOWN, [f"index backend unavailable: {exc}"]
    matches = {p.pod: p for p in result.pods}
    doubts = service.directory.index_doubts(req.model, pods)
    if doubts:
        warnings = [f"pod {pod}: {why}" for pod, why in sorted(doubts.items())]
        return tokens, matches, Reason.FALLBACK_STALE_INDEX, warnings
    return tokens, matches, None, []


def _candidate(c: Candidate, load: Any) -> RouteCandidate:
    known = isinstance(load, PodLoad)
    return RouteCandidate(
        c.inputs.pod,
        c.inputs.matched_blocks,
        c.terms.usable_blocks,
        c.terms.uncached_blocks,
        "known" if known else load.reason,
        load.running if known else None,
        load.waiting if known else None,
        load.kv_usage if known else None,
        c.inputs.in_flight,
        c.terms.prefix,
        c.terms.queue,
        c.terms.kv,
        c.terms.total,
        c.refused is None,
        c.refused,
    )

"""The HTTP API gateways and operators use (the contract is in DESIGN.md, "HTTP API").

Bodies are decoded and encoded with msgspec rather than FastAPI's pydantic models: an
8,192-token ``token_ids`` list validates in microseconds instead of a millisecond, and
the OpenAPI schema is generated from the same msgspec types. Only this module turns
errors into HTTP status codes.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvindex.api.schemas import (
    ErrorBody,
    PurgeResponse,
    ScoreRequest,
    ScoreResponse,
    openapi_schema,
)
from kvindex.events.identity import IdentityError, normalize_pod
from kvindex.indexer.backend import BackendUnavailable, Tier
from kvindex.indexer.keys import KeyConfigError
from kvindex.indexer.token_keys import TokenRangeError
from kvindex.scoring.tokenize import ChatOptions, TokenizerUnavailable

if TYPE_CHECKING:
    from kvindex.api.service import Service

_JSON = "application/json"
_encoder = msgspec.json.Encoder()
_score_decoder = msgspec.json.Decoder(ScoreRequest)


class HttpError(Exception):
    def __init__(self, status: int, code: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


def _json(body: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type=_JSON)


def _error(status: int, code: str, detail: str) -> Response:
    return _json(ErrorBody(code, detail), status)


def create_app(service: Service, *, manage_lifecycle: bool = True) -> FastAPI:
    """Build the FastAPI app over a composed Service.

    With ``manage_lifecycle`` the app starts and stops the service (subscriber threads,
    discovery) in its lifespan, which is what ``kvindex serve`` wants.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            service.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                service.stop()

    app = FastAPI(
        title="kvindex",
        summary="Which vLLM pod already holds the KV cache of this prompt?",
        version="0.1.0",
        lifespan=lifespan,
    )
    (request_schema, response_schema, error_schema, purge_schema), components = openapi_schema(
        ScoreRequest, ScoreResponse, ErrorBody, PurgeResponse
    )
    error_responses = {
        str(code): {"description": text, "content": {_JSON: {"schema": error_schema}}}
        for code, text in (
            (400, "Invalid request (validation, size limits, unknown LoRA)"),
            (404, "Unknown model"),
            (503, "Index backend or tokenizer unavailable; fall back to default balancing"),
        )
    }
    limits = service.settings

    @app.exception_handler(HttpError)
    async def _http_error(_: Request, exc: HttpError) -> Response:
        return _error(exc.status, exc.code, exc.detail)

    @app.exception_handler(BackendUnavailable)
    async def _backend_down(_: Request, exc: BackendUnavailable) -> Response:
        return _error(503, "backend_unavailable", f"index backend unavailable: {exc}")

    @app.post(
        "/score",
        summary="Score a prompt: each pod's longest cached prefix, best first",
        openapi_extra={
            "requestBody": {"required": True, "content": {_JSON: {"schema": request_schema}}},
            "responses": {
                "200": {"description": "Scores", "content": {_JSON: {"schema": response_schema}}},
                **error_responses,
            },
        },
    )
    async def score(request: Request) -> Response:
        started = time.perf_counter()
        body = await request.body()
        try:
            req = _score_decoder.decode(body)
        except msgspec.ValidationError as exc:
            service.metrics.score_rejected("invalid_request")
            raise HttpError(400, "invalid_request", str(exc)) from None
        except msgspec.DecodeError as exc:
            service.metrics.score_rejected("invalid_json")
            raise HttpError(400, "invalid_json", f"body is not valid JSON: {exc}") from None
        try:
            tokens = _tokens_of(service, req, limits.max_prompt_tokens, limits.max_prompt_chars)
            candidates = _candidates(req.pods, limits.serving_port)
            result = service.scorer.score(
                req.model,
                tokens,
                lora_name=req.lora_name,
                cache_salt=req.cache_salt,
                candidates=candidates,
            )
        except HttpError as exc:
            service.metrics.score_rejected(exc.code)
            raise
        except (KeyConfigError, TokenRangeError) as exc:
            service.metrics.score_rejected("invalid_request")
            raise HttpError(400, "invalid_request", str(exc)) from None
        except BackendUnavailable:
            service.metrics.score_rejected("backend_unavailable")
            raise
        warnings = service.directory.warnings(req.model, candidates)
        response = ScoreResponse(
            result.model,
            result.block_size,
            result.prompt_tokens,
            result.prompt_blocks,
            result.pods,
            warnings,
        )
        service.metrics.score_done(result, time.perf_counter() - started, bool(warnings))
        return _json(response)

    @app.get("/index/pods", summary="Every pod: blocks by tier, stream state, hash check")
    def list_pods() -> Response:
        return _json({"pods": service.directory.reports()})

    @app.get("/index/pods/{pod}", summary="One pod's index and stream state")
    def get_pod(pod: str) -> Response:
        pod_id = _pod_id(pod, limits.serving_port)
        report = service.directory.report(pod_id)
        if report is None:
            raise HttpError(404, "unknown_pod", f"no pod {pod_id!r} in the index or its streams")
        return _json(report)

    @app.get(
        "/index/pods/{pod}/blocks",
        summary="The block keys a pod holds for one model (for debugging and consistency checks)",
    )
    def pod_blocks(pod: str, model: str, tier: str | None = None, limit: int = 100_000) -> Response:
        pod_id = _pod_id(pod, limits.serving_port)
        try:
            tier_filter = None if tier is None else Tier[tier.upper()]
        except KeyError:
            raise HttpError(400, "invalid_request", "tier must be gpu, cpu or storage") from None
        if limit <= 0:
            raise HttpError(400, "invalid_request", "limit must be positive")
        members = service.directory.members_of(pod_id)
        if not members:
            raise HttpError(404, "unknown_pod", f"no pod {pod_id!r} in the index or its streams")
        blocks = {m: service.backend.member_keys(m, model, tier_filter) for m in members}
        truncated = any(len(keys) > limit for keys in blocks.values())
        return _json(
            {
                "pod": pod_id,
                "model": model,
                "tier": None if tier_filter is None else tier_filter.label,
                "blocks": {m: keys[:limit] for m, keys in blocks.items()},
                "truncated": truncated,
            }
        )

    @app.delete(
        "/index/pods/{pod}",
        summary="Operator purge: drop everything the index holds for a pod",
        openapi_extra={"responses": {"200": {"content": {_JSON: {"schema": purge_schema}}}}},
    )
    def purge_pod(pod: str, request: Request) -> Response:
        _check_admin(request, service.settings.admin_token)
        pod_id = _pod_id(pod, limits.serving_port)
        members, removed = service.purge_pod(pod_id)
        if not members:
            raise HttpError(404, "unknown_pod", f"no pod {pod_id!r} in the index or its streams")
        return _json(PurgeResponse(pod_id, members, removed))

    @app.get("/healthz", summary="Liveness: the process answers")
    def healthz() -> Response:
        return _json({"status": "ok"})

    @app.get("/readyz", summary="Readiness: backend answers and the subscriber runs")
    def readyz() -> Response:
        problems = service.readiness_problems()
        if problems:
            return _json({"status": "unready", "problems": problems}, 503)
        return _json({"status": "ready"})

    @app.get("/metrics", summary="Prometheus metrics")
    def metrics() -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    app.openapi_schema = None
    _original_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = _original_openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _tokens_of(service: Service, req: ScoreRequest, max_tokens: int, max_chars: int) -> list[int]:
    given = [name for name in ("token_ids", "prompt", "messages") if getattr(req, name) is not None]
    if len(given) != 1:
        raise HttpError(
            400,
            "invalid_request",
            "give exactly one of token_ids, prompt, messages"
            + (f" (got {', '.join(given)})" if given else ""),
        )
    if not service.knows_model(req.model):
        raise HttpError(
            404,
            "unknown_model",
            f"model {req.model!r} is neither configured (--model-config) nor seen in any "
            f"pod's events; known: {', '.join(service.known_models()) or 'none yet'}",
        )
    if req.messages is None and _chat_fields_given(req):
        raise HttpError(
            400,
            "invalid_request",
            "add_generation_prompt, continue_final_message, tools, documents and "
            "chat_template_kwargs apply to messages only",
        )
    tokens = req.token_ids if req.token_ids is not None else _tokenize(service, req, max_chars)
    if not tokens:
        raise HttpError(400, "invalid_request", "the prompt is empty")
    if len(tokens) > max_tokens:
        raise HttpError(
            400,
            "invalid_request",
            f"prompt has {len(tokens)} tokens, more than the limit of {max_tokens} "
            "(--max-prompt-tokens)",
        )
    return tokens


def _tokenize(service: Service, req: ScoreRequest, max_chars: int) -> list[int]:
    if req.prompt is not None:
        size = len(req.prompt)
    else:
        size = sum(
            len(msgspec.json.encode(part))
            for part in (req.messages, req.tools, req.documents, req.chat_template_kwargs)
            if part is not None
        )
        if any(not isinstance(m.get("role"), str) for m in req.messages or []):
            raise HttpError(400, "invalid_request", "every message needs a string 'role'")
    if size > max_chars:
        raise HttpError(
            400,
            "invalid_request",
            f"prompt text has {size} characters, more than the limit of {max_chars} "
            "(--max-prompt-chars)",
        )
    try:
        tokenizer = service.tokenizers.get(req.model)
        if req.prompt is not None:
            return tokenizer.encode_prompt(req.prompt)
        return tokenizer.encode_chat(
            req.messages or [],
            ChatOptions(
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
                documents=req.documents,
                chat_template_kwargs=req.chat_template_kwargs,
            ),
        )
    except TokenizerUnavailable as exc:
        raise HttpError(503, "tokenizer_unavailable", str(exc)) from None
    except ValueError as exc:  # the chat template refused the messages
        raise HttpError(400, "invalid_request", str(exc)) from None
    except Exception as exc:  # jinja2 errors from a model's template
        raise HttpError(400, "invalid_request", f"chat template failed: {exc}") from None


def _chat_fields_given(req: ScoreRequest) -> bool:
    return (
        not req.add_generation_prompt
        or req.continue_final_message
        or req.tools is not None
        or req.documents is not None
        or req.chat_template_kwargs is not None
    )


def _candidates(pods: list[str] | None, serving_port: int) -> list[str] | None:
    if pods is None:
        return None
    if not pods:
        raise HttpError(400, "invalid_request", "pods, when given, must name at least one pod")
    return [_pod_id(p, serving_port) for p in pods]


def _pod_id(pod: str, serving_port: int) -> str:
    try:
        return normalize_pod(pod, serving_port)
    except IdentityError as exc:
        raise HttpError(400, "invalid_request", str(exc)) from None


def _check_admin(request: Request, token: str | None) -> None:
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token):
        raise HttpError(
            401, "unauthorized", "this endpoint needs 'Authorization: Bearer <admin token>'"
        )

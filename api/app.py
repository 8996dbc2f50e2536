"""The HTTP API gateways and operators use (the contract is in DESIGN.md, "HTTP API").

Bodies are decoded and encoded with msgspec rather than FastAPI's pydantic models: an
8,192-token ``token_ids`` list validates in microseconds instead of a millisecond, and
the OpenAPI schema is generated from the same msgspec types. Routes raise kvindex's own
errors; ``api/errors.py`` turns them into status codes, in one handler.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvindex.api.docs import mount_offline_docs
from kvindex.api.errors import (
    JSON,
    decode_json,
    drop_validation_errors,
    error_responses,
    install_error_handlers,
)
from kvindex.api.limits import RequestLimits
from kvindex.api.schemas import (
    ErrorBody,
    PurgeResponse,
    ScoreRequest,
    ScoreResponse,
    openapi_schema,
)
from kvindex.api.schemas_pods import Health, PodBlocks, PodList, PodReport, Readiness
from kvindex.api.score_inputs import (
    binary_parameters,
    hashed_keys,
    prompt_form,
    read_request,
    request_body,
    require_known_model,
)
from kvindex.api.version import VERSION
from kvindex.events.errors import (
    ClientError,
    Forbidden,
    KvindexError,
    NotFound,
    TooLarge,
    Unauthorized,
)
from kvindex.events.identity import normalize_pod
from kvindex.indexer.backend import Tier
from kvindex.scoring.scorer import ScoreResult
from kvindex.scoring.speculative import annotate
from kvindex.scoring.tokenize import ChatOptions

if TYPE_CHECKING:
    from kvindex.api.service import Service

_encoder = msgspec.json.Encoder()
_score_decoder = msgspec.json.Decoder(ScoreRequest)
# Chat messages are a few levels deep (content parts, tool calls); a deeper body is an
# attack on the decoder or the template, not a prompt.
MAX_MESSAGE_DEPTH = 32
MAX_BLOCKS_LIMIT = 1_000_000
POD = Path(
    description="The pod id, ip:port of its HTTP server (the port defaults to --serving-port)"
)


def _json(body: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type=JSON)


def create_app(service: Service, *, manage_lifecycle: bool = True) -> FastAPI:
    """Build the FastAPI app over a composed Service.

    With ``manage_lifecycle`` the app starts and stops the service (subscriber threads,
    discovery) in its lifespan, which is what ``kvindex serve`` wants.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # `kvindex serve` starts the service before serving (a port in use is then one
        # line, not a traceback) but stops it here: uvicorn re-raises SIGTERM once it is
        # done, so nothing after uvicorn.run() would get to write a final snapshot.
        if manage_lifecycle and not service.started:
            service.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                service.stop()

    app = FastAPI(
        title="kvindex",
        summary="Which vLLM pod already holds the KV cache of this prompt?",
        version=VERSION,
        lifespan=lifespan,
        docs_url=None,  # served from the installed swagger-ui-bundle, never a CDN
        redoc_url=None,
    )
    mount_offline_docs(app)
    (
        (
            (request_schema, response_schema, error_schema, purge_schema),
            (pods_schema, pod_schema, blocks_schema, health_schema, ready_schema),
        ),
        components,
    ) = _schemas()
    limits = service.settings.http
    serving_port = service.settings.events.serving_port
    admin_token = service.admin_token
    everywhere = (429,)  # --max-in-flight applies to every route but the probes

    def errors(*statuses: int) -> dict[str, Any]:
        return error_responses(error_schema, *statuses, *everywhere)

    def refused(request: Request, code: str) -> None:
        service.metrics.refused(request.url.path == "/score", code)

    install_error_handlers(app, refused)
    app.add_middleware(
        RequestLimits,
        max_body_bytes=limits.max_body_bytes,
        body_timeout_s=limits.body_timeout,
        max_in_flight=limits.max_in_flight,
        on_refusal=lambda path, code: service.metrics.refused(path == "/score", code),
    )

    @app.post(
        "/score",
        summary="Score a prompt: each pod's longest cached prefix, best first",
        description="A 404 `unknown_model` right after a deploy means no pod has published "
        "events for the model yet: fall back to default balancing, as for a 503.",
        openapi_extra={
            "requestBody": request_body(request_schema),
            "parameters": binary_parameters(ScoreRequest),
            "responses": {
                "200": {"description": "Scores", "content": {JSON: {"schema": response_schema}}},
                **errors(400, 404, 408, 413, 415, 503),
            },
        },
    )
    async def score(request: Request) -> Response:
        started = time.perf_counter()
        req = await read_request(request, ScoreRequest, _decode_score)
        result, candidates = await service.index_work.run(score_index, service, req)
        annotate(result, service.speculative, candidates)  # apart from the confirmed counts
        warnings = [*result.warnings, *service.directory.warnings(req.model, candidates)]
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

    @app.get(
        "/index/pods",
        summary="Every pod: blocks by tier, stream state, hash check",
        responses={"200": ok("Every pod", pods_schema), **errors(503)},
    )
    def list_pods() -> Response:
        return _json({"pods": service.directory.reports()})

    @app.get(
        "/index/pods/{pod}",
        summary="One pod's index and stream state",
        responses={"200": ok("The pod", pod_schema), **errors(400, 404, 503)},
    )
    def get_pod(pod: str = POD) -> Response:
        pod_id = _pod_id(pod, serving_port)
        report = service.directory.report(pod_id)
        if report is None:
            raise _unknown_pod(pod_id)
        return _json(report)

    @app.get(
        "/index/pods/{pod}/blocks",
        summary="The block keys a pod holds for one model (for debugging and consistency checks)",
        responses={"200": ok("The pod's block keys", blocks_schema), **errors(400, 404, 503)},
    )
    def pod_blocks(
        pod: str = POD,
        model: str = Query(description="the model whose blocks to list"),
        tier: str | None = Query(None, description="gpu, cpu or storage; all when absent"),
        limit: int = Query(
            100_000, description=f"most keys per member (1..{MAX_BLOCKS_LIMIT}); sorted"
        ),
    ) -> Response:
        pod_id = _pod_id(pod, serving_port)
        try:
            tier_filter = None if tier is None else Tier[tier.upper()]
        except KeyError:
            raise ClientError("tier must be gpu, cpu or storage") from None
        if not 0 < limit <= MAX_BLOCKS_LIMIT:
            raise ClientError(f"limit must be 1..{MAX_BLOCKS_LIMIT}")
        members = service.directory.members_of(pod_id)
        if not members:
            raise _unknown_pod(pod_id)
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
        description="Needs `Authorization: Bearer <token>`; refused (403) unless an admin "
        "token is configured with KVINDEX_ADMIN_TOKEN or --admin-token-file.",
        responses={
            "200": {"description": "Purged", "content": {JSON: {"schema": purge_schema}}},
            **errors(400, 401, 403, 404, 503),
        },
    )
    def purge_pod(request: Request, pod: str = POD) -> Response:
        _check_admin(request, admin_token)
        pod_id = _pod_id(pod, serving_port)
        members, removed = service.purge_pod(pod_id)
        if not members:
            raise _unknown_pod(pod_id)
        return _json(PurgeResponse(pod_id, members, removed))

    @app.get(
        "/healthz",
        summary="Liveness: the process answers",
        responses={"200": ok("Alive", health_schema)},
    )
    async def healthz() -> Response:  # on the loop: no thread to wait for, ever
        return _json({"status": "ok"})

    @app.get(
        "/readyz",
        summary="Readiness: backend answers, the subscriber runs, an event source exists",
        responses={
            "200": ok("Ready", ready_schema),
            "503": ok("Not ready; `problems` says why", ready_schema),
        },
    )
    def readyz() -> Response:
        problems = service.readiness_problems()
        if problems:
            return _json({"status": "unready", "problems": problems}, 503)
        notes = service.readiness_notes()
        return _json({"status": "ready", "notes": notes} if notes else {"status": "ready"})

    @app.get(
        "/metrics",
        summary="Prometheus metrics",
        response_class=PlainTextResponse,
        responses={
            "200": {
                "description": "The Prometheus text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    def metrics() -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    from kvindex.api.route import install_route  # it imports this module's helpers

    components.update(install_route(app, service))

    app.openapi_schema = None
    _original_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = drop_validation_errors(_original_openapi())
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def ok(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI response whose JSON body has ``schema``."""
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _schemas() -> tuple[tuple[list[dict[str, Any]], list[dict[str, Any]]], dict[str, Any]]:
    """The JSON schemas of the bodies in and out of this module's routes, and their
    shared components."""
    schemas, components = openapi_schema(
        ScoreRequest,
        ScoreResponse,
        ErrorBody,
        PurgeResponse,
        PodList,
        PodReport,
        PodBlocks,
        Health,
        Readiness,
    )
    return (schemas[:4], schemas[4:]), components


def _unknown_pod(pod_id: str) -> NotFound:
    return NotFound(f"no pod {pod_id!r} in the index or its streams", code="unknown_pod")


def _decode_score(body: bytes) -> ScoreRequest:
    return decode_json(_score_decoder, body)


def score_index(service: Service, req: ScoreRequest) -> tuple[ScoreResult, list[str] | None]:
    """What the index says about ``req``, and its candidate pods: the part of /score that
    may wait on the backend or the tokenizer, so it runs under ``service.index_work``
    (thread-safe: it reads caches and the backend, and writes only memos)."""
    limits = service.settings.http
    serving_port = service.settings.events.serving_port
    if req.block_hashes is not None:
        keys = hashed_keys(service, req, limits.max_prompt_tokens)
        candidates = _candidates(req.pods, serving_port, limits.max_pods)
        return service.scorer.score_keys(req.model, keys, candidates=candidates), candidates
    tokens = _tokens_of(service, req, limits.max_prompt_tokens, limits.max_prompt_chars)
    candidates = _candidates(req.pods, serving_port, limits.max_pods)
    result = service.scorer.score(
        req.model,
        tokens,
        lora_name=req.lora_name,
        cache_salt=req.cache_salt,
        candidates=candidates,
    )
    return result, candidates


def _tokens_of(service: Service, req: ScoreRequest, max_tokens: int, max_chars: int) -> list[int]:
    if prompt_form(req) == "block_hashes":
        raise ClientError("block_hashes are looked up as they are; they have no tokens")
    require_known_model(service, req.model)
    if req.messages is None and _chat_fields_given(req):
        raise ClientError(
            "add_generation_prompt, continue_final_message, tools, documents and "
            "chat_template_kwargs apply to messages only"
        )
    tokens = req.token_ids if req.token_ids is not None else _tokenize(service, req, max_chars)
    if not tokens:
        raise ClientError("the prompt is empty")
    if len(tokens) > max_tokens:
        raise ClientError(
            f"prompt has {len(tokens)} tokens, more than the limit of {max_tokens} "
            "(--max-prompt-tokens)"
        )
    return tokens


def _tokenize(service: Service, req: ScoreRequest, max_chars: int) -> list[int]:
    if req.prompt is not None:
        size = len(req.prompt)
    else:
        if any(not isinstance(m.get("role"), str) for m in req.messages or []):
            raise ClientError("every message needs a string 'role'")
        parts = [
            part
            for part in (req.messages, req.tools, req.documents, req.chat_template_kwargs)
            if part is not None
        ]
        if _depth(parts) > MAX_MESSAGE_DEPTH:
            raise ClientError(
                f"messages (or tools, documents) are nested more than {MAX_MESSAGE_DEPTH} "
                "levels deep"
            )
        size = sum(len(msgspec.json.encode(part)) for part in parts)
    if size > max_chars:
        raise ClientError(
            f"prompt text has {size} characters, more than the limit of {max_chars} "
            "(--max-prompt-chars)"
        )
    tokenizer = service.tokenizers.get(req.model)  # TokenizerUnavailable: 503
    try:
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
    except KvindexError:  # TokenizerUnavailable (503), our own client errors (400)
        raise
    except ValueError as exc:  # the chat template refused the messages
        raise ClientError(str(exc)) from None
    except Exception as exc:  # jinja2 errors from a model's template
        raise ClientError(f"chat template failed: {exc}") from None


def _chat_fields_given(req: ScoreRequest) -> bool:
    return (
        not req.add_generation_prompt
        or req.continue_final_message
        or req.tools is not None
        or req.documents is not None
        or req.chat_template_kwargs is not None
    )


def _depth(value: Any) -> int:
    """Nesting depth of decoded JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > MAX_MESSAGE_DEPTH:
            return deepest
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        stack.extend((child, level + 1) for child in children)
    return deepest


def _candidates(pods: list[str] | None, serving_port: int, max_pods: int) -> list[str] | None:
    if pods is None:
        return None
    if not pods:
        raise ClientError("pods, when given, must name at least one pod")
    if len(pods) > max_pods:
        raise TooLarge(
            f"pods names {len(pods)} candidates, more than the limit of {max_pods} (--max-pods)"
        )
    return [_pod_id(p, serving_port) for p in pods]


def _pod_id(pod: str, serving_port: int) -> str:
    return normalize_pod(pod, serving_port)  # IdentityError is a ClientError: 400


def _check_admin(request: Request, token: str | None) -> None:
    if not token:
        raise Forbidden(
            "operator endpoints are switched off: no admin token is configured; set "
            "KVINDEX_ADMIN_TOKEN or --admin-token-file FILE and send "
            "'Authorization: Bearer <token>'",
            code="admin_token_unset",
        )
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # Header values arrive latin-1 decoded: back to their bytes, and compare bytes with
    # the token's UTF-8, so a non-ASCII token is a mismatch (401), never a crash.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode("latin-1"), token.encode("utf-8")
    ):
        raise Unauthorized("this endpoint needs 'Authorization: Bearer <admin token>'")

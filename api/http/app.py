"""The HTTP API gateways and operators use (the contract: docs/api.md, generated from this
app's OpenAPI document).

Bodies are decoded and encoded with msgspec rather than FastAPI's pydantic models: a long
``token_ids`` list validates far faster, and the OpenAPI schema is generated from the
same msgspec types. Routes raise kvindex's own errors; ``api/http/errors.py`` turns them into
status codes, in one handler. ``/score`` and ``/route`` are not FastAPI routes:
``api/http/hot_path.py`` answers them in front of this app (and ``kvindex serve`` answers them
from its HTTP protocol: ``api/http/hot_lane.py``).
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from fastapi import FastAPI, Path, Query, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvindex.api.http.asgi import ASGIApp
from kvindex.api.http.docs import mount_offline_docs
from kvindex.api.http.errors import (
    JSON,
    drop_validation_errors,
    error_responses,
    install_error_handlers,
)
from kvindex.api.http.hot_lane import HotLane
from kvindex.api.http.hot_openapi import openapi_paths
from kvindex.api.http.hot_path import HotPath, HotRoutes
from kvindex.api.http.limits import RequestLimits
from kvindex.api.http.schemas import ErrorBody, PurgeResponse, openapi_schema
from kvindex.api.http.schemas import ok_response as ok
from kvindex.api.http.schemas_pods import Health, PodBlocks, PodList, PodReport, Readiness
from kvindex.api.http.score import pod_id as normalized_pod
from kvindex.api.serve.peers import DUMP_PATH, DUMP_SIZE_HEADER
from kvindex.api.version import VERSION
from kvindex.events.errors import ClientError, Forbidden, NotFound, Unauthorized
from kvindex.indexer.backend import Tier

if TYPE_CHECKING:
    from kvindex.api.serve.service import Service

_encoder = msgspec.json.Encoder()
MAX_BLOCKS_LIMIT = 1_000_000
POD = Path(
    description="The pod id, ip:port of its HTTP server (the port defaults to --serving-port)"
)


def _json(body: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type=JSON)


@dataclass(frozen=True)
class Http:
    """The service over HTTP: the ASGI app, and the lane ``kvindex serve``'s protocol
    answers the hot paths with (the same handlers and limits)."""

    app: ASGIApp
    lane: HotLane


def create_app(service: Service, *, manage_lifecycle: bool = True) -> ASGIApp:
    """The ASGI app over a composed Service (see :func:`create_http`)."""
    return create_http(service, manage_lifecycle=manage_lifecycle).app


def create_http(service: Service, *, manage_lifecycle: bool = True) -> Http:
    """Build the ASGI app over a composed Service: the request limits, around the hot
    path (``/score``, ``/route``), around the FastAPI app (every other path); and the
    lane over the same handlers and limits.

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
            (error_schema, purge_schema),
            (pods_schema, pod_schema, blocks_schema, health_schema, ready_schema),
        ),
        components,
    ) = _schemas()
    serving_port = service.settings.events.serving_port
    admin_token = service.admin_token
    everywhere = (429,)  # --max-in-flight applies to every route but the probes

    def errors(*statuses: int) -> dict[str, Any]:
        return error_responses(error_schema, *statuses, *everywhere)

    def refused(request: Request, code: str) -> None:
        refused_at(request.url.path, code)

    install_error_handlers(app, refused)

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
        pod_id = normalized_pod(pod, serving_port)
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
        pod_id = normalized_pod(pod, serving_port)
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
        pod_id = normalized_pod(pod, serving_port)
        members, removed = service.purge_pod(pod_id)
        if not members:
            raise _unknown_pod(pod_id)
        return _json(PurgeResponse(pod_id, members, removed))

    @app.get(
        DUMP_PATH,
        summary="A consistent copy of this replica's memory index, for a peer's --peers recovery",
        description="Needs `Authorization: Bearer <token>`; refused (403) unless an admin "
        "token is configured, and on replicas that keep no stream positions (a Redis "
        "backend, or a memory one without `--peers` or `--snapshot`). The body is the "
        "snapshot file's format (magic bytes, format version, checksum), streamed: the "
        "index, the ingest state and every stream's last applied seq, taken as one cut. "
        f"`{DUMP_SIZE_HEADER}` gives its size before the body.",
        response_class=Response,
        responses={
            "200": {
                "description": "The dump, streamed",
                "headers": {
                    DUMP_SIZE_HEADER: {
                        "description": "The body's size in bytes",
                        "schema": {"type": "integer"},
                    }
                },
                "content": {"application/octet-stream": {"schema": {"type": "string"}}},
            },
            **errors(401, 403, 503),
        },
    )
    def dump(request: Request) -> Response:
        _check_admin(request, admin_token)
        encoded = service.dump()
        # No Content-Length: a serving worker (--processes) relays an answer of stated
        # length whole, and a dump streams through it chunk by chunk only without one.
        return StreamingResponse(
            encoded.chunks(),
            media_type="application/octet-stream",
            headers={DUMP_SIZE_HEADER: str(encoded.size)},
        )

    @app.get(
        "/healthz",
        summary="Liveness: the process answers and its KV-event ingestion runs",
        responses={
            "200": ok("Alive", health_schema),
            "503": ok("An ingest thread died; `problems` says why", health_schema),
        },
    )
    async def healthz() -> Response:  # on the loop: no thread to wait for, ever
        # A dead ingest thread freezes the index while everything else answers: not
        # alive, whatever the HTTP side says (kvindex serve exits soon after, too).
        failure = service.subscriber.failure
        if failure is not None:
            problems = [f"KV-event ingestion stopped: {failure}"]
            return _json({"status": "failed", "problems": problems}, 503)
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

    hot_paths, hot_components = openapi_paths()
    components.update(hot_components)
    if service.settings.gateway.enabled:  # GatewayApp answers them in front of this app
        from kvindex.api.gateway.openapi import gateway_paths

        hot_paths.update(gateway_paths())
    app.openapi_schema = None
    _original_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = drop_validation_errors(_original_openapi())
            schema["paths"] = {**hot_paths, **schema.get("paths", {})}
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    def refused_at(path: str, code: str) -> None:
        service.metrics.refused(path == "/score", code)

    routes = HotRoutes(service, refused_at)
    limited = RequestLimits.of(HotPath(routes, app), service.settings.http, refused_at)
    return Http(limited, HotLane(routes, limited))


def _schemas() -> tuple[tuple[list[dict[str, Any]], list[dict[str, Any]]], dict[str, Any]]:
    """The JSON schemas of the bodies in and out of this module's routes, and their
    shared components."""
    schemas, components = openapi_schema(
        ErrorBody,
        PurgeResponse,
        PodList,
        PodReport,
        PodBlocks,
        Health,
        Readiness,
    )
    return (schemas[:2], schemas[2:]), components


def _unknown_pod(pod_id: str) -> NotFound:
    return NotFound(f"no pod {pod_id!r} in the index or its streams", code="unknown_pod")


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

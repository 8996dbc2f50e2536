"""``POST /score``, ``POST /route`` and ``POST /route/{route_id}/done`` answered straight
from ASGI, in front of the FastAPI app that serves every other path.

Why not FastAPI routes: its dispatch (route matching, dependency solving, its middleware
stack, Starlette's Request and Response) was ~18% of a ``/score`` request's CPU in issue
13's profile, for bodies msgspec already decodes and validates. Here a request is matched
in a dict, its body read from ``receive``, decoded by msgspec, answered by
:func:`kvindex.api.score.score_request` or :func:`kvindex.api.route.decide_route` (the
index work under ``service.index_work``'s deadline and cap, as before), and sent as two
ASGI messages.

What the FastAPI routes gave is kept: errors in the one shape of ``api/errors.py``,
counted as its handlers count them (``on_refusal``); a 405 with ``Allow`` for another
method; a trailing slash accepted (Starlette redirected it to the same handler). The
limits (:class:`kvindex.api.limits.RequestLimits`) wrap this app and FastAPI's alike, so
one in-flight count covers every route. The OpenAPI document still describes these
paths, from the same msgspec types: :func:`openapi_paths`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from kvindex.api.asgi import (
    ASGIApp,
    ClientLeft,
    Headers,
    Receive,
    Scope,
    Send,
    receive_body,
    send_json,
)
from kvindex.api.errors import JSON, error_body, error_responses, refusal
from kvindex.api.route import NoCapacity, decide_route, decode_route, release_route, route_inputs
from kvindex.api.schemas import (
    ErrorBody,
    RouteDone,
    RouteRequest,
    RouteResponse,
    ScoreRequest,
    ScoreResponse,
    ok_response,
    openapi_schema,
)
from kvindex.api.score import decode_score, score_request
from kvindex.api.score_inputs import (
    binary_parameters,
    body_media,
    parse_request,
    request_body,
)
from kvindex.events.errors import KvindexError

if TYPE_CHECKING:
    from kvindex.api.service import Service

log = logging.getLogger(__name__)

# A handler's answer: status, JSON body, headers besides content-type and content-length.
Answer = tuple[int, bytes, Headers]
Handler = Callable[[Scope, Receive, str], Awaitable[Answer]]

R = TypeVar("R", bound=ScoreRequest)

_encode = msgspec.json.Encoder().encode
_ROUTE_PREFIX, _DONE_SUFFIX = "/route/", "/done"
_ALLOW = [(b"allow", b"POST")]


class HotPath:
    """The ASGI app: the three POST paths here, everything else to ``inner`` (FastAPI).
    ``on_refusal(path, code)`` counts each refused request, as the FastAPI handlers do."""

    def __init__(
        self, service: Service, inner: ASGIApp, on_refusal: Callable[[str, str], None]
    ) -> None:
        self.service = service
        self.inner = inner
        self.on_refusal = on_refusal
        self._exact: dict[str, Handler] = {"/score": self._score, "/route": self._route}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler, argument = self._match(scope["path"])
            if handler is not None:
                await self._answer(scope, receive, send, handler, argument)
                return
        await self.inner(scope, receive, send)

    def _match(self, path: str) -> tuple[Handler | None, str]:
        """The handler of ``path`` and its path parameter (a route id), or None."""
        if len(path) > 1 and path[-1] == "/":
            path = path[:-1]
        handler = self._exact.get(path)
        if handler is not None:
            return handler, ""
        if path.startswith(_ROUTE_PREFIX) and path.endswith(_DONE_SUFFIX):
            route_id = path[len(_ROUTE_PREFIX) : -len(_DONE_SUFFIX)]
            if route_id and "/" not in route_id:  # Starlette's {route_id}: [^/]+
                return self._done, route_id
        return None, ""

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, handler: Handler, argument: str
    ) -> None:
        method, path = scope["method"], scope["path"]
        if method != "POST":
            self.on_refusal(path, "method_not_allowed")
            status, headers = 405, _ALLOW
            body = error_body("method_not_allowed", f"{method} is not allowed on {path}")
        else:
            try:
                status, body, headers = await handler(scope, receive, argument)
            except ClientLeft:
                return
            except KvindexError as exc:
                self.on_refusal(path, exc.code)
                status, body = refusal(exc, method, path)
                headers = []
            except Exception as exc:  # a bug: logged with its traceback, none for the client
                log.error("%s %s failed", method, path, exc_info=exc)
                self.on_refusal(path, "internal_error")
                status = 500
                body = error_body("internal_error", f"internal error ({type(exc).__name__})")
                headers = []
        await send_json(send, status, body, headers)

    async def _score(self, scope: Scope, receive: Receive, _: str) -> Answer:
        started = time.perf_counter()
        req = await _read(scope, receive, ScoreRequest, decode_score)
        return 200, _encode(await score_request(self.service, req, started)), []

    async def _route(self, scope: Scope, receive: Receive, _: str) -> Answer:
        req = await _read(scope, receive, RouteRequest, decode_route)
        inputs = await route_inputs(self.service, req)  # the index, off the event loop
        try:
            answer = decide_route(self.service, req, inputs)
        except NoCapacity as exc:  # an answer about the fleet, not a refused request
            retry = [(b"retry-after", str(exc.retry_after).encode())]
            return 429, error_body(exc.code, exc.detail), retry
        return 200, _encode(answer), []

    async def _done(self, scope: Scope, receive: Receive, route_id: str) -> Answer:
        return 200, _encode(release_route(self.service, route_id)), []


async def _read(
    scope: Scope, receive: Receive, kind: type[R], decode_json: Callable[[bytes], R]
) -> R:
    """The request body as ``kind``; the Content-Type is checked (415) before the body
    is read."""
    media = body_media(_header(scope, b"content-type"))
    body = await receive_body(receive)
    return parse_request(kind, media, scope.get("query_string", b""), body, decode_json)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def openapi_paths() -> tuple[dict[str, Any], dict[str, Any]]:
    """The OpenAPI path items of the three paths served here, and the schema components
    they refer to; FastAPI's document adds them to its own."""
    (score_in, score_out, route_in, route_out, done, error), components = openapi_schema(
        ScoreRequest, ScoreResponse, RouteRequest, RouteResponse, RouteDone, ErrorBody
    )

    def described(text: str) -> dict[str, Any]:
        return {"description": text, "content": {JSON: {"schema": error}}}

    everywhere = 429  # --max-in-flight applies to every route but the probes
    score = {
        "summary": "Score a prompt: each pod's longest cached prefix, best first",
        "description": "A 404 `unknown_model` right after a deploy means no pod has "
        "published events for the model yet: fall back to default balancing, as for a 503.",
        "operationId": "score_score_post",
        "requestBody": request_body(score_in),
        "parameters": binary_parameters(ScoreRequest),
        "responses": {
            "200": ok_response("Scores", score_out),
            **error_responses(error, 400, 404, 408, 413, 415, 503, everywhere),
        },
    }
    route = {
        "summary": "Choose the pod that should serve a prompt now: cached prefix against load",
        "operationId": "route_route_post",
        "requestBody": request_body(route_in),
        "parameters": binary_parameters(RouteRequest),
        "responses": {
            "200": ok_response("Decision", route_out),
            **error_responses(error, 400, 408, 413, 415),
            "429": described(
                "no_capacity: no pod admissible (KV cache or queue over the limit), see "
                "Retry-After; or too many requests in flight (--max-in-flight)"
            ),
            "503": described("no_pods: no pods given and none known"),
        },
    }
    route_id = "The route_id /route answered"
    route_done = {
        "summary": "The routed request finished: stop counting it against its pod",
        "operationId": "route_done_route__route_id__done_post",
        "parameters": [
            {
                "name": "route_id",
                "in": "path",
                "required": True,
                "schema": {"type": "string", "description": route_id, "title": "Route Id"},
                "description": route_id,
            }
        ],
        "responses": {
            "200": ok_response("Released", done),
            "404": described("Unknown route id (never routed, already done, or expired)"),
        },
    }
    paths = {
        "/score": {"post": score},
        "/route": {"post": route},
        "/route/{route_id}/done": {"post": route_done},
    }
    return paths, components

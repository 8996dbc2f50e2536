"""``POST /score``, ``POST /route``, ``POST /route/{route_id}/done`` and
``/route/{route_id}/first-token`` answered without FastAPI: the handlers
(:class:`HotRoutes`), and the ASGI app in front of the FastAPI app that serves every
other path (:class:`HotPath`).

Why not FastAPI routes: their dispatch (matching, dependencies, middleware, Starlette's
Request and Response) costs a visible share of a ``/score``'s CPU (bench/README.md), for
bodies msgspec already decodes and validates. :class:`HotRoutes` knows no transport:
:class:`HotPath` serves it over ASGI (any server, the tests' ``TestClient``) and
``api/http/hot_lane.py`` inside uvicorn's protocol. What the FastAPI routes gave is kept:
errors in ``api/http/errors.py``'s shape and counting, a 405 with ``Allow``, a trailing slash
accepted, the same limits, and OpenAPI items (:mod:`kvindex.api.http.hot_openapi`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import parse_qsl, urlencode

import msgspec

from kvindex.api.http.asgi import (
    ASGIApp,
    ClientLeft,
    Headers,
    Receive,
    Scope,
    Send,
    receive_body,
    send_json,
)
from kvindex.api.http.errors import error_body, refusal
from kvindex.api.http.route import (
    NoCapacity,
    decide_route,
    decode_route,
    index_inputs,
    release_prefill,
    release_route,
    route_inputs,
)
from kvindex.api.http.schemas import RouteOutcome, RouteRequest, ScoreRequest
from kvindex.api.http.score import decode_score, score_inline, score_request
from kvindex.api.http.score_inputs import body_media, parse_request
from kvindex.events.errors import ClientError, KvindexError

if TYPE_CHECKING:
    from kvindex.api.http.route import RouteInputs
    from kvindex.api.serve.service import Service

log = logging.getLogger(__name__)

# A handler's answer: status, JSON body, headers besides content-type and content-length.
Answer = tuple[int, bytes, Headers]

R = TypeVar("R", bound=ScoreRequest)

_encode = msgspec.json.Encoder().encode
_outcome_decoder = msgspec.json.Decoder(RouteOutcome)
_ROUTE_PREFIX, _DONE_SUFFIX, _FIRST_SUFFIX = "/route/", "/done", "/first-token"
ALLOW = [(b"allow", b"POST")]


@dataclass(frozen=True, slots=True)
class Posted:
    """A POST to one of the hot paths, its body whole: what a handler reads. ``media``
    is :func:`kvindex.api.http.score_inputs.body_media`'s verdict on its Content-Type."""

    path: str
    media: str
    query: bytes
    body: bytes
    argument: str = ""  # the route id of /route/{route_id}/done (or /first-token)


@dataclass(frozen=True, slots=True)
class Route:
    """One hot path's handler in its two forms: everything on the caller (for an index
    whose work never waits), or the index work awaited under its deadline."""

    inline: Callable[[Posted], Answer]
    awaited: Callable[[Posted], Awaitable[Answer]]


class HotRoutes:
    """The three handlers, matched by path, with errors answered in kvindex's shape and
    counted by ``on_refusal(path, code)``, as the FastAPI handlers do. When the index work
    never waits (the memory backend) a request runs to its end on the caller
    (:meth:`answer`); otherwise it is awaited (:meth:`answer_async`)."""

    def __init__(self, service: Service, on_refusal: Callable[[str, str], None]) -> None:
        self.service = service
        self.on_refusal = on_refusal
        #: The index work runs on the caller (memory backend): :meth:`answer` may be used.
        self.inline = service.index_work.inline
        timed = self._timed if service.route_clock is not None else _untimed
        self._exact = {
            "/score": Route(self._score, self._score_awaited),
            "/route": timed(Route(self._route, self._route_awaited)),
        }
        self._done_route = timed(Route(self._done, self._done_awaited))
        self._first_route = timed(Route(self._first, self._first_awaited))

    def match(self, path: str) -> tuple[Route, str] | None:
        """The route of ``path`` and its path parameter (a route id), or None."""
        if len(path) > 1 and path[-1] == "/":
            path = path[:-1]
        route = self._exact.get(path)
        if route is not None:
            return route, ""
        if path.startswith(_ROUTE_PREFIX):
            for suffix, route in (
                (_DONE_SUFFIX, self._done_route),
                (_FIRST_SUFFIX, self._first_route),
            ):
                if path.endswith(suffix):
                    route_id = path[len(_ROUTE_PREFIX) : -len(suffix)]
                    if route_id and "/" not in route_id:  # Starlette's {route_id}: [^/]+
                        return route, route_id
        return None

    def answer(self, route: Route, posted: Posted) -> Answer:
        """``posted`` answered on the caller; only when :attr:`inline`."""
        try:
            return route.inline(posted)
        except Exception as exc:
            return self.failed(exc, posted.path)

    async def answer_async(self, route: Route, posted: Posted) -> Answer:
        """``posted`` answered, the index work awaited under ``service.index_work``."""
        try:
            return await route.awaited(posted)
        except Exception as exc:
            return self.failed(exc, posted.path)

    def failed(self, exc: Exception, path: str, method: str = "POST") -> Answer:
        """The answer to a request that raised ``exc``, counted: kvindex's own errors by
        their kind, anything else a bug (logged with its traceback, none for the client)."""
        if isinstance(exc, KvindexError):
            self.on_refusal(path, exc.code)
            status, body = refusal(exc, method, path)
            return status, body, []
        log.error("%s %s failed", method, path, exc_info=exc)
        self.on_refusal(path, "internal_error")
        return 500, error_body("internal_error", f"internal error ({type(exc).__name__})"), []

    def not_allowed(self, method: str, path: str) -> Answer:
        """The 405 for another method on a hot path, counted."""
        self.on_refusal(path, "method_not_allowed")
        return 405, error_body("method_not_allowed", f"{method} is not allowed on {path}"), ALLOW

    def _timed(self, route: Route) -> Route:
        """``route`` with the caller's time applied first (``--clock external``)."""

        async def awaited(posted: Posted) -> Answer:
            return await route.awaited(self._at_its_time(posted))

        return Route(lambda posted: route.inline(self._at_its_time(posted)), awaited)

    def _at_its_time(self, posted: Posted) -> Posted:
        """Moves the external clock to the call's ``?now=``, and returns the call without
        it (a binary body's query takes only the request's fields)."""
        clock = self.service.route_clock
        assert clock is not None  # only routes wrapped by _timed get here
        pairs = parse_qsl(posted.query.decode("latin-1"), keep_blank_values=True)
        times = [value for name, value in pairs if name == "now"]
        if len(times) != 1:
            raise ClientError(
                "kvindex runs with --clock external: every /route call carries its "
                "time once, as ?now=SECONDS"
            )
        try:
            clock.advance_to(float(times[0]))
        except ValueError as exc:
            raise ClientError(f"?now={times[0]!r}: {exc}") from None
        rest = urlencode([(name, value) for name, value in pairs if name != "now"])
        return replace(posted, query=rest.encode("latin-1"))

    # -- the handlers ------------------------------------------------------------------

    def _score(self, posted: Posted) -> Answer:
        started = time.perf_counter()
        req = _parse(posted, ScoreRequest, decode_score)
        return 200, _encode(score_inline(self.service, req, started)), []

    async def _score_awaited(self, posted: Posted) -> Answer:
        started = time.perf_counter()
        req = _parse(posted, ScoreRequest, decode_score)
        return 200, _encode(await score_request(self.service, req, started)), []

    def _route(self, posted: Posted) -> Answer:
        req = _parse(posted, RouteRequest, decode_route)
        return self._decide(req, index_inputs(self.service, req))

    async def _route_awaited(self, posted: Posted) -> Answer:
        req = _parse(posted, RouteRequest, decode_route)
        return self._decide(req, await route_inputs(self.service, req))  # index off the loop

    def _decide(self, req: RouteRequest, inputs: RouteInputs) -> Answer:
        try:
            answer = decide_route(self.service, req, inputs)
        except NoCapacity as exc:  # an answer about the fleet, not a refused request
            retry = [(b"retry-after", str(exc.retry_after).encode())]
            return 429, error_body(exc.code, exc.detail), retry
        return 200, _encode(answer), []

    def _done(self, posted: Posted) -> Answer:
        outcome = None
        if posted.body.strip():  # optional: how the pod answered
            try:
                outcome = _outcome_decoder.decode(posted.body).outcome
            except msgspec.DecodeError as exc:
                raise ClientError(f"/route/{{route_id}}/done body: {exc}") from None
        return 200, _encode(release_route(self.service, posted.argument, outcome)), []

    async def _done_awaited(self, posted: Posted) -> Answer:
        return self._done(posted)

    def _first(self, posted: Posted) -> Answer:
        return 200, _encode(release_prefill(self.service, posted.argument)), []

    async def _first_awaited(self, posted: Posted) -> Answer:
        return self._first(posted)


def _untimed(route: Route) -> Route:
    return route


def _parse(posted: Posted, kind: type[R], decode_json: Callable[[bytes], R]) -> R:
    return parse_request(kind, posted.media, posted.query, posted.body, decode_json)


class HotPath:
    """The ASGI app: the three POST paths through :class:`HotRoutes`, everything else to
    ``inner`` (FastAPI)."""

    def __init__(self, routes: HotRoutes, inner: ASGIApp) -> None:
        self.routes = routes
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            found = self.routes.match(scope["path"])
            if found is not None:
                await self._answer(scope, receive, send, *found)
                return
        await self.inner(scope, receive, send)

    async def _answer(
        self, scope: Scope, receive: Receive, send: Send, route: Route, argument: str
    ) -> None:
        routes, method, path = self.routes, scope["method"], scope["path"]
        if method != "POST":
            status, body, headers = routes.not_allowed(method, path)
        else:
            try:  # the Content-Type is checked (415) before the body is read
                media = body_media(_header(scope, b"content-type"))
                body = await receive_body(receive)
                posted = Posted(path, media, scope.get("query_string", b""), body, argument)
            except ClientLeft:
                return
            except Exception as exc:  # 415, or the limits' 413 and 408 while it streams
                status, body, headers = routes.failed(exc, path)
            else:
                answer = routes.answer(route, posted) if routes.inline else None
                if answer is None:  # not inline, or passed on (a serving worker's relay)
                    answer = await routes.answer_async(route, posted)
                status, body, headers = answer
        await send_json(send, status, body, headers)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None

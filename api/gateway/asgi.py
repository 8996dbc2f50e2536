"""The gateway as a plain ASGI app, in front of kvindex's own app or on its own.

Plain ASGI rather than FastAPI routes: the gateway's latency budget is small, FastAPI's
route machinery takes a large part of it, and the bodies are not ours to validate (the
pod does). The four paths are matched in a dict. Every other ``/v1`` path is the
gateway's too (an OpenAI client sent it): its 404 or 405 is in OpenAI's error shape and
names what is served. Everything else goes to the inner app (``kvindex serve
--gateway``), or is an OpenAI-shaped 404 when the gateway runs alone (which then answers
``GET /metrics`` and ``GET /openapi.json`` itself). The gateway's requests get
:class:`kvindex.api.http.limits.RequestLimits` of their own, so long streamed answers never
use up the slots ``/route`` and ``/score`` are answered from.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.responses import JSONResponse, Response

from kvindex.api.gateway.app import Gateway, openai_error
from kvindex.api.gateway.bodies import Endpoint
from kvindex.api.gateway.errors import is_openai_path
from kvindex.api.gateway.openapi import SUPPORTED, gateway_document
from kvindex.api.http.asgi import (
    ASGIApp,
    ClientLeft,
    Message,
    Receive,
    Scope,
    Send,
    answer_lifespan,
)
from kvindex.api.http.errors import status_of
from kvindex.api.http.limits import RequestLimits, gateway_error_body
from kvindex.api.serve.settings import Settings
from kvindex.api.version import VERSION
from kvindex.events.errors import KvindexError

log = logging.getLogger(__name__)


class GatewayApp:
    """``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` and
    ``GET /health``; other requests go to ``inner`` (or get a 404 without one). The
    gateway is closed when the server shuts down."""

    def __init__(self, gateway: Gateway, settings: Settings, inner: ASGIApp | None = None):
        self.gateway = gateway
        self.inner = inner
        completions, chat = Endpoint.COMPLETIONS, Endpoint.CHAT
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive], Awaitable[Response]]] = {
            ("POST", completions.value): lambda s, r: gateway.proxy(completions, s, r),
            ("POST", chat.value): lambda s, r: gateway.proxy(chat, s, r),
            ("GET", "/v1/models"): lambda s, r: gateway.models(),
            ("GET", "/health"): lambda s, r: gateway.health(),
        }
        if inner is None:  # alone: its own metrics (in front of kvindex: the index's page)
            self._routes[("GET", "/metrics")] = lambda s, r: gateway.metrics_page()
            self._routes[("GET", "/openapi.json")] = lambda s, r: _document()
        self._limited = RequestLimits.of(
            self._serve, settings.http, error_body_of=gateway_error_body
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http" and (scope["method"], scope["path"]) in self._routes:
            await self._limited(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(scope, receive, send)
        elif self.inner is not None and not (kind == "http" and is_openai_path(scope["path"])):
            await self.inner(scope, receive, send)
        elif kind == "http":
            await self._unrouted(scope["method"], scope["path"])(scope, receive, send)

    def _unrouted(self, method: str, path: str) -> Response:
        """A 405 for a served path asked with another method, else a 404; both name
        what the gateway serves (an OpenAI client shows only the message)."""
        allowed = sorted(m for m, p in self._routes if p == path)
        if allowed:
            return openai_error(
                405,
                "method_not_allowed",
                f"{method} is not allowed on {path}; this gateway serves {SUPPORTED}",
                headers={"allow": ", ".join(allowed)},
            )
        return openai_error(
            404, "not_found", f"no route {method} {path}: this gateway serves {SUPPORTED}"
        )

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await self._routes[(scope["method"], scope["path"])](scope, receive)
        except ClientLeft:  # before its body was whole: nobody to answer
            return
        except KvindexError as exc:  # the body too large or too slow (RequestLimits)
            response = openai_error(status_of(exc), exc.code, exc.detail)
        except Exception as exc:  # a bug: logged with its traceback, none for the client
            log.error("gateway %s %s failed", scope["method"], scope["path"], exc_info=exc)
            response = openai_error(500, "internal_error", f"internal error ({type(exc).__name__})")
        await response(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The inner app's lifespan (kvindex's service), then the gateway closed."""

        async def sending(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete":
                await self.gateway.aclose()
            await send(message)

        if self.inner is not None:
            await self.inner(scope, receive, sending)
            return
        await answer_lifespan(receive, sending)


async def _document() -> Response:
    return JSONResponse(gateway_document(VERSION))

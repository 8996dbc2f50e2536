"""Request limits enforced before a handler buffers anything: body size, body pace,
requests in flight.

An ASGI middleware, so the limits hold while the body streams in: a 100 MB body is
refused after the first chunk past the limit (or at once, from its Content-Length),
never read whole; a client trickling its body is cut off at a deadline; past
``max_in_flight`` concurrent requests a new one gets 429 instead of queueing without
bound. Probes and metrics are exempt from the in-flight cap, so a loaded replica is
not also declared dead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvindex.api.asgi import ASGIApp, Message, Receive, Scope, Send, send_json
from kvindex.api.errors import error_body
from kvindex.events.errors import RequestTimeout, TooLarge

_EXEMPT = frozenset({"/healthz", "/readyz", "/metrics", "/health"})  # /health: the gateway's


class RequestLimits:
    """ASGI middleware: ``max_body_bytes`` (413), ``body_timeout_s`` (408),
    ``max_in_flight`` (429). ``on_refusal(path, code)`` counts what it refuses itself."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        body_timeout_s: float,
        max_in_flight: int,
        on_refusal: Callable[[str, str], None] = lambda path, code: None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.max_in_flight = max_in_flight
        self.on_refusal = on_refusal
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exempt = scope["path"] in _EXEMPT
        if not exempt and self.in_flight >= self.max_in_flight:
            await self._refuse(
                scope,
                send,
                429,
                "too_many_requests",
                f"more than {self.max_in_flight} requests in flight (--max-in-flight); "
                "retry shortly",
            )
            return
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            await self._refuse(scope, send, 413, TooLarge.code, self._too_large(f"{length} bytes"))
            return
        self.in_flight += 0 if exempt else 1
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            self.in_flight -= 0 if exempt else 1

    def _too_large(self, size: str) -> str:
        return (
            f"body of {size} is larger than the limit of {self.max_body_bytes} bytes "
            "(--max-body-bytes)"
        )

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` counting body bytes and bounding the time until the body is whole.
        Once it is, later calls (waiting for a disconnect) pass through untouched."""
        received = 0
        deadline: float | None = None
        body_done = False

        async def limited() -> Message:
            nonlocal received, deadline, body_done
            if body_done:
                return await receive()
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.body_timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeout(
                    f"the request body did not arrive within {self.body_timeout_s:g} s "
                    "(--body-timeout)"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise TooLarge(self._too_large(f"more than {received} bytes"))
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        return limited

    async def _refuse(self, scope: Scope, send: Send, status: int, code: str, detail: str) -> None:
        self.on_refusal(scope["path"], code)
        await send_json(send, status, error_body(code, detail), [(b"connection", b"close")])


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.strip()
            return int(text) if text.isdigit() else None
    return None

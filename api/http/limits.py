"""Request limits enforced before a handler buffers anything: body size, body pace,
requests in flight.

An ASGI middleware, so the limits hold while the body streams in: a body past the limit
is refused at its first chunk over it (or at once, from its Content-Length), never read
whole; a client trickling its body is cut off at a deadline; past ``max_in_flight``
concurrent requests a new one gets 429 instead of queueing without bound. Probes and
metrics are exempt from the cap, so a loaded replica is not also declared dead. The
hot lane (``api/http/hot_lane.py``) reads bodies outside ASGI and applies the same limits
through :meth:`RequestLimits.admission`, :meth:`~RequestLimits.body_too_large` and
:meth:`~RequestLimits.body_too_slow`, counted in the same ``in_flight``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvindex.api.http.asgi import ASGIApp, Message, Receive, Scope, Send, send_json
from kvindex.api.http.errors import error_body, status_of
from kvindex.events.errors import KvindexError, RequestTimeout, TooLarge, TooManyRequests

if TYPE_CHECKING:
    from kvindex.api.serve.settings import HttpSettings

CLOSE = [(b"connection", b"close")]  # a refusal before the body: the body is not read
_EXEMPT = frozenset({"/healthz", "/readyz", "/metrics", "/health"})  # /health: the gateway's


def _kvindex_error_body(path: str, status: int, code: str, detail: str) -> bytes:
    return error_body(code, detail)


def gateway_error_body(path: str, status: int, code: str, detail: str) -> bytes:
    """A refusal in front of the gateway: OpenAI's shape on its /v1 paths, kvindex's
    elsewhere. The gateway's package is imported at the first refusal on /v1, not at
    start (a serving worker has no other use for it)."""
    from kvindex.api.gateway.errors import is_openai_path, openai_error_body

    if is_openai_path(path):
        return openai_error_body(status, code, detail)
    return error_body(code, detail)


class RequestLimits:
    """ASGI middleware: ``max_body_bytes`` (413), ``body_timeout_s`` (408),
    ``max_in_flight`` (429). ``on_refusal(path, code)`` counts what it refuses itself;
    ``error_body_of(path, status, code, detail)`` writes its refusals (kvindex's shape
    unless the app answers a path in another: the gateway's /v1 is OpenAI's)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        body_timeout_s: float,
        max_in_flight: int,
        on_refusal: Callable[[str, str], None] = lambda path, code: None,
        error_body_of: Callable[[str, int, str, str], bytes] = _kvindex_error_body,
    ) -> None:
        self.app = app
        self.error_body_of = error_body_of
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.max_in_flight = max_in_flight
        self.on_refusal = on_refusal
        self.in_flight = 0

    @classmethod
    def of(
        cls,
        app: ASGIApp,
        http: HttpSettings,
        on_refusal: Callable[[str, str], None] = lambda path, code: None,
        error_body_of: Callable[[str, int, str, str], bytes] = _kvindex_error_body,
    ) -> RequestLimits:
        """``app`` under the limits ``http`` (the settings' section) names."""
        return cls(
            app,
            max_body_bytes=http.max_body_bytes,
            body_timeout_s=http.body_timeout,
            max_in_flight=http.max_in_flight,
            on_refusal=on_refusal,
            error_body_of=error_body_of,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        exempt = path in _EXEMPT
        refused = self.admission(path, _content_length(scope.get("headers", ())))
        if refused is not None:
            self.on_refusal(path, refused.code)
            status = status_of(refused)
            body = self.error_body_of(path, status, refused.code, refused.detail)
            await send_json(send, status, body, CLOSE)
            return
        self.in_flight += 0 if exempt else 1
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            self.in_flight -= 0 if exempt else 1

    def admission(self, path: str, content_length: int | None) -> KvindexError | None:
        """Why a request for ``path`` that declares ``content_length`` is refused before
        its body is read (429 past ``max_in_flight``, 413 past ``max_body_bytes``), or
        None. Not counted here: the caller answers and counts it."""
        if path not in _EXEMPT and self.in_flight >= self.max_in_flight:
            return TooManyRequests(
                f"more than {self.max_in_flight} requests in flight (--max-in-flight); "
                "retry shortly"
            )
        if content_length is not None and content_length > self.max_body_bytes:
            return TooLarge(self._too_large(f"{content_length} bytes"))
        return None

    def body_too_large(self, received: int) -> TooLarge | None:
        """The 413 for a body of which ``received`` bytes came so far, or None."""
        if received > self.max_body_bytes:
            return TooLarge(self._too_large(f"more than {received} bytes"))
        return None

    def body_too_slow(self) -> RequestTimeout:
        """The 408 for a body not whole within ``body_timeout_s``."""
        return RequestTimeout(
            f"the request body did not arrive within {self.body_timeout_s:g} s (--body-timeout)"
        )

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
                raise self.body_too_slow() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                too_large = self.body_too_large(received)
                if too_large is not None:
                    raise too_large
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        return limited


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return content_length(value)
    return None


def content_length(value: bytes) -> int | None:
    """A Content-Length header's value, None when it is not a plain number (the HTTP
    parser refuses those before they get here)."""
    text = value.strip()
    return int(text) if text.isdigit() else None

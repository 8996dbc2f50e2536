"""The ASGI vocabulary kvindex's own HTTP layers share: type names, and reading a request
body straight from its messages.

The hot path (``/score``, ``/route``), the request limits and the gateway each speak raw
ASGI rather than through Starlette's ``Request``, because their work is counted in
microseconds; this module is what they have in common.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = Sequence[tuple[bytes, bytes]]


class ClientLeft(Exception):
    """The client disconnected before its request body was whole: nobody to answer."""


async def receive_body(receive: Receive) -> bytes:
    """The whole request body; one ``receive`` for a body that came in one piece."""
    message = await receive()
    if message["type"] != "http.request":
        raise ClientLeft
    body = message.get("body", b"")
    if not message.get("more_body", False):
        return body
    chunks = [body]
    while message.get("more_body", False):
        message = await receive()
        if message["type"] != "http.request":
            raise ClientLeft
        chunks.append(message.get("body", b""))
    return b"".join(chunks)


async def send_json(send: Send, status: int, body: bytes, headers: Headers = ()) -> None:
    """A whole JSON answer as the two ASGI messages (start, then the body in one)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """The lifespan of an app with nothing to start or stop: both steps complete at once."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return

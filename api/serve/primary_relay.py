"""A serving worker's way to the primary (``kvindex serve --processes N``): requests it
does not answer itself, sent over the primary's Unix socket as plain HTTP/1.1.

Why not httpx: over the Unix socket its cost per request was several times that of a
request written and parsed by hand (bench/README.md, "api/: the figures behind its
design"), and ``/route`` and the gateway's requests pass through here. A request is one
write on a kept-alive connection; the answer is read with httptools. :class:`Relay` is
also the worker's ASGI app for every path the lane does not take: a sized answer is
sent in one piece, a streamed one (server-sent events) chunk by chunk. The client is
watched from the moment its request is sent: a client that leaves closes the connection
to the primary, which is how the primary's gateway learns to stop the pod's request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httptools

from kvindex.api.http.asgi import (
    ClientLeft,
    Receive,
    Scope,
    Send,
    answer_lifespan,
    receive_body,
    send_json,
)
from kvindex.api.http.errors import error_body
from kvindex.api.http.hot_path import Answer, Posted

# Headers of one connection, not of the message: never passed on, either way.
_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"te",
        b"upgrade",
        b"proxy-connection",
        b"content-length",
    }
)
# Of an answer: the worker's lane and uvicorn write their own.
_OWN = _HOP | {b"date", b"server", b"content-type"}
_PASSED_ON_BY_SERVER = _HOP | {b"date", b"server"}
_READ = 1 << 16
CONNECT_TIMEOUT_S = 5.0
IDLE_KEPT = 64  # connections kept open for the next request


class PrimaryGone(ConnectionError):
    """The primary could not be reached, or closed the connection mid-answer."""


class _Reply:
    """One answer being read: status and headers once whole, then its body as it comes."""

    def __init__(self, connection: _Connection) -> None:
        self.connection = connection
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.headed = False
        self.complete = False
        self.parser = httptools.HttpResponseParser(self)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headed = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    @property
    def whole(self) -> bool:
        """Whether the answer declared its length (not a stream)."""
        return any(name == b"content-length" for name, _ in self.headers)

    async def read_more(self) -> None:
        """Feed the parser what the connection has next (PrimaryGone at its end)."""
        data = await self.connection.reader.read(_READ)
        if not data:
            raise PrimaryGone("the primary closed the connection mid-answer")
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise PrimaryGone(f"the primary's answer did not parse: {exc}") from None

    async def body(self) -> AsyncIterator[bytes]:
        """The body's chunks, until the answer is complete."""
        while True:
            if self.chunks:
                chunks, self.chunks = self.chunks, []
                for chunk in chunks:
                    yield chunk
            if self.complete:
                return
            await self.read_more()


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


class Primary:
    """Kept-alive HTTP/1.1 connections to the primary's Unix socket."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._idle: list[_Connection] = []

    async def send(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> _Reply:
        """Send a request; its reply once the status and headers are in. A kept
        connection the primary had closed meanwhile (its keep-alive timeout) is found out
        before any answer, and the request goes again on a new one. Raises PrimaryGone."""
        head = [method, b" ", target, b" HTTP/1.1\r\n"]
        for name, value in headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        request = b"".join(head) + body
        while True:
            reused = bool(self._idle)
            connection = self._idle.pop() if reused else await self._connect()
            reply = _Reply(connection)
            try:
                connection.writer.write(request)
                while not reply.headed:
                    await reply.read_more()
                return reply
            except (PrimaryGone, OSError) as exc:
                connection.close()
                if not reused or reply.headed:
                    raise PrimaryGone(str(exc)) from None
            except BaseException:  # cancelled (the client left): the primary must see it
                connection.close()
                raise

    def done(self, reply: _Reply) -> None:
        """Keep ``reply``'s connection for the next request when the answer was read
        whole and the primary keeps it open; close it otherwise."""
        keep = reply.complete and reply.parser.should_keep_alive()
        if keep and len(self._idle) < IDLE_KEPT:
            self._idle.append(reply.connection)
        else:
            reply.connection.close()

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.socket_path), CONNECT_TIMEOUT_S
            )
        except (TimeoutError, OSError) as exc:
            raise PrimaryGone(f"cannot connect to the primary: {exc or 'timed out'}") from None
        return _Connection(reader, writer)

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


class Relay:
    """Requests passed on to the primary: lane POSTs (:meth:`post`) and, as an ASGI app,
    every request the worker's lane does not take."""

    def __init__(self, socket_path: str) -> None:
        self.primary = Primary(socket_path)

    async def post(self, posted: Posted) -> Answer:
        """A POST the lane took (``/score``, ``/route``...), answered by the primary."""
        target = posted.path.encode("latin-1")
        if posted.query:
            target += b"?" + posted.query
        headers = [(b"host", b"kvindex"), (b"content-type", posted.media.encode("latin-1"))]
        try:
            reply = await self.primary.send(b"POST", target, headers, posted.body)
            body = b"".join([chunk async for chunk in reply.body()])
        except PrimaryGone as exc:
            return 503, _unreachable(exc), []
        self.primary.done(reply)
        return reply.status, body, [(k, v) for k, v in reply.headers if k not in _OWN]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":  # nothing to start or stop
                await answer_lifespan(receive, send)
            return
        try:
            body = await receive_body(receive)
        except ClientLeft:
            return
        target = scope.get("raw_path") or scope["path"].encode("latin-1")
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _HOP]
        # The answer is fetched and passed on while the client is watched, in every
        # phase (before the primary answers, a whole answer, a stream): a client that
        # leaves closes the connection to the primary, so the primary sees it leave too
        # (its gateway then stops the pod's request).
        answering = asyncio.ensure_future(
            self._answer(scope["method"].encode(), target, headers, body, send)
        )
        left = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((answering, left), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (answering, left):
                task.cancel()
            await asyncio.gather(answering, left, return_exceptions=True)
        if not answering.cancelled() and answering.exception() is not None:
            raise answering.exception()  # type: ignore[misc]

    async def _answer(
        self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
        send: Send,
    ) -> None:  # fmt: skip
        """The primary's answer to one request, passed on; the connection kept for the
        next request only when the answer was read whole."""
        try:
            reply = await self.primary.send(method, target, headers, body)
        except PrimaryGone as exc:
            await send_json(send, 503, _unreachable(exc))
            return
        try:
            start = {
                "type": "http.response.start",
                "status": reply.status,
                "headers": [(k, v) for k, v in reply.headers if k not in _PASSED_ON_BY_SERVER],
            }
            if reply.whole:  # one read, one write
                try:
                    answer = b"".join([chunk async for chunk in reply.body()])
                except PrimaryGone as exc:
                    await send_json(send, 503, _unreachable(exc))
                    return
                start["headers"].append((b"content-length", b"%d" % len(answer)))
                await send(start)
                await send({"type": "http.response.body", "body": answer})
            else:
                await _stream(reply, start, send)
        finally:
            self.primary.done(reply)  # kept when read whole, closed otherwise (cancelled)


async def _stream(reply: _Reply, start: dict[str, Any], send: Send) -> None:
    await send(start)
    try:
        async for chunk in reply.body():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except PrimaryGone:
        pass  # the answer stops short, as the primary's did
    await send({"type": "http.response.body", "body": b""})


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (its body was read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _unreachable(exc: Exception) -> bytes:
    return error_body("primary_unavailable", f"the kvindex primary process did not answer: {exc}")

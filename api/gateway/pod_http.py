"""HTTP/1.1 to the pods: kept-alive connections per pod, httptools' response parser.

Why not httpx, which the rest of kvindex uses: on the gateway's path every request pays
its client twice (once for the pod, once more when routing over HTTP), and httpx's async
stack (httpcore over anyio) costs about 2.7 ms per request on the 2-core benchmark
machine against 0.3 ms for the whole exchange over plain asyncio streams
(``bench/bench_gateway.py``), which alone is more than the gateway's budget of 1 ms.
The pods speak one protocol (vLLM's OpenAI server: HTTP/1.1, ``Content-Length`` or
chunked bodies), so a small client is enough: one write per request, the response
parsed by httptools (the C parser uvicorn uses, already installed with it).

Contract: :meth:`PodConnections.send` returns once the status line and headers are in,
or raises :class:`PodUnreachable` when the pod never answered (refused, timed out
while connecting, closed without a status line), the only case in which the request
may go to another pod. A kept-alive connection the pod closed while idle is retried
once on a fresh connection before that verdict. The body is then read with
:meth:`PodResponse.iter_body` (decoded from chunked framing, otherwise unchanged);
:meth:`PodResponse.aclose` returns a finished connection to the pool or closes an
unfinished one, which is how the pod learns the client went away.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Mapping

import httptools

_READ_BYTES = 65_536
_MAX_HEAD_BYTES = 65_536
_MAX_IDLE_PER_POD = 64


class PodUnreachable(Exception):
    """The pod did not answer at all; the request may go to another pod."""


class PodBroken(Exception):
    """The pod's answer broke off (or was not HTTP) after it began."""


class _Parsed:
    """httptools callbacks: what has been parsed so far."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.body: deque[bytes] = deque()
        self.complete = False
        self.keep_alive = False
        self.parser: httptools.HttpResponseParser | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        # Asked now: once the message is complete, llhttp has moved on and says False.
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(bytes(body))

    def on_message_complete(self) -> None:
        self.complete = True


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class PodResponse:
    """A pod's answer: ``status`` and ``headers`` (lower-case names) read, the body not."""

    def __init__(
        self,
        pool: PodConnections,
        pod: str,
        connection: _Connection,
        parser: httptools.HttpResponseParser,
        parsed: _Parsed,
        read_timeout_s: float,
    ) -> None:
        self.status: int = parser.get_status_code()
        self.headers = parsed.headers
        self._pool, self._pod, self._connection = pool, pod, connection
        self._parser, self._parsed = parser, parsed
        self._read_timeout_s = read_timeout_s
        self._closed = False

    @property
    def whole(self) -> bool:
        """Whether the rest of the body is already read (nothing left to wait for)."""
        return self._parsed.complete

    async def iter_body(self) -> AsyncIterator[bytes]:
        """The body as it arrives, one piece per network read."""
        parsed = self._parsed
        while True:
            while parsed.body:
                yield parsed.body.popleft()
            if parsed.complete:
                return
            try:
                async with asyncio.timeout(self._read_timeout_s):  # no task, unlike wait_for
                    data = await self._connection.reader.read(_READ_BYTES)
            except TimeoutError:
                raise PodBroken(f"{self._pod} silent for {self._read_timeout_s:g} s") from None
            except OSError as exc:
                raise PodBroken(f"{self._pod}: {exc}") from None
            if not data:
                if not _delimited_by_close(self.headers):
                    raise PodBroken(f"{self._pod} closed the connection mid-answer")
                parsed.complete = True  # the body ends where the connection does
                continue
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserError as exc:
                raise PodBroken(f"{self._pod} sent no valid HTTP: {exc}") from None

    async def aclose(self) -> None:
        """Release the connection: back to the pool when the answer is whole and the pod
        keeps it alive, closed otherwise (mid-answer: the pod sees the client leave)."""
        if self._closed:
            return
        self._closed = True
        if self._parsed.complete and self._parsed.keep_alive:
            self._pool._put(self._pod, self._connection)
        else:
            self._connection.close()


class PodConnections:
    """Kept-alive HTTP/1.1 connections to each pod (``host:port``)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: dict[str, list[_Connection]] = {}

    async def send(
        self, pod: str, path: str, headers: Mapping[str, str], body: bytes, method: str = "POST"
    ) -> PodResponse:
        """``method`` (POST) ``body`` to ``http://{pod}{path}``; returns once the headers
        are in."""
        head = [f"{method} {path} HTTP/1.1\r\nhost: {pod}\r\ncontent-length: {len(body)}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers.items()]
        request = "".join(head).encode("latin-1") + b"\r\n" + body
        connection = self._take(pod)
        if connection is not None:
            try:
                return await self._exchange(pod, connection, request)
            except PodUnreachable:
                pass  # the pod closed it while idle: once more on a fresh connection
        return await self._exchange(pod, await self._connect(pod), request)

    async def _exchange(self, pod: str, connection: _Connection, request: bytes) -> PodResponse:
        parsed = _Parsed()
        parser = parsed.parser = httptools.HttpResponseParser(parsed)
        try:
            connection.writer.write(request)
            received = 0
            while not parsed.headers_done:
                async with asyncio.timeout(self.read_timeout_s):
                    data = await connection.reader.read(_READ_BYTES)
                if not data:
                    raise PodUnreachable(f"{pod} closed the connection without answering")
                received += len(data)
                if received > _MAX_HEAD_BYTES and not parsed.headers_done:
                    raise PodBroken(f"{pod}: response headers over {_MAX_HEAD_BYTES} bytes")
                parser.feed_data(data)
        except PodUnreachable:
            connection.close()
            raise
        except (ConnectionError, BrokenPipeError) as exc:
            connection.close()
            raise PodUnreachable(f"{pod}: {exc}") from None
        except TimeoutError:
            connection.close()
            raise PodBroken(f"{pod} silent for {self.read_timeout_s:g} s") from None
        except (OSError, httptools.HttpParserError, PodBroken) as exc:
            connection.close()
            raise PodBroken(f"{pod}: {exc}") from None
        return PodResponse(self, pod, connection, parser, parsed, self.read_timeout_s)

    async def _connect(self, pod: str) -> _Connection:
        host, _, port = pod.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), int(port)), self.connect_timeout_s
            )
        except TimeoutError:
            raise PodUnreachable(
                f"{pod}: no connection within {self.connect_timeout_s:g} s"
            ) from None
        except (OSError, ValueError) as exc:
            raise PodUnreachable(f"{pod}: {exc}") from None
        return _Connection(reader, writer)

    def _take(self, pod: str) -> _Connection | None:
        idle = self._idle.get(pod)
        while idle:
            connection = idle.pop()
            if not connection.writer.is_closing() and not connection.reader.at_eof():
                return connection
            connection.close()
        return None

    def _put(self, pod: str, connection: _Connection) -> None:
        idle = self._idle.setdefault(pod, [])
        if len(idle) < _MAX_IDLE_PER_POD:
            idle.append(connection)
        else:
            connection.close()

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                with contextlib.suppress(Exception):
                    connection.close()
        self._idle.clear()


def _delimited_by_close(headers: list[tuple[bytes, bytes]]) -> bool:
    """A body with neither a length nor chunked framing ends when the connection does."""
    names = {name for name, _ in headers}
    chunked = any(
        name == b"transfer-encoding" and b"chunked" in value.lower() for name, value in headers
    )
    return b"content-length" not in names and not chunked

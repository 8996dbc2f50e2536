"""HTTP/1.1 to the pods: kept-alive connections per pod, parsed as bytes arrive.

Why not httpx, which the rest of kvindex uses: every gateway request pays its client at
least once, and httpx's async stack (httpcore over anyio) alone costs more than the
gateway's latency budget (bench/README.md, "api/: the figures behind its design"). The
pods speak one protocol (vLLM's OpenAI server: HTTP/1.1, sized or chunked bodies), so a
small client is enough: each connection is an :class:`asyncio.Protocol` feeding
httptools (uvicorn's parser) in ``data_received``, wakes its request once per piece that
matters (the head, then body pieces), writes each request once, and keeps one read
deadline per connection checked by a timer that re-arms itself. Contract:
:meth:`PodConnections.send` (when a request may go elsewhere), then
:class:`PodResponse` (the body, and returning the connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable

import httptools

Header = tuple[bytes, bytes]

_MAX_HEAD_BYTES = 65_536
_MAX_IDLE_PER_POD = 64
# A streamed body read ahead of the client by more than this pauses reading from the pod.
_PAUSE_BYTES = 1 << 20


class PodUnreachable(Exception):
    """The pod did not answer at all; the request may go to another pod. ``delivered``
    is False only when the request certainly never reached it (no connection was
    made): then nothing it carried can have been acted on, which a retry that reuses a
    P/D prefill's KV depends on (:mod:`.upstream`)."""

    def __init__(self, message: str, *, delivered: bool, timed_out: bool = False) -> None:
        super().__init__(message)
        self.delivered = delivered
        self.timed_out = timed_out  # no connection, or no status line, in time


class PodBroken(Exception):
    """The pod's answer broke off (or was not HTTP) after it began."""


class _Connection(asyncio.Protocol):
    """One kept-alive connection to a pod and the answer being read on it (httptools
    callbacks fill the fields; one waiter at a time is woken when they change)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout_s: float) -> None:
        self.loop = loop
        self.read_timeout_s = read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False  # closed by either side: never reused
        self.failure: str | None = None  # why the bytes stopped being HTTP
        self._waiter: asyncio.Future[None] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self.begin()

    def begin(self) -> None:
        """Fresh state for the next answer on this connection."""
        self.status = 0
        self.headers: list[Header] = []
        self.head_bytes = 0
        self.headers_done = False
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        # perf_counter() when the request was written and when the answer's last byte
        # came: what lies between is the pod's time, not the gateway's.
        self.sent_at = 0.0
        self.completed_at = 0.0

    # -- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.headers_done:
            self.head_bytes += len(data)
        self._deadline = self.loop.time() + self.read_timeout_s
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.failure = f"sent no valid HTTP: {exc}"
            self._shut()
        if not self.headers_done and self.head_bytes > _MAX_HEAD_BYTES:
            self.failure = f"response headers over {_MAX_HEAD_BYTES} bytes"
            self._shut()
        if self.buffered > _PAUSE_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.lost = True
        if self.headers_done and not self.complete and _delimited_by_close(self.headers):
            self.complete = True  # the body ends where the connection does
            self.completed_at = time.perf_counter()
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake()

    # -- httptools callbacks ----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.status = self.parser.get_status_code()
        # Asked now: once the message is complete, llhttp has moved on and says False.
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.completed_at = time.perf_counter()

    # -- waiting ----------------------------------------------------------------------

    async def wait(self) -> None:
        """Until bytes arrive or the connection ends; TimeoutError after the pod was
        silent for ``read_timeout_s``."""
        waiter = self._waiter = self.loop.create_future()
        self._deadline = self.loop.time() + self.read_timeout_s
        timer = self._timer
        if timer is not None and timer.when() > self._deadline:  # a shorter wait (first byte)
            timer.cancel()
            timer = None
        if timer is None:
            self._timer = self.loop.call_at(self._deadline, self._check_deadline)
        try:
            await waiter
        finally:
            self._waiter = None

    def _check_deadline(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # idle: nothing waits (the next wait arms the timer again)
        if self.loop.time() < self._deadline:
            self._timer = self.loop.call_at(self._deadline, self._check_deadline)
        else:
            waiter.set_exception(TimeoutError())

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def taken(self, count: int) -> None:
        """``count`` body bytes went to the client: resume reading if it was paused."""
        self.buffered -= count
        if self._paused and self.buffered < _PAUSE_BYTES // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def usable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def _shut(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        self._shut()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class PodResponse:
    """A pod's answer: ``status`` and ``headers`` (lower-case names) read, the body not
    necessarily. The body is read with :meth:`iter_body` (chunked framing decoded,
    otherwise unchanged) or, once :attr:`whole`, taken with :meth:`take_body`;
    :meth:`close` returns a finished connection to the pool or closes an unfinished one,
    which is how the pod learns the client went away."""

    __slots__ = ("_closed", "_connection", "_pod", "_pool", "headers", "status")

    def __init__(self, pool: PodConnections, pod: str, connection: _Connection) -> None:
        self.status: int = connection.status
        self.headers = connection.headers
        self._pool, self._pod, self._connection = pool, pod, connection
        self._closed = False

    @property
    def sent_at(self) -> float:
        """``time.perf_counter()`` when the request was written to the pod."""
        return self._connection.sent_at

    @property
    def completed_at(self) -> float | None:
        """``time.perf_counter()`` when the answer's last byte arrived; None before."""
        connection = self._connection
        return connection.completed_at if connection.complete else None

    @property
    def whole(self) -> bool:
        """Whether the rest of the body is already read (nothing left to wait for)."""
        return self._connection.complete

    def take_body(self) -> bytes:
        """The body read so far, at once (all of it when :attr:`whole`)."""
        connection = self._connection
        pieces = connection.body
        body = pieces.popleft() if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        connection.taken(len(body))
        return body

    async def iter_body(self) -> AsyncIterator[bytes]:
        """The body as it arrives, one piece per network read."""
        connection = self._connection
        while True:
            if connection.body:
                yield self.take_body()
                continue
            if connection.complete:
                return
            if connection.failure is not None:
                raise PodBroken(f"{self._pod} {connection.failure}")
            if connection.lost:
                raise PodBroken(f"{self._pod} closed the connection mid-answer")
            try:
                await connection.wait()
            except TimeoutError:
                raise PodBroken(f"{self._pod} silent for {connection.read_timeout_s:g} s") from None

    def close(self) -> None:
        """Release the connection: back to the pool when the answer is whole and the pod
        keeps it alive, closed otherwise (mid-answer: the pod sees the client leave)."""
        if self._closed:
            return
        self._closed = True
        connection = self._connection
        if connection.complete and connection.keep_alive and connection.usable():
            self._pool._put(self._pod, connection)
        else:
            connection.close()


class PodConnections:
    """Kept-alive HTTP/1.1 connections to each pod (``host:port``)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: dict[str, list[_Connection]] = {}

    async def send(
        self,
        pod: str,
        path: str,
        headers: Iterable[Header],
        body: bytes,
        method: bytes = b"POST",
        first_byte_timeout_s: float | None = None,
    ) -> PodResponse:
        """``method`` ``body`` to ``http://{pod}{path}`` with ``headers`` (lower-case
        names, no host or content-length); returns once the answer's headers are in.
        ``first_byte_timeout_s``: a pod silent that long before its status line is
        PodUnreachable (``timed_out``: the request may go elsewhere), not PodBroken.

        PodUnreachable (refused, timed out while connecting, closed without a status line)
        is the only case in which the request may go to another pod; a kept-alive
        connection the pod closed while idle is retried once on a fresh one first."""
        target = (path.encode("latin-1"), pod.encode("latin-1"))
        parts = [method, b" ", target[0], b" HTTP/1.1\r\nhost: ", target[1]]
        parts += (b"\r\ncontent-length: ", b"%d" % len(body), b"\r\n")
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (b"\r\n", body)
        request = b"".join(parts)
        connection = self._take(pod)
        stale: PodUnreachable | None = None
        if connection is not None:
            try:
                return await self._exchange(pod, connection, request, first_byte_timeout_s)
            except PodUnreachable as exc:  # closed while idle? once more, on a fresh one
                stale = exc
        try:
            connection = await self._connect(pod)
            return await self._exchange(pod, connection, request, first_byte_timeout_s)
        except PodUnreachable as exc:
            exc.delivered = exc.delivered or (stale is not None and stale.delivered)
            raise

    async def _exchange(
        self, pod: str, connection: _Connection, request: bytes, first_byte_s: float | None
    ) -> PodResponse:
        connection.begin()
        if first_byte_s is not None:  # until the status line: the shorter wait
            connection.read_timeout_s = min(first_byte_s, self.read_timeout_s)
        transport = connection.transport
        assert transport is not None
        try:
            try:
                transport.write(request)
            except (OSError, RuntimeError) as exc:  # closed under us while idle
                raise PodUnreachable(f"{pod}: {exc}", delivered=False) from None
            connection.sent_at = time.perf_counter()
            while not connection.headers_done:
                if connection.failure is not None:
                    raise PodBroken(f"{pod}: {connection.failure}")
                if connection.lost:  # the pod may have read the request before it closed
                    raise PodUnreachable(
                        f"{pod} closed the connection without answering", delivered=True
                    )
                await connection.wait()
        except TimeoutError:
            connection.close()
            silent = connection.read_timeout_s
            if first_byte_s is not None and silent < self.read_timeout_s:
                raise PodUnreachable(
                    f"{pod}: no answer within {silent:g} s", delivered=True, timed_out=True
                ) from None
            raise PodBroken(f"{pod} silent for {silent:g} s") from None
        except (PodUnreachable, PodBroken):
            connection.close()
            raise
        except BaseException:  # cancelled (the client left): the connection is unusable
            connection.close()
            raise
        connection.read_timeout_s = self.read_timeout_s
        return PodResponse(self, pod, connection)

    async def _connect(self, pod: str) -> _Connection:
        host, _, port = pod.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop, self.read_timeout_s), host.strip("[]"), int(port)
                ),
                self.connect_timeout_s,
            )
        except TimeoutError:
            raise PodUnreachable(
                f"{pod}: no connection within {self.connect_timeout_s:g} s",
                delivered=False,
                timed_out=True,
            ) from None
        except (OSError, ValueError) as exc:
            raise PodUnreachable(f"{pod}: {exc}", delivered=False) from None
        return connection

    def _take(self, pod: str) -> _Connection | None:
        idle = self._idle.get(pod)
        while idle:
            connection = idle.pop()
            if connection.usable():
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


def _delimited_by_close(headers: list[Header]) -> bool:
    """A body with neither a length nor chunked framing ends when the connection does."""
    names = {name for name, _ in headers}
    chunked = any(
        name == b"transfer-encoding" and b"chunked" in value.lower() for name, value in headers
    )
    return b"content-length" not in names and not chunked

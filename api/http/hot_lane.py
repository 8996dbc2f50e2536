"""``kvindex serve``'s lane for ``/score``, ``/route`` and ``/route/{id}/done``: answered
from uvicorn's HTTP protocol callbacks, without the ASGI layer.

Why: with the handlers free of FastAPI (``api/http/hot_path.py``), ASGI itself (a task per
request, its scope and messages, a deadline timer, two writes per answer) was a large
part of a ``/score``'s CPU (bench/README.md, "api/: the figures behind its design").
Here the body is collected in the parser's callbacks and, over the memory backend,
answered before the callback returns, in one write; over Redis the index work is awaited
in a task (:class:`kvindex.api.http.offload.IndexWork`). Only POSTs to those paths take the
lane (another method's 405 comes from :class:`kvindex.api.http.hot_path.HotPath`). The lane
keeps what ASGI gave: :class:`kvindex.api.http.limits.RequestLimits` (one in-flight count for
both paths), the header deadline, uvicorn's answer head, keep-alive, ``Expect:
100-continue``, chunked bodies, graceful shutdown, and answers in request order.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections import deque
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from kvindex.api.http.asgi import Headers
from kvindex.api.http.errors import error_body, status_of
from kvindex.api.http.header_deadline import HeaderDeadlineProtocol
from kvindex.api.http.hot_path import Answer, HotRoutes, Posted, Route
from kvindex.api.http.limits import CLOSE, RequestLimits, content_length
from kvindex.api.http.score_inputs import body_media
from kvindex.events.errors import KvindexError

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_JSON_HEAD = b"content-type: application/json\r\ncontent-length: "


@dataclass(frozen=True, slots=True)
class HotLane:
    """What the lane answers with: the handlers, and the limits (the same object that
    wraps the ASGI app, so both paths share one in-flight count)."""

    routes: HotRoutes
    limits: RequestLimits


class _Request:
    """A lane request from its headers to its answer."""

    __slots__ = (
        "answer", "argument", "chunks", "counted", "expects_continue", "keep_alive", "media",
        "path", "query", "queued", "route", "size", "timer",
    )  # fmt: skip

    def __init__(self, route: Route, path: str, argument: str, query: bytes, keep_alive: bool):
        self.route = route
        self.path = path
        self.argument = argument
        self.query = query
        self.keep_alive = keep_alive
        self.media = ""
        self.chunks: list[bytes] = []
        self.size = 0
        self.answer: Answer | None = None  # decided before the body was whole (a refusal)
        self.queued = False  # handed on: answered, or waiting for its turn
        self.counted = False  # in the limits' in-flight count
        self.timer: asyncio.TimerHandle | None = None  # the body deadline, once armed
        self.expects_continue = False

    def posted(self) -> Posted:
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        return Posted(self.path, self.media, self.query, body, self.argument)


# uvicorn replaces its default headers (server, date) once a second; their bytes are
# joined once per list, not per answer.
_defaults: list[Any] = [None, b""]


def _default_head(headers: list[tuple[bytes, bytes]]) -> bytes:
    if _defaults[0] is not headers:
        _defaults[:] = [headers, b"".join(b"%s: %s\r\n" % pair for pair in headers)]
    return _defaults[1]


class HotLaneProtocol(HeaderDeadlineProtocol):
    """uvicorn's httptools protocol (with the header deadline) serving the lane itself.
    ``lane`` is set on a subclass by :func:`lane_protocol`."""

    lane: ClassVar[HotLane]

    _hot: _Request | None = None  # the lane request whose body is being read
    _task: asyncio.Task[None] | None = None  # an answer being awaited (index work)
    _turns: deque[Any] | None = None  # lane requests and ASGI cycles waiting, in order
    _closing = False  # the server is shutting down: close after the answer in progress

    # -- the parser's callbacks ----------------------------------------------------------

    def on_headers_complete(self) -> None:
        if self.parser.get_method() == b"POST" and not self.parser.should_upgrade():
            found = self._match()
            if found is not None:
                self.headers_fit()  # else a 431, and the connection is closed
                self._disarm()  # the header deadline
                self._begin(*found)
                return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        req = self._hot
        if req is None:
            super().on_body(body)
            return
        if req.answer is not None:
            return  # refused already: the rest of its body is not read
        req.chunks.append(body)
        req.size += len(body)
        too_large = self.lane.limits.body_too_large(req.size)
        if too_large is not None:
            self._refuse(req, too_large, CLOSE)

    def on_message_complete(self) -> None:
        req = self._hot
        if req is None:
            super().on_message_complete()
            return
        self._hot = None
        if req.timer is not None:
            req.timer.cancel()
        if not req.queued:
            self._dispatch(req)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        req = self._hot
        if req is not None and req.timer is None:
            # The body did not come whole with its headers: from now on it has a deadline
            # (also while a refused request's body is skipped). Armed here, not for every
            # request: most bodies come whole with their headers.
            limits = self.lane.limits
            req.timer = self.loop.call_later(limits.body_timeout_s, self._too_slow_body, req)

    # -- a lane request ------------------------------------------------------------------

    def _match(self) -> tuple[Route, str, str, bytes] | None:
        """The lane route of this request, its path, path parameter and query."""
        url = self.url
        if url == b"/score" or url == b"/route":  # the usual request: nothing to parse
            path, query = url.decode("ascii"), b""
        else:
            try:
                parsed = httptools.parse_url(url)
                path = parsed.path.decode("ascii")
            except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
                return None  # uvicorn answers it as it always has
            if "%" in path:
                path = urllib.parse.unquote(path)
            query = parsed.query or b""
        path = self.root_path + path
        found = self.lane.routes.match(path)
        if found is None:
            return None
        route, argument = found
        return route, path, argument, query

    def _begin(self, route: Route, path: str, argument: str, query: bytes) -> None:
        """The headers are in: admit the request (or refuse it), and read its body."""
        self._unset_keepalive_if_required()  # armed after an answer earlier in this read
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        req = self._hot = _Request(route, path, argument, query, keep_alive)
        declared_type, declared_length = None, None
        for name, value in self.headers:
            if name == b"content-type":
                declared_type = value.decode("latin-1")
            elif name == b"content-length":
                declared_length = content_length(value)
        limits = self.lane.limits
        refused = limits.admission(path, declared_length)
        if refused is not None:
            self._refuse(req, refused, CLOSE)
            return
        limits.in_flight += 1
        req.counted = True
        try:
            req.media = body_media(declared_type)
        except KvindexError as exc:  # 415, decided before the body is read
            self._refuse(req, exc, ())
            return
        if self.expect_100_continue:
            if self._busy():
                req.expects_continue = True  # sent when its turn comes (_next_turn)
            else:
                self.transport.write(_CONTINUE)

    def _refuse(self, req: _Request, exc: KvindexError, headers: Headers) -> None:
        """Answer ``req`` with ``exc`` before its body is whole (counted as the limits and
        the hot path count theirs); the rest of its body is skipped."""
        self.lane.routes.on_refusal(req.path, exc.code)
        req.answer = (status_of(exc), error_body(exc.code, exc.detail), headers)
        self._dispatch(req)

    def _too_slow_body(self, req: _Request) -> None:
        req.timer = None
        if self._hot is not req:
            return
        if req.answer is None:
            self._refuse(req, self.lane.limits.body_too_slow(), CLOSE)
        elif self._turns and req in self._turns:  # refused, its answer not sent yet
            req.keep_alive = False
        else:  # refused and answered, and the body it is still skipping never ends
            self.transport.close()

    def _dispatch(self, req: _Request) -> None:
        """Answer ``req`` now, or queue it behind what its connection is answering."""
        req.queued = True
        if self._busy():
            self._queue(req)
        else:
            self._run(req)

    def _run(self, req: _Request) -> None:
        routes = self.lane.routes
        if req.answer is not None:
            self._send(req, req.answer)
        elif routes.inline and (answer := routes.answer(req.route, req.posted())) is not None:
            self._send(req, answer)
        else:  # awaited: not inline, or passed on (None: a serving worker's relay)
            self._task = task = self.loop.create_task(self._awaited(req))
            self.tasks.add(task)  # uvicorn's graceful shutdown waits for these
            task.add_done_callback(self.tasks.discard)

    async def _awaited(self, req: _Request) -> None:
        try:
            answer = await self.lane.routes.answer_async(req.route, req.posted())
        except BaseException:  # cancelled: the server is going away without it
            self._release(req)
            raise
        finally:
            self._task = None
        self._send(req, answer)
        self._next_turn()

    def _release(self, req: _Request) -> None:
        """``req`` no longer counts in flight (answered, or its connection gone)."""
        if req.counted:
            req.counted = False
            self.lane.limits.in_flight -= 1

    def _send(self, req: _Request, answer: Answer) -> None:
        """Write ``answer`` as uvicorn would (its default headers first), in one write."""
        self._release(req)
        if self.transport.is_closing():
            return
        status, body, headers = answer
        parts = [
            STATUS_LINE[status],
            _default_head(self.server_state.default_headers),
            _JSON_HEAD,
            b"%d\r\n" % len(body),
        ]
        said_close = False
        for name, value in headers:
            parts.append(b"%s: %s\r\n" % (name, value))
            said_close = said_close or (name == b"connection" and value == b"close")
        close = said_close or not req.keep_alive or self._closing
        if close and not said_close:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        parts.append(body)
        self.transport.write(b"".join(parts))
        self.server_state.total_requests += 1
        if close:
            self.transport.close()
        elif self._hot is None and not self._turns:
            self._idle()

    def _idle(self) -> None:
        """Nothing left to answer: uvicorn's keep-alive timeout runs from now."""
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    # -- turns: answers leave in request order -------------------------------------------

    def _busy(self) -> bool:
        """Whether an earlier request on this connection has not been answered yet."""
        cycle = self.cycle
        return (
            self._task is not None
            or bool(self._turns)
            or (cycle is not None and not cycle.response_complete)
        )

    def _queue(self, entry: Any) -> None:
        """Wait ``entry`` (a lane request or an ASGI cycle) behind the answers pending on
        this connection, in one queue with uvicorn's, and stop reading meanwhile."""
        if self._turns is None:
            self._turns = deque()
        if self.pipeline:  # ASGI requests uvicorn queued before this one go first
            while self.pipeline:
                self._turns.append(self.pipeline.pop())
        self._turns.append(entry)
        self.flow.pause_reading()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        # uvicorn starts an ASGI request here (at once, or its turn in uvicorn's own
        # pipeline); while lane answers are pending before it, it waits its turn.
        if self._task is not None or self._turns:
            self._queue((cycle, app))
            return
        self._unset_keepalive_if_required()  # armed after a lane answer earlier in this read
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # an ASGI answer: uvicorn starts its next one
        if self._turns and not self.transport.is_closing():
            self._next_turn()

    def _next_turn(self) -> None:
        """Run what waits, in order, until something is in progress again. (Called when
        nothing is: no awaited answer, no ASGI request running.)"""
        turns = self._turns
        while turns and self._task is None and not self.transport.is_closing():
            self._unset_keepalive_if_required()
            entry = turns.popleft()
            if isinstance(entry, _Request):
                self._run(entry)
            else:  # an ASGI request: on_response_complete comes back here when it is done
                super()._start_asgi_task(*entry)
                return
        if not turns and self._task is None:
            self.flow.resume_reading()
            hot = self._hot
            if hot is not None and hot.expects_continue:
                hot.expects_continue = False
                self.transport.write(_CONTINUE)

    # -- the connection ------------------------------------------------------------------

    def connection_lost(self, exc: Exception | None) -> None:
        for req in (self._hot, *(self._turns or ())):
            if isinstance(req, _Request):
                if req.timer is not None:
                    req.timer.cancel()
                self._release(req)
        self._hot = None
        if self._turns:
            self._turns.clear()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self._task is not None or self._turns:
            self._closing = True  # the answer in progress is the last one
            if self.cycle is not None:
                self.cycle.keep_alive = False
            return
        super().shutdown()

    def resume_writing(self) -> None:
        super().resume_writing()
        if not self._turns and self._task is None:
            self.flow.resume_reading()


def lane_protocol(base: type[HeaderDeadlineProtocol], lane: HotLane) -> type[HotLaneProtocol]:
    """The protocol class ``kvindex serve`` gives uvicorn: ``base``'s header limits, and
    the lane answering with ``lane``."""
    return type("HotLaneProtocol", (HotLaneProtocol, base), {"lane": lane})

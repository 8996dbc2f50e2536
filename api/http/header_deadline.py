"""uvicorn's httptools protocol with a deadline and a size cap on request headers.

uvicorn (0.54) bounds idle keep-alive connections, not a client that sends its request line
and headers slowly or never: every such connection is held forever.
:class:`HeaderDeadlineProtocol` closes a connection whose headers are not complete
``header_timeout_s`` after it opened (or after the request began), and one whose
headers grow past ``max_header_bytes`` (with a 431). The deadline is armed, and the
size checked, only when a request's headers did not come whole in the read that began
them; headers that did are checked once, when complete. A keep-alive client under load
sends each request in one piece, and a timer or a Python override per request would
cost every ``/score`` (bench/README.md, "api/: the figures behind its design").
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """The deadline and the cap; :func:`header_deadline_protocol` sets their values."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 65_536

    _header_timer: asyncio.TimerHandle | None = None
    _in_headers = False  # a request has begun and its headers are not complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # a client that connects and says nothing

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_headers and not self.transport.is_closing() and self.headers_fit():
            self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True

    def on_headers_complete(self) -> None:
        self.headers_fit()
        self._disarm()
        super().on_headers_complete()

    def headers_fit(self) -> bool:
        """Whether the request line and headers so far fit ``max_header_bytes``; if not,
        the 431 is sent and the connection closed (what the parser still calls back
        for then is answered into a closed transport: nothing more is sent)."""
        size = len(self.url)
        for name, value in self.headers:
            size += len(name) + len(value)
        if size <= self.max_header_bytes:
            return True
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-length: 0\r\nconnection: close\r\n\r\n"
            )
            self.transport.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        """The headers are complete (or the connection is gone): no deadline."""
        self._in_headers = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            log.debug(
                "closing %s: request headers not complete in %ss",
                self.client,
                self.header_timeout_s,
            )
            self.transport.close()


def header_deadline_protocol(
    header_timeout_s: float, max_header_bytes: int = 65_536
) -> type[HeaderDeadlineProtocol]:
    """:class:`HeaderDeadlineProtocol` with these limits."""
    return type(
        "HeaderDeadlineProtocol",
        (HeaderDeadlineProtocol,),
        {"header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes},
    )

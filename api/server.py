"""Run the app under uvicorn with the limits uvicorn itself does not have.

uvicorn (0.54) bounds idle keep-alive connections but not a client that connects and
sends its request line and headers slowly or never: every such connection is held
forever. :func:`header_deadline_protocol` closes a connection whose headers are not
complete ``header_timeout_s`` after it opened (or after the request began), and one
whose headers grow past ``max_header_bytes``. The body's pace and size are bounded by
:class:`kvindex.api.limits.RequestLimits`.

The listening socket is bound here, before uvicorn starts, so a port in use is one
clear error instead of uvicorn's log line and exit.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


class ListenError(OSError):
    """The HTTP address cannot be bound (in use, not local, no permission)."""


def header_deadline_protocol(
    header_timeout_s: float, max_header_bytes: int = 65_536
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline and a size cap on request headers."""

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0
            self._arm()

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value))
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > max_header_bytes and not self.transport.is_closing():
                self.transport.write(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                    b"content-length: 0\r\nconnection: close\r\n\r\n"
                )
                self.transport.close()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                log.debug(
                    "closing %s: request headers not complete in %ss", self.client, header_timeout_s
                )
                self.transport.close()

    return HeaderDeadlineProtocol


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or ListenError saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def serve(
    app: Any,
    sock: socket.socket,
    *,
    header_timeout_s: float,
    keep_alive_timeout_s: float,
) -> None:
    """Serve ``app`` on an already bound socket until SIGINT/SIGTERM."""
    config = uvicorn.Config(
        app,
        http=header_deadline_protocol(header_timeout_s),
        timeout_keep_alive=int(max(1, keep_alive_timeout_s)),
        log_config=None,
        access_log=False,
    )
    uvicorn.Server(config).run(sockets=[sock])

"""``kvindex serve``'s HTTP server (uvicorn with the lane of ``api/http/hot_lane.py``) in a
thread of the test process, and a raw HTTP/1.1 client for it: the lane tests send bytes
the way clients do (pipelined, chunked, HTTP/1.0, ``Expect``) and read answers as bytes.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvindex.api.http.app import create_http
from kvindex.api.http.server import bind, server
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from kvindex.events.ingest.testing import wait_until


@dataclass
class Served:
    port: int
    service: Service

    def connect(self, timeout_s: float = 10.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s)


@contextmanager
def serving(*, lane: bool = True, keep_alive_s: float = 5.0, **flags: object) -> Iterator[Served]:
    """A Service from ``flags`` served as ``kvindex serve`` serves it (``lane=False``:
    without the lane, every path through the ASGI app)."""
    service = Service(from_flags(**flags))
    http = create_http(service, manage_lifecycle=False)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    uv = server(
        http.app,
        header_timeout_s=service.settings.http.header_timeout,
        keep_alive_timeout_s=keep_alive_s,
        drain_timeout_s=service.settings.http.drain_timeout,
        lane=http.lane if lane else None,
    )
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: uv.started, 10.0), "uvicorn did not start"
        yield Served(port, service)
    finally:
        uv.should_exit = True
        thread.join(timeout=10.0)
        sock.close()
        service.stop()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # names lower-cased
    head: bytes  # the status line and headers as sent
    body: bytes


def read_answer(sock: socket.socket, buffer: bytearray, timeout_s: float = 10.0) -> Answer:
    """The next answer on ``sock`` (``buffer`` keeps what came after it); every answer
    kvindex gives has a Content-Length. Bounded by ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while b"\r\n\r\n" not in buffer:
        _fill(sock, buffer, deadline)
    end = buffer.index(b"\r\n\r\n")
    head = bytes(buffer[:end])
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    status = int(lines[0].split()[1])
    length = 0 if status in (100, 204, 304) else int(headers["content-length"])
    while len(buffer) < end + 4 + length:
        _fill(sock, buffer, deadline)
    body = bytes(buffer[end + 4 : end + 4 + length])
    del buffer[: end + 4 + length]
    return Answer(status, headers, head, body)


def closed_by_server(sock: socket.socket, buffer: bytearray, timeout_s: float = 10.0) -> bool:
    """Whether the server closes ``sock`` (nothing more than ``buffer`` comes) within
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        if not data:
            return True
        buffer += data
    return False


def _fill(sock: socket.socket, buffer: bytearray, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError(f"no whole answer in time; got {bytes(buffer[:300])!r}")
    sock.settimeout(remaining)
    data = sock.recv(65536)
    if not data:
        raise ConnectionError(f"closed by the server; got {bytes(buffer[:300])!r}")
    buffer += data


def post(path: str, body: bytes, *extra: str, content_type: str = "application/json") -> bytes:
    """A POST request's bytes with a Content-Length; ``extra`` header lines added."""
    lines = [f"POST {path} HTTP/1.1", "Host: x", f"Content-Type: {content_type}", *extra]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def get(path: str, *extra: str) -> bytes:
    return ("\r\n".join([f"GET {path} HTTP/1.1", "Host: x", *extra]) + "\r\n\r\n").encode()

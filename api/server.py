"""Run the app under uvicorn with the limits uvicorn itself does not have, and the lane
for the hot paths.

The protocol uvicorn runs is its httptools one with a header deadline and size cap
(:mod:`kvindex.api.header_deadline`); the body's pace and size are bounded by
:class:`kvindex.api.limits.RequestLimits`. ``kvindex serve`` also passes a
:class:`kvindex.api.hot_lane.HotLane`: ``/score``, ``/route`` and ``/route/{id}/done``
are then answered by the protocol itself, without ASGI (``api/hot_lane.py`` says why).

The listening socket is bound here, before uvicorn starts, so a port in use is one
clear error instead of uvicorn's log line and exit.

Before serving, everything alive (modules, classes, the app, the composed service: some
95,000 objects the garbage collector tracks) is moved out of the collector's sight
(``gc.freeze``): every full collection otherwise walks them all with the GIL held, and
every request waits for it. In-process over ``bench_score_cpu.py``'s service a full
collection took 30-55 ms of CPU, 0.2 ms frozen; in ``kvindex serve`` under 270-290k
blocks/s of fresh-key ingest, where one comes every 10-30 s, 47-102 ms against 18-43 ms
frozen (wall clock, load average 10-13). None of what is frozen becomes garbage while
serving.

The interpreter's switch interval drops from 5 ms to :data:`SWITCH_INTERVAL_S`. Requests
are answered on the event loop's thread while other threads run Python: the load
scraper's (httpx, 16 threads, every pod once a second), the event applier. A thread
that holds the GIL keeps it until it blocks or the interval ends, so a request that
arrives meanwhile waited up to 5 ms. Beside Dynamo (`bench/compare_peers.py`, 64 pods
scraped, 3 runs each, 2026-12-02) one client's `/score` by hash had p99 0.32-0.67 ms
with 5 ms, 0.17-0.26 ms with 0.5 ms, 0.17-0.21 ms with scraping off; in-process ingest
(`bench_ingest.py`) showed no difference beyond its run-to-run spread.
"""

from __future__ import annotations

import gc
import socket
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from kvindex.api.header_deadline import header_deadline_protocol
from kvindex.api.hot_lane import HotLane, lane_protocol

#: How long a thread may hold the GIL while another waits for it (Python's default 5 ms).
SWITCH_INTERVAL_S = 0.0005


class ListenError(OSError):
    """The HTTP address cannot be bound (in use, not local, no permission)."""


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """The listening socket, or ListenError saying why not. With ``reuse_port``, other
    processes may listen on the same address too (``--processes``: the kernel spreads
    the connections over them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, telling ``on_exit_signal`` the moment SIGINT/SIGTERM arrives:
    its graceful shutdown (connections drained, the lifespan's final snapshot) can take
    seconds, and what runs beside it (the serving workers' supervisor) must know at once
    that processes exiting now are part of the shutdown, not failures."""

    def __init__(self, config: uvicorn.Config, on_exit_signal: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_exit_signal = on_exit_signal

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._on_exit_signal is not None:
            self._on_exit_signal()
        super().handle_exit(sig, frame)


def server(
    app: Any,
    *,
    header_timeout_s: float,
    keep_alive_timeout_s: float,
    lane: HotLane | None = None,
    on_exit_signal: Callable[[], None] | None = None,
) -> uvicorn.Server:
    """The uvicorn server for ``app`` (not started), with ``lane`` answering the hot paths
    when given, and ``on_exit_signal`` called when a shutdown signal arrives."""
    protocol: type = header_deadline_protocol(header_timeout_s)
    if lane is not None:
        protocol = lane_protocol(protocol, lane)
    config = uvicorn.Config(
        app,
        http=protocol,
        timeout_keep_alive=int(max(1, keep_alive_timeout_s)),
        log_config=None,
        access_log=False,
    )
    return _Server(config, on_exit_signal)


def serve(
    app: Any,
    sock: socket.socket | list[socket.socket],
    *,
    header_timeout_s: float,
    keep_alive_timeout_s: float,
    lane: HotLane | None = None,
    on_exit_signal: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve ``app`` on already bound sockets until SIGINT/SIGTERM (``on_exit_signal``
    is called as one arrives) or ``stop`` is set (the same graceful shutdown)."""
    gc.collect()  # what startup left behind, then the rest is never walked again
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the loop waits at most this for the GIL
    running = server(
        app,
        header_timeout_s=header_timeout_s,
        keep_alive_timeout_s=keep_alive_timeout_s,
        lane=lane,
        on_exit_signal=on_exit_signal,
    )
    if stop is not None:

        def stop_when_set() -> None:
            stop.wait()
            running.should_exit = True  # uvicorn's main loop reads it every 0.1 s

        threading.Thread(target=stop_when_set, name="kvindex-stop", daemon=True).start()
    running.run(sockets=sock if isinstance(sock, list) else [sock])

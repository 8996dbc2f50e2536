"""Run the app under uvicorn with the limits uvicorn itself does not have, and the lane
for the hot paths.

uvicorn runs its httptools protocol with a header deadline and size cap
(:mod:`kvindex.api.http.header_deadline`); :class:`kvindex.api.http.limits.RequestLimits` bounds
the body. ``kvindex serve`` also passes a :class:`kvindex.api.http.hot_lane.HotLane`, which
answers ``/score`` and ``/route`` inside the protocol. The socket is bound here, before
uvicorn starts, so a port in use is one clear error. Before serving, everything alive is
frozen out of the garbage collector's sight (``gc.freeze``: none of it becomes garbage
while serving, and a full collection would walk it all with the GIL held while requests
wait), and the switch interval drops to :data:`SWITCH_INTERVAL_S`, so the loop's thread
waits less for the GIL held by the load scraper's or the applier's threads
(bench/README.md, "api/: the figures behind its design").
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from kvindex.api.http.header_deadline import header_deadline_protocol
from kvindex.api.http.hot_lane import HotLane, lane_protocol

#: How long a thread may hold the GIL while another waits for it (Python's default 5 ms).
SWITCH_INTERVAL_S = 0.0005

log = logging.getLogger(__name__)


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
    """uvicorn's server with a bounded drain.

    uvicorn's own shutdown closes the listener at once, then waits for every request
    without limit (a gateway request to a hung pod: up to its read timeout), and only
    then runs the lifespan's shutdown (the final snapshot, the leases released): under
    an orchestrator's grace period, SIGKILL came first. Here the first SIGINT/SIGTERM
    starts a drain instead: ``on_exit_signal`` is called (from the event loop, never in
    the signal handler: readiness fails, the snapshot is written, the serving workers
    are told), the listener stays open, so a probe sees the readiness fail and the
    requests a load balancer still sends are answered, until no request is in flight
    or ``drain_timeout_s`` has passed. Then uvicorn's shutdown runs with what is left
    of the bound and cancels what is still running. A second signal ends the drain at
    once (still waiting for requests in flight, within the bound); a third SIGINT stops
    waiting altogether (uvicorn's force exit)."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_exit_signal: Callable[[], None] | None,
        drain_timeout_s: float,
    ) -> None:
        super().__init__(config)
        self._on_exit_signal = on_exit_signal
        self._drain_timeout_s = drain_timeout_s
        self._drain_deadline: float | None = None
        self._drain_started = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_deadline is not None:
            super().handle_exit(sig, frame)
            return
        self._drain_deadline = time.monotonic() + self._drain_timeout_s
        self._captured_signals.append(sig)  # raised again once served, as uvicorn does

    def drain_and_stop(self) -> None:
        """Start the same drain as a signal, from any thread, and stop after it without
        raising a signal again (the caller chooses the exit status)."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self._drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None:
            if not self._drain_started:
                self._start_drain()
            if not self.should_exit:
                self.should_exit = self._drained(self._drain_deadline)
        return await super().on_tick(counter)

    def _start_drain(self) -> None:
        self._drain_started = True
        log.info(
            "shutting down: draining; %d request(s) in flight get up to %g s "
            "(--drain-timeout) to finish",
            len(self.server_state.tasks),
            self._drain_timeout_s,
        )
        if self._on_exit_signal is not None:
            self._on_exit_signal()

    def _drained(self, deadline: float) -> bool:
        """Whether the drain is over: nothing in flight, or the bound reached (then
        what is still in flight is about to be cut, and the log says how much)."""
        in_flight = len(self.server_state.tasks)
        if in_flight and time.monotonic() >= deadline:
            log.warning(
                "--drain-timeout %g s reached: cutting %d request(s) still in flight",
                self._drain_timeout_s,
                in_flight,
            )
        return not in_flight or time.monotonic() >= deadline

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn's wait for connections and requests gets what is left of the bound;
        # it cancels whatever still runs when that ends.
        deadline = self._drain_deadline
        if deadline is None:  # not a signal: the lifespan failed, or a test stops it
            deadline = time.monotonic() + self._drain_timeout_s
        self.config.timeout_graceful_shutdown = max(0.0, deadline - time.monotonic())  # type: ignore[assignment]
        logging.getLogger("uvicorn.error").addFilter(_no_cancelled_tracebacks)
        await super().shutdown(sockets)


def _no_cancelled_tracebacks(record: logging.LogRecord) -> bool:
    """Drop uvicorn's "Exception in ASGI application" for a request the drain cut (a
    CancelledError traceback per request): the drain's own line has counted them."""
    return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def server(
    app: Any,
    *,
    header_timeout_s: float,
    keep_alive_timeout_s: float,
    drain_timeout_s: float,
    lane: HotLane | None = None,
    on_exit_signal: Callable[[], None] | None = None,
) -> _Server:
    """The uvicorn server for ``app`` (not started), with ``lane`` answering the hot paths
    when given, and ``on_exit_signal`` called as a shutdown signal's drain starts (at
    most ``drain_timeout_s`` seconds: :class:`_Server`)."""
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
    return _Server(config, on_exit_signal, drain_timeout_s)


def serve(
    app: Any,
    sock: socket.socket | list[socket.socket],
    *,
    header_timeout_s: float,
    keep_alive_timeout_s: float,
    drain_timeout_s: float,
    lane: HotLane | None = None,
    on_exit_signal: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Serve ``app`` on already bound sockets until SIGINT/SIGTERM or ``stop`` is set,
    and the drain after it (``on_exit_signal`` is called as the drain starts). SIGTERM
    then ends the process with status 0, SIGINT with KeyboardInterrupt; after ``stop``
    this returns, and the caller chooses the exit status."""
    if threading.current_thread() is threading.main_thread():
        # uvicorn raises the signal again once it is done; SIGTERM's default action would
        # kill the process before any `finally` (the serving workers stopped, the shared
        # memory removed) and report the clean shutdown as death by signal.
        signal.signal(signal.SIGTERM, exit_cleanly)
    gc.collect()  # what startup left behind, then the rest is never walked again
    gc.freeze()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # the loop waits at most this for the GIL
    running = server(
        app,
        header_timeout_s=header_timeout_s,
        keep_alive_timeout_s=keep_alive_timeout_s,
        drain_timeout_s=drain_timeout_s,
        lane=lane,
        on_exit_signal=on_exit_signal,
    )
    if stop is not None:

        def stop_when_set() -> None:
            stop.wait()
            running.drain_and_stop()

        threading.Thread(target=stop_when_set, name="kvindex-stop", daemon=True).start()
    running.run(sockets=sock if isinstance(sock, list) else [sock])


def exit_cleanly(signum: int, frame: FrameType | None) -> None:
    """A SIGTERM handler: leave as a clean exit does (``finally`` blocks run, status 0)."""
    raise SystemExit(0)

"""The receiving end: every SUB socket, on one thread, and the cheap checks at the door.

ZMQ sockets are single-threaded, so one thread owns them all and multiplexes them with a
poller. Calls from other threads (bind, connect, disconnect - Kubernetes discovery makes
them while the service runs) are queued as commands and the thread is woken through an
inproc PAIR socket, so they take effect at once instead of at the next poll timeout.

Per message the receiver only reads the frames (with the sender's ``Peer-Address`` in
bind mode) and hands them to :class:`~kvindex.events.ingest.door.Door`, the checks at the door
that attribute a message to its stream or skip it; the arrivals of one poll round go to
``deliver`` together.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.door import Arrival, Door, Source
from kvindex.events.ingest.drain import Drain, drain
from kvindex.events.ingest.ratelog import RateLimitedLog
from kvindex.events.ingest.status import IngestHealth, ReasonCounts
from kvindex.events.wire.endpoints import (
    HARD_MESSAGE_CAP,
    PodEndpoint,
    bind_socket,
    prepare_socket,
)
from kvindex.events.wire.identity import StreamId, normalize_pod
from kvindex.events.wire.scanned import ScannedBatch

log = logging.getLogger(__name__)

#: Messages taken from one socket per poll round, so one busy socket cannot starve the
#: others or the command queue.
_DRAIN_PER_SOCKET = 256
#: What the compiled drain hands back (events/wire/_wire_scan_zmq.h): a group of messages, a
#: message left to msgspec, a badly framed message.
_GROUP, _SINGLE = 0, 1

_COMMAND_TIMEOUT_S = 10.0
_wake_ids = itertools.count()


class Receiver:
    """Owns the SUB sockets; hands attributed messages to ``deliver`` in batches.

    ``deliver`` is called on the receiver thread with every message of one poll round,
    in arrival order per socket. ``discovered`` is Kubernetes discovery's pods, when
    bind mode must accept only those.
    """

    def __init__(
        self,
        context: zmq.Context,
        config: SubscriberConfig,
        deliver: Callable[[list[Arrival]], None],
        errors: ReasonCounts,
        ratelog: RateLimitedLog,
        clock: Callable[[], float],
        discovered: KnownPods | None,
        reconnected: Callable[[str], None] | None,
        accepted: Callable[[str], None] | None,
        health: IngestHealth,
    ) -> None:
        self._ctx = context
        self._errors = errors
        self._ratelog = ratelog
        self._health = health
        self._reconnected = reconnected
        self._accepted = accepted
        self._config = config
        self._door = Door(config, errors, ratelog, clock, discovered)
        self._deliver = deliver
        self._sources: dict[zmq.Socket, Source] = {}
        # A monitor socket per SUB socket -> that SUB socket (connections come and go).
        self._monitors: dict[zmq.Socket, zmq.Socket] = {}
        self._poller = zmq.Poller()
        wake = f"inproc://kvindex-receiver-wake-{next(_wake_ids)}"
        self._wake_rx = context.socket(zmq.PAIR)
        self._wake_rx.bind(wake)
        self._wake_tx = context.socket(zmq.PAIR)
        self._wake_tx.connect(wake)
        self._poller.register(self._wake_rx, zmq.POLLIN)
        self._commands: list[tuple[Callable[[], Any], Future[Any]]] = []
        self._command_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False

    # -- commands (any thread) ----------------------------------------------------

    def bind(self, endpoint: str) -> str:
        """Bind a SUB socket every engine's PUB connects to; return the bound endpoint."""
        return self._call(lambda: self._bind(endpoint))

    def connect(self, target: PodEndpoint) -> None:
        """Subscribe to one engine's PUB endpoint (replacing its target if known)."""
        self._call(lambda: self._connect(target))

    def disconnect(self, endpoint: str) -> bool:
        """Close the SUB socket of a connect or bind endpoint; False if unknown."""
        return self._call(lambda: self._disconnect(endpoint))

    def disconnect_pod(self, pod: str) -> list[str]:
        """Close every connect-mode socket that belongs to ``pod``; return their endpoints."""
        return self._call(lambda: self._disconnect_pod(pod))

    def release_stream(self, sid: StreamId) -> None:
        """The stream is gone from the applier's table (any thread, never blocks)."""
        self._door.release(sid)

    def endpoints(self) -> list[PodEndpoint | str]:
        """Current sources: PodEndpoints (connect mode) and bound endpoints (bind mode)."""
        return self._call(lambda: [s.target or s.endpoint for s in self._sources.values()])

    def _call(self, fn: Callable[[], Any]) -> Any:
        with self._command_lock:
            if self._closed:
                raise RuntimeError("subscriber is stopped")
            thread = self._thread
            if thread is None or not thread.is_alive():
                return fn()  # no thread owns the sockets yet: run here
            future: Future[Any] = Future()
            self._commands.append((fn, future))
            self._wake_tx.send(b"")
        return future.result(timeout=_COMMAND_TIMEOUT_S)

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        with self._command_lock:
            if self._thread is not None:
                raise RuntimeError("receiver already started")
            # From here on the thread owns every socket (Thread.start is a memory barrier).
            self._thread = threading.Thread(target=self._run, name="kvindex-receiver", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread and close every socket; False if the thread did not end."""
        with self._command_lock:
            if self._closed:
                return True
            self._closed = True
            self._stopping = True
            thread = self._thread
            if thread is not None and thread.is_alive():
                self._wake_tx.send(b"")
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("receiver thread did not stop within %.1fs", timeout_s)
                return False
        else:
            self._close_sockets()
        self._wake_tx.close(linger=0)
        return True

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the receiver thread ------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                ready = dict(self._poller.poll(1000))
                arrivals: list[Arrival] = []
                for sock in ready:  # reconnects first: before the new engine's messages
                    watched = self._monitors.get(sock)
                    if watched is not None:
                        self._watch(sock, watched)
                for sock in ready:
                    source = self._sources.get(sock)
                    if source is not None:
                        self._drain(sock, source, arrivals)
                if arrivals:
                    self._deliver(arrivals)
                if self._wake_rx in ready:
                    self._run_commands()
        except BaseException as exc:
            log.exception("receiver thread failed; no more KV events will be received")
            self._health.failed(f"receiver thread failed: {exc!r}")
            raise
        finally:
            self._fail_pending_commands()
            self._close_sockets()

    def _run_commands(self) -> None:
        while True:
            try:
                self._wake_rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
        with self._command_lock:
            commands, self._commands = self._commands, []
        for fn, future in commands:
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _fail_pending_commands(self) -> None:
        with self._command_lock:
            commands, self._commands = self._commands, []
        for _, future in commands:
            future.set_exception(RuntimeError("subscriber is stopped"))

    def _close_sockets(self) -> None:
        for sock in list(self._sources):
            self._stop_monitor(sock)
            sock.close(linger=0)
        self._sources.clear()
        self._wake_rx.close(linger=0)

    def _new_sub(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self._config.receive_hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_CAP)
        return sock

    def _bind(self, endpoint: str) -> str:
        sock = self._new_sub()
        try:
            bound = bind_socket(sock, endpoint)
            sock.setsockopt(zmq.SUBSCRIBE, self._config.topic_filter.encode("utf-8"))
        except Exception:
            sock.close(linger=0)
            raise
        self._add(sock, Source(bound, None))
        if self._accepted is not None:
            self._monitor(sock, zmq.EVENT_ACCEPTED)
        log.info("KV events: bound %s (topic filter %r)", bound, self._config.topic_filter)
        return bound

    def _connect(self, target: PodEndpoint) -> None:
        if target.pod is not None:
            pod = normalize_pod(target.pod, self._config.default_serving_port)
            target = PodEndpoint(
                target.endpoint, pod, target.model, target.replay_endpoint, target.rank
            )
        for source in self._sources.values():
            if source.target is not None and source.endpoint == target.endpoint:
                source.target = target
                source.identities.clear()
                return
        sock = self._new_sub()
        try:
            prepare_socket(sock, target.endpoint)
            sock.connect(target.endpoint)
            # vLLM's default topic is "": take everything the engine publishes.
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        except Exception:
            sock.close(linger=0)
            raise
        self._add(sock, Source(target.endpoint, target))
        if self._reconnected is not None:
            self._monitor(sock, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        log.info("KV events: connected to %s (pod %s)", target.endpoint, target.pod or "from topic")

    def _monitor(self, sock: zmq.Socket, events: int) -> None:
        monitor = sock.get_monitor_socket(events)
        self._monitors[monitor] = sock
        self._poller.register(monitor, zmq.POLLIN)

    def _add(self, sock: zmq.Socket, source: Source) -> None:
        self._sources[sock] = source
        self._poller.register(sock, zmq.POLLIN)

    def _remove(self, sock: zmq.Socket) -> None:
        self._poller.unregister(sock)
        del self._sources[sock]
        self._stop_monitor(sock)
        sock.close(linger=0)

    def _stop_monitor(self, sock: zmq.Socket) -> None:
        for monitor in [m for m, watched in self._monitors.items() if watched is sock]:
            del self._monitors[monitor]
            self._poller.unregister(monitor)
            sock.disable_monitor()
            monitor.close(linger=0)

    def _watch(self, monitor: zmq.Socket, sock: zmq.Socket) -> None:
        """Connection events of a SUB socket. ZMQ (re)connects by itself, silently: the
        engine on the other end may be a new incarnation whose first batches went out
        before the subscription reached it (dropped at its PUB), and whose seqs may even
        continue the old ones. So the pods a new connection may belong to prove their
        position (``reconnected``) instead of reading ``live`` on a guess:

        * connect mode: a connect after a disconnect, for the socket's pod;
        * bind mode: an accepted connection, for the streams of its sender's host
          (several engines on one host all verify; a pod behind NAT, whose sender
          address is not its host, is verified only after a silence).
        """
        source = self._sources.get(sock)
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if source is None:
                continue
            kind = event["event"]
            if kind == zmq.EVENT_DISCONNECTED:
                source.dropped = True
            elif kind == zmq.EVENT_CONNECTED and source.dropped and self._reconnected:
                source.dropped = False
                target = source.target
                pods = {target.pod} if target is not None and target.pod else set(source.pods)
                log.info("KV events: reconnected to %s", source.endpoint)
                for pod in sorted(pods):
                    self._reconnected(pod)
            elif kind == zmq.EVENT_ACCEPTED and self._accepted is not None:
                host = _peer_host(event["value"])
                if host is not None:
                    self._accepted(host)

    def _disconnect(self, endpoint: str) -> bool:
        for sock, source in list(self._sources.items()):
            if source.endpoint == endpoint or (
                source.target is not None and source.target.endpoint == endpoint
            ):
                self._remove(sock)
                return True
        return False

    def _disconnect_pod(self, pod: str) -> list[str]:
        self._door.forget_pod(pod)
        removed = []
        for sock, source in list(self._sources.items()):
            target = source.target
            if target is None:
                continue
            if target.pod == pod or pod in source.pods:
                removed.append(source.endpoint)
                self._remove(sock)
        return removed

    # -- per message --------------------------------------------------------------

    def _drain(self, sock: zmq.Socket, source: Source, out: list[Arrival]) -> None:
        compiled = drain()
        if compiled is not None:
            self._drain_compiled(compiled, sock, source, out)
            return
        bind_mode = source.target is None
        peer: str | None = None
        recv = sock.recv
        admit = self._door.admit
        for _ in range(_DRAIN_PER_SOCKET):
            # Frames, not bytes: a Frame says whether more parts follow (recv_multipart
            # asks the socket, a getsockopt per part, which costs more than the copy)
            # and carries the sender's Peer-Address (bind mode).
            try:
                frame = recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if bind_mode:
                peer = _peer_address(frame)
            frames = [frame.bytes]
            while frame.more:  # ZMQ delivers a message whole: its other parts are here
                frame = recv(zmq.NOBLOCK, copy=False)
                frames.append(frame.bytes)
            try:
                arrival = admit(source, frames, peer)
            except Exception as exc:
                self._message_failed(source, exc)
                continue
            if arrival is not None:
                out.append(arrival)

    def _drain_compiled(
        self, compiled: Drain, sock: zmq.Socket, source: Source, out: list[Arrival]
    ) -> None:
        """The same, in one compiled call (:mod:`kvindex.events.ingest.drain`): consecutive
        messages of one sender come as one group."""
        door = self._door
        items = compiled(
            sock.underlying,
            _DRAIN_PER_SOCKET,
            self._config.max_payload_bytes,
            source.target is None,  # bind mode: the sender's address
            self._config.batches_per_turn,
        )
        for item in items:
            kind = item[0]
            try:
                if kind == _GROUP:
                    _, topic, peer, seq, payloads, scan = item
                    batch = ScannedBatch(payloads, scan)
                    arrival = door.admit_group(source, topic, peer, seq, batch)
                elif kind == _SINGLE:
                    arrival = door.admit(source, item[1], item[2])
                else:
                    door.refuse(source, item[1], item[2])
                    continue
            except Exception as exc:
                self._message_failed(source, exc)
                continue
            if arrival is not None:
                out.append(arrival)

    def _message_failed(self, source: Source, exc: Exception) -> None:
        """A message raised where no check expected it to: that message's error, never
        the thread's (one hostile sender must not stop every pod's ingestion). Counted
        and skipped; the seq gap it leaves is recovered like any other."""
        self._errors.add("internal_error")
        self._ratelog.error(
            "receiver_internal_error",
            "KV events: internal error on a message from %s, skipped: %r",
            source.endpoint,
            exc,
        )
        log.debug("internal error on a message from %s", source.endpoint, exc_info=True)


def _peer_host(fd: int) -> str | None:
    """The remote address of an accepted connection's file descriptor (a monitor event
    reports the fd, not the address). Read through a duplicate, so ZMQ's descriptor is
    never closed here; None when it is already gone."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        conn = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    try:
        address = conn.getpeername()
    except OSError:
        return None
    finally:
        conn.close()
    return address[0] if isinstance(address, tuple) else None


def _peer_address(frame: zmq.Frame) -> str | None:
    """The sender's IP address as ZMQ saw it (TCP); None for ipc/inproc."""
    try:
        return frame.get("Peer-Address") or None
    except zmq.ZMQError:
        return None

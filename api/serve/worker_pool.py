"""``kvindex serve --processes N``: the serving workers beside the process that ingests.

Why: one Python process answers ``/score`` on one core, and a ``/score`` needs nothing
but the index. So the index's tables go to shared memory
(:mod:`kvindex.indexer.memory.shared_index`) and ``N - 1`` workers
(:mod:`kvindex.api.serve.worker_process`)
listen on the same port (``SO_REUSEPORT``) and answer ``/score`` from them. This
process, the *primary*, keeps everything else (ingest, streams, ``/route``'s state,
metrics, operator endpoints); a worker relays every other request to it over a Unix
socket, and a ``/score`` too whenever the answer depends on state only the primary has.
Workers report their answered ``/score`` calls back, so ``/metrics`` is one page with
every process's requests in it. A worker that dies is started again; workers exit when
the primary goes away.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_derived import ConfigError
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.shared_index import FACTS_VERSION, SPECULATIVE_UNTIL, SharedIndexWriter

log = logging.getLogger(__name__)

FACTS_INTERVAL_S = 0.2
RESTART_DELAY_S = 1.0
_FRAME = struct.Struct("<I")


class Facts(msgspec.Struct, frozen=True):
    """What a worker's ``/score`` needs from the primary besides the tables."""

    models: list[str]
    warnings: dict[str, list[tuple[str, str]]]  # model -> (pod, text)
    layouts: dict[str, dict[int, tuple[str, int | None, int]]]  # model -> group -> spec
    states: dict[str, str] = {}  # pod or member -> stream state


def check_processes(processes: int, backend: str) -> None:
    """``--processes`` and ``--backend`` together, before anything starts (ConfigError)."""
    if processes < 1:
        raise ConfigError(f"--processes {processes}: must be at least 1")
    if processes > 1 and backend != "memory":
        raise ConfigError(
            "--processes above 1 needs the memory backend: with Redis, run more "
            "replicas instead (they share the index already)"
        )


def read_frames(buffer: bytearray) -> list[bytes]:
    """Whole length-prefixed frames from the front of ``buffer`` (removed from it)."""
    frames = []
    while len(buffer) >= _FRAME.size:
        (size,) = _FRAME.unpack_from(buffer)
        if len(buffer) < _FRAME.size + size:
            break
        frames.append(bytes(buffer[_FRAME.size : _FRAME.size + size]))
        del buffer[: _FRAME.size + size]
    return frames


def frame(payload: bytes) -> bytes:
    return _FRAME.pack(len(payload)) + payload


@dataclass
class _Worker:
    number: int
    process: subprocess.Popen[bytes] | None = None
    channel: socket.socket | None = None
    buffer: bytearray = field(default_factory=bytearray)
    restart_at: float = 0.0


class ServingWorkers:
    """The primary's side: shares ``service``'s index, starts ``count - 1`` workers on
    ``listen`` (HOST:PORT) and keeps them running until :meth:`stop`.

    Besides the tables, it publishes in the shared directory what a worker needs to
    answer as this process would: ``settings.json`` (its settings); ``facts`` (the known
    models, the warnings ``/score`` carries per pod, hybrid models' KV group layouts),
    rewritten when they change, checked every :data:`FACTS_INTERVAL_S`, reread by a
    worker when the control file's version moves; and the control file's
    ``SPECULATIVE_UNTIL``, the newest speculative entry's deadline, written as ``/route``
    adds it, so no worker answers without entries it cannot see."""

    def __init__(self, service: Service, count: int, listen: str) -> None:
        if not isinstance(service.backend, MemoryBackend):
            raise TypeError("serving workers share a memory backend (check_processes first)")
        self.service = service
        self.listen = listen
        self.writer = SharedIndexWriter(service.backend)
        self.directory = self.writer.directory
        self.socket_path = os.path.join(self.directory, "primary.sock")
        with open(os.path.join(self.directory, "settings.json"), "wb") as out:
            out.write(msgspec.json.encode(service.settings))
        control = self.writer.control
        self._until = control.floats[SPECULATIVE_UNTIL : SPECULATIVE_UNTIL + 1]
        service.speculative.on_add = self._speculative_until
        self._workers = [_Worker(n) for n in range(1, count)]
        self._facts: Facts | None = None
        self._stopping = threading.Event()
        self._shutting_down = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvindex-workers", daemon=True)

    def unix_socket(self) -> socket.socket:
        """The socket workers relay to (this process serves its app on it too)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.socket_path)
        sock.listen(1024)
        return sock

    def start(self) -> None:
        self._publish_facts()
        for worker in self._workers:
            self._spawn(worker)
        self._thread.start()
        log.info(
            "%d serving worker process(es) answer /score from the shared index in %s",
            len(self._workers),
            self.directory,
        )

    def shutting_down(self) -> None:
        """This process got its shutdown signal and drains: the workers drain beside it
        (SIGTERM now, within the same ``--drain-timeout``, not after this process's
        drain), and workers that exit now stay down."""
        self._shutting_down.set()
        for worker in self._workers:
            if worker.process is not None and worker.process.poll() is None:
                worker.process.terminate()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for worker in self._workers:
            if worker.process is not None and worker.process.poll() is None:
                worker.process.terminate()
        for worker in self._workers:
            if worker.process is not None:
                try:
                    worker.process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    worker.process.kill()
                    worker.process.wait()
            if worker.channel is not None:
                worker.channel.close()
        self.writer.close()

    # -- speculative entries and facts ------------------------------------------------

    def _speculative_until(self, deadline: float) -> None:
        if deadline > self._until[0]:
            self._until[0] = deadline

    def _publish_facts(self) -> None:
        service = self.service
        facts = Facts(
            service.known_models(),
            service.directory.all_warnings(),
            {
                model: {
                    g: (spec.kind, spec.sliding_window, spec.block_size)
                    for g, spec in groups.items()
                }
                for model, groups in service.ingestor.layouts.all().items()
            },
            service.directory.stream_states(),
        )
        if facts == self._facts:
            return
        path = os.path.join(self.directory, "facts")
        with open(path + ".tmp", "wb") as out:
            out.write(msgspec.msgpack.encode(facts))
        os.replace(path + ".tmp", path)
        self._facts = facts
        self.writer.control.words[FACTS_VERSION] += np.uint64(1)

    # -- the workers ----------------------------------------------------------------

    def _spawn(self, worker: _Worker) -> None:
        mine, theirs = socket.socketpair()
        command = [
            sys.executable,
            "-m",
            "kvindex.api.serve.worker_process",
            self.directory,
            self.listen,
            str(theirs.fileno()),
        ]
        worker.process = subprocess.Popen(command, pass_fds=(theirs.fileno(),))
        theirs.close()
        mine.setblocking(False)
        worker.channel, worker.buffer = mine, bytearray()

    def _run(self) -> None:
        """Reports in, facts out, dead workers started again: until :meth:`stop`."""
        next_facts = 0.0
        while not self._stopping.is_set():
            channels = {w.channel: w for w in self._workers if w.channel is not None}
            ready, _, _ = select.select(list(channels), [], [], FACTS_INTERVAL_S)
            for channel in ready:
                self._receive(channels[channel])
            now = time.monotonic()
            if now >= next_facts:
                next_facts = now + FACTS_INTERVAL_S
                try:
                    self._publish_facts()
                except Exception:  # a failing read must not stop the reports
                    log.exception("publishing facts for the serving workers failed")
            for worker in self._workers:
                self._supervise(worker, now)

    def _receive(self, worker: _Worker) -> None:
        assert worker.channel is not None
        try:
            data = worker.channel.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the worker is gone: _supervise starts another
            worker.channel.close()
            worker.channel = None
            return
        worker.buffer += data
        metrics = self.service.metrics
        for payload in read_frames(worker.buffer):
            for record in msgspec.msgpack.decode(payload):
                kind = record[0]
                if kind == "score":
                    metrics.count_score(*record[1:])
                elif kind == "rejected":
                    metrics.score_rejected(record[1])
                elif kind == "refused":
                    metrics.refused(record[1], record[2])

    def _supervise(self, worker: _Worker, now: float) -> None:
        """Start a dead worker again after :data:`RESTART_DELAY_S`, unless this process
        is shutting down by then. The wait is what tells the two apart: a signal to the
        process group (Ctrl-C, GNU ``timeout``) reaches the workers too, and one may exit
        before this process has seen its own signal."""
        process = worker.process
        if process is None or process.poll() is None:
            return
        if not worker.restart_at:
            worker.restart_at = now + RESTART_DELAY_S
        elif now >= worker.restart_at and not self._shutting_down.is_set():
            log.warning(
                "serving worker %d exited (code %s); starting another",
                worker.number,
                process.returncode,
            )
            worker.restart_at = 0.0
            if worker.channel is not None:
                worker.channel.close()
            self._spawn(worker)

"""``kvindex serve`` as a child process on loopback, for tests, benchmarks and the simulator.

Everything that checks the service from the outside needs the same three things: start
it with some flags on a free port, wait (bounded) until it answers, and stop it
(SIGTERM, then SIGKILL) without leaving it behind. Its output goes to a file, not a
pipe: a pipe nobody reads fills up and blocks the server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from kvindex.events.wire.endpoints import from_source
from kvindex.events.wire.publisher import EnginePublisher


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """One ``kvindex serve`` listening on ``127.0.0.1:<port>`` (``url``).

    ``flags`` follow ``--listen``; ``command`` replaces ``python -m kvindex.api.serve.cli serve``
    (e.g. an installed ``kvindex`` entry point, or a container's exact command line, with
    ``listen_flag=False`` when the listen address comes from ``KVINDEX_LISTEN``).
    """

    def __init__(
        self,
        *flags: str,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        command: Sequence[str] | None = None,
        listen_flag: bool = True,
        log_path: Path | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = list(command or [sys.executable, "-m", "kvindex.api.serve.cli", "serve"])
        if listen_flag:
            argv += ["--listen", f"127.0.0.1:{self.port}"]
        argv += flags
        if log_path is None:
            handle, name = tempfile.mkstemp(prefix="kvindex-serve-", suffix=".log")
            os.close(handle)
            log_path = Path(name)
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def answers(self, path: str = "/readyz") -> bool:
        """Whether ``GET path`` answers 200 right now."""
        try:
            # verify=False: plain HTTP on loopback, and no CA bundle loaded per poll (a
            # tenth of a second of CPU each, most of a start's cost on a busy machine).
            return httpx.get(f"{self.url}{path}", timeout=2.0, verify=False).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = 30.0, path: str = "/readyz") -> None:
        """Return once ``path`` answers 200; raise RuntimeError, with the log's tail, when
        the process exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while not self.answers(path):
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"kvindex serve exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"kvindex serve not ready after {timeout_s}s:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
        """Send ``sig`` (SIGKILL to simulate a crash) and wait; kill after ``timeout_s``."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def publisher_into(
    endpoint: str, pod: str, model: str, timeout_s: float = 10.0, **options: object
) -> EnginePublisher:
    """An engine publishing ``pod``'s KV events for ``model`` into the kvindex bound at
    ``endpoint``, sent from the pod's own host (bind mode checks the sender's address),
    returned once kvindex has subscribed. ``options`` go to :class:`EnginePublisher`."""
    host = pod.rpartition(":")[0]
    publisher = EnginePublisher(
        from_source(endpoint, host),
        topic=f"kv@{pod}@{model}",
        **options,  # type: ignore[arg-type]
    )
    if not publisher.wait_for_subscribers(1, timeout_s):
        publisher.close()
        raise AssertionError(f"kvindex at {endpoint} never subscribed to {pod}")
    return publisher


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Poll ``check`` every 50 ms until it holds (HTTP errors count as not yet), or fail
    with "timed out waiting for ``what``" after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")

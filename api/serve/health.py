"""Say when the index backend goes away and when it comes back: two log lines per outage.

The backend's callers (ingest, /score, leases) each handle its failures on their own
and count them, but an operator reading the log needs the outage itself: when it began,
why, when it ended and how long it lasted. A daemon thread pings the backend every
``interval_s`` and logs only the transitions, plus one line at startup when the backend
is already down. The in-memory backend never fails; the thread costs one ping a second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvindex.indexer.backend import BackendError, IndexBackend

log = logging.getLogger(__name__)


class BackendHealthLog:
    def __init__(
        self,
        backend: IndexBackend,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self._interval_s = interval_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.down_since: float | None = None
        self.outages = 0

    def start(self) -> None:
        problem = self.check()
        if problem is not None:
            log.warning("starting with the index backend unavailable: %s", problem)
        self._thread = threading.Thread(target=self._run, name="backend-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def check(self) -> str | None:
        """Ping once; log a transition; return the problem, or None when the backend answers."""
        try:
            self._backend.ping()
        except BackendError as exc:
            if self.down_since is None:
                self.down_since = self._clock()
                self.outages += 1
                if self._thread is not None:  # the startup line is logged by start()
                    log.warning("index backend unavailable: %s", exc)
            return str(exc)
        if self.down_since is not None:
            log.warning(
                "index backend available again after %.1f s", self._clock() - self.down_since
            )
            self.down_since = None
        return None

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check()
            except Exception:  # never let the watcher die; it only logs
                log.exception("backend health check failed")

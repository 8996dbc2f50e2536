"""Rate-limited logging for bad input.

A misbehaving pod can send thousands of bad frames a second; one log line per frame would
bury every other line and cost more than the frames. Each kind of problem (a key such as
``"bad_topic"``) logs at most once per interval, and the next line says how many were
suppressed in between. The counters, not the log, are the complete record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLog:
    """Logs each key at most once per ``interval_s``; thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def error(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.ERROR, key, msg, *args)

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        """Log ``msg % args`` unless ``key`` was logged less than ``interval_s`` ago."""
        now = self._clock()
        with self._lock:
            if now < self._next.get(key, float("-inf")):
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            self._next[key] = now + self._interval
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg = f"{msg} ({suppressed} similar messages suppressed)"
        self._logger.log(level, msg, *args)

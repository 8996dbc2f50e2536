"""A recording BatchSink and a bounded wait, for tests and the simulator.

Everything that consumes the subscriber in a test needs the same two things: a sink that
remembers what it was given (and can be told to fail, like a backend that is down), and
a way to wait for it that never hangs and never sleeps longer than needed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvindex.events.ingest.sink import Delivery
from kvindex.events.wire.identity import StreamId


class SinkDown(RuntimeError):
    """Raised by a :class:`RecordingSink` told to fail."""


@dataclass(frozen=True, slots=True)
class Reset:
    """A recorded ``reset`` call; ``index`` is the number of deliveries before it."""

    stream: StreamId
    reason: str
    index: int


class RecordingSink:
    """A thread-safe :class:`~kvindex.events.ingest.sink.BatchSink` that records every call.

    A delivery of several consecutive batches is recorded batch by batch
    (:meth:`Delivery.split`), so what a test reads does not depend on how the
    subscriber grouped them.

    ``failing = True`` makes ``deliver`` and ``reset`` raise :class:`SinkDown` (recording
    nothing), as a backend outage would.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.deliveries: list[Delivery] = []
        self.resets: list[Reset] = []
        self.failing = False
        self.failed_calls = 0
        # Every call in order: ("deliver", Delivery) or ("reset", Reset).
        self.log: list[tuple[str, Delivery | Reset]] = []

    def deliver(self, deliveries: Sequence[Delivery]) -> None:
        with self._cond:
            if self.failing:
                self.failed_calls += 1
                raise SinkDown("sink is down")
            for delivery in (one for d in deliveries for one in d.split()):
                self.deliveries.append(delivery)
                self.log.append(("deliver", delivery))
            self._cond.notify_all()

    def reset(self, stream: StreamId, reason: str) -> None:
        with self._cond:
            if self.failing:
                self.failed_calls += 1
                raise SinkDown("sink is down")
            reset = Reset(stream, reason, len(self.deliveries))
            self.resets.append(reset)
            self.log.append(("reset", reset))
            self._cond.notify_all()

    def seqs(self, stream: StreamId | None = None) -> list[int]:
        """Delivered seqs, of one stream or all."""
        with self._cond:
            return [d.seq for d in self.deliveries if stream is None or d.stream == stream]

    def wait_for(self, predicate: Callable[[RecordingSink], bool], timeout_s: float = 5.0) -> bool:
        """Wait until ``predicate(self)`` holds (checked after every call); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def wait_for_count(self, count: int, timeout_s: float = 5.0) -> bool:
        """Wait until at least ``count`` batches were delivered."""
        return self.wait_for(lambda s: len(s.deliveries) >= count, timeout_s)


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 5.0, poll_s: float = 0.005
) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; return its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)

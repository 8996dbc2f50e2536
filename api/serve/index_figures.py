"""The index's own figures for ``/metrics``, read so that a hung backend cannot hold a scrape.

Why: a scrape reads the index's totals and every member's block counts. With Redis that
is a few round trips, and with a Redis that accepts connections but never answers each
waits for the socket timeout: ``/metrics`` then took seconds, and a monitoring system
that times scrapes out loses every other series with them. So the read runs on a
thread of its own; a scrape waits for it at most ``wait_s`` and otherwise shows the
figures of the last read that finished (or none, when the backend never answered). At
most one read is in flight: scrapes during an outage do not pile threads up behind it.

Over the memory backend the read is a few dictionary walks and runs inline.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvindex.indexer.backend import BackendError, IndexBackend, IndexStats, MemberStats


@dataclass(frozen=True, slots=True)
class IndexFigures:
    """The index's totals and each member's block counts (members whose counts could
    not be read are left out)."""

    stats: IndexStats
    members: dict[str, MemberStats] = field(default_factory=dict)


def read_figures(backend: IndexBackend) -> IndexFigures | None:
    """The figures, or None when the backend does not answer for its totals."""
    try:
        stats = backend.stats()
    except BackendError:
        return None
    members: dict[str, MemberStats] = {}
    try:
        for member in sorted(backend.members()):
            found = backend.member_stats(member)
            if found is not None:
                members[member] = found
    except BackendError:  # the totals are still worth showing
        pass
    return IndexFigures(stats, members)


class LatestFigures:
    """``read()``'s latest finished result, waited for at most ``wait_s`` per call."""

    def __init__(
        self,
        read: Callable[[], IndexFigures | None],
        *,
        inline: bool,
        wait_s: float = 0.05,
    ) -> None:
        self._read = read
        self._inline = inline
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._latest: IndexFigures | None = None
        self._reading: threading.Event | None = None  # set when the read in flight ends

    def get(self) -> IndexFigures | None:
        if self._inline:
            return self._read()
        with self._lock:
            done = self._reading
            if done is None:
                done = self._reading = threading.Event()
                threading.Thread(
                    target=self._refresh, args=(done,), name="index-figures", daemon=True
                ).start()
        done.wait(self._wait_s)
        return self._latest

    def _refresh(self, done: threading.Event) -> None:
        try:
            self._latest = self._read()
        except Exception:  # a bug in a collector must not stop the next scrape's read
            self._latest = None
            raise
        finally:
            with self._lock:
                self._reading = None
            done.set()

"""The applier's stream table: which streams exist, and which may join or must leave.

A stream is opened by its first message, unless its pod was just forgotten (stragglers
of a deleted pod must not re-create its entries) or the table is full. A full table
makes room by evicting the least recently active *unpinned* stream (its pod neither
configured in connect mode nor discovered) that never delivered a batch or has been
silent ``stream_evict_idle_s`` (:func:`eviction_victim`, a pure function), so a
flood of made-up pods cannot lock a real one out for longer than that. Unpinned streams
silent for ``stream_idle_s`` are evicted too. The table only decides; the applier does
what a removal costs (the sink reset, the inbox lane, the door's cap).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

from kvindex.events.ingest.stream import COUNTERS, Stream
from kvindex.events.wire.identity import StreamId

#: How often idle streams are looked for.
_IDLE_SCAN_S = 1.0

K = TypeVar("K")


class EvictionFacts(Protocol):
    """What eviction needs to know about a stream."""

    @property
    def pinned(self) -> bool: ...

    @property
    def delivered(self) -> int: ...

    @property
    def last_active_at(self) -> float: ...


def idle_victims(streams: Iterable[tuple[K, EvictionFacts]], now: float, idle_s: float) -> list[K]:
    """Streams to evict for idling: not pinned (their pod is neither configured nor
    discovered) and silent for ``idle_s``. A pinned stream keeps its entries however
    long its engine is quiet."""
    return [k for k, s in streams if not s.pinned and now - s.last_active_at >= idle_s]


def eviction_victim(
    streams: Iterable[tuple[K, EvictionFacts]], now: float, min_idle_s: float
) -> K | None:
    """The stream that leaves a full table for a new one, or None (refuse the newcomer).

    Only unpinned streams are candidates: first those that never delivered a batch
    (unknown), then those silent for ``min_idle_s``; the least recently active of the
    first non-empty group. A flood of fake streams therefore cannot keep a real pod
    out for longer than ``min_idle_s``, and an active pod is never pushed out.
    """
    unknown: tuple[float, K] | None = None
    idle: tuple[float, K] | None = None
    for key, s in streams:
        if s.pinned:
            continue
        active = s.last_active_at
        if s.delivered == 0:
            if unknown is None or active < unknown[0]:
                unknown = (active, key)
        elif now - active >= min_idle_s and (idle is None or active < idle[0]):
            idle = (active, key)
    best = unknown or idle
    return None if best is None else best[1]


class StreamTable:
    """Every stream the applier tracks, by id, with the counters of removed ones.

    Written only on the applier thread. Other threads call only :meth:`snapshot` and
    :meth:`totals`; the lock gives them a consistent copy of the table (the streams
    themselves they only read). ``pod_known(pod)`` says whether a pod was discovered
    since its stream opened (asked only before evicting, so discovery is asked rarely).
    """

    def __init__(self, pod_known: Callable[[str], bool]) -> None:
        self._pod_known = pod_known
        self._lock = threading.Lock()
        self._streams: dict[StreamId, Stream] = {}
        self._retired = dict.fromkeys(COUNTERS, 0)  # counters of removed streams
        self._forgotten: dict[str, float] = {}  # pod -> messages ignored until then
        self._idle_scan_at = 0.0

    # -- any thread ----------------------------------------------------------------------

    def snapshot(self) -> list[Stream]:
        with self._lock:
            return list(self._streams.values())

    def totals(self) -> dict[str, int]:
        """Every counter summed over the streams, removed ones included."""
        with self._lock:
            totals = dict(self._retired)
            streams = list(self._streams.values())
        for stream in streams:
            for name in COUNTERS:
                totals[name] += getattr(stream, name)
        return totals

    # -- the applier thread --------------------------------------------------------------

    def get(self, sid: StreamId) -> Stream | None:
        return self._streams.get(sid)

    def __contains__(self, sid: object) -> bool:
        return sid in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def __iter__(self) -> Iterator[Stream]:
        return iter(self._streams.values())

    def add(self, stream: Stream) -> None:
        with self._lock:
            self._streams[stream.sid] = stream

    def discard(self, stream: Stream) -> bool:
        """Take ``stream`` out, keeping its counters; False when it is not in the table."""
        with self._lock:
            if self._streams.get(stream.sid) is not stream:
                return False
            del self._streams[stream.sid]
            for name in COUNTERS:
                self._retired[name] += getattr(stream, name)
        return True

    def of_pod(self, pod: str) -> list[Stream]:
        return [s for sid, s in self._streams.items() if sid.pod == pod]

    def forget(self, pod: str, until: float) -> None:
        """Refuse new streams of ``pod`` for messages received before ``until``."""
        self._forgotten[pod] = until

    def forgotten(self, pod: str, received_at: float) -> bool:
        """Whether a message of ``pod`` received at ``received_at`` is a straggler of a
        forgotten pod (the quiet period ends at the first message after it)."""
        quiet_until = self._forgotten.get(pod)
        if quiet_until is None:
            return False
        if received_at < quiet_until:
            return True
        del self._forgotten[pod]
        return False

    def victim(self, now: float, evict_idle_s: float) -> Stream | None:
        """The stream a full table gives up for a newcomer (None: none may go)."""
        while True:  # ends: each round pins a stream for good, or returns
            sid = eviction_victim(self._streams.items(), now, evict_idle_s)
            if sid is None:
                return None
            stream = self._streams[sid]
            if not self._repinned(stream):
                return stream

    def idle(self, now: float, idle_s: float) -> list[Stream]:
        """Unpinned streams silent for ``idle_s`` and free to leave (looked for once per
        ``_IDLE_SCAN_S``: an empty list between scans)."""
        if now < self._idle_scan_at:
            return []
        self._idle_scan_at = now + _IDLE_SCAN_S
        found = []
        for sid in idle_victims(self._streams.items(), now, idle_s):
            stream = self._streams[sid]
            if not (stream.blocked or stream.held or self._repinned(stream)):
                found.append(stream)
        return found

    def next_idle_scan(self) -> float:
        return self._idle_scan_at

    def _repinned(self, stream: Stream) -> bool:
        """Whether ``stream``'s pod is configured or was discovered since the stream
        opened; pins it if so."""
        if not stream.pinned and self._pod_known(stream.sid.pod):
            stream.pinned = True
        return stream.pinned

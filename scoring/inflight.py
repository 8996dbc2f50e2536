"""kvindex's own count of the requests it routed to each pod that have not finished yet.

A pod's ``/metrics`` are a second old at best; a burst of requests routed between two
scrapes would all see the same idle pod and all land on it. The ledger closes that gap:
each routing decision is entered (``begin``) and counts against its pod until the gateway
reports it finished (``done``) or its time to live runs out (a gateway that crashed never
reports). Every operation is O(1) amortised and thread-safe.

Expiry without a heap: entries with the same TTL expire in the order they began, so each
distinct TTL keeps a FIFO of (deadline, route id); expiring pops the fronts that are due.
A route finished early stays in its FIFO as a stale entry and is skipped when reached.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InFlight:
    """What kvindex has routed to one pod and not yet seen finish."""

    requests: int = 0
    prompt_blocks: int = 0  # the routed prompts' blocks, a proxy for prefill work queued


@dataclass(slots=True)
class _Route:
    pod: str
    prompt_blocks: int
    deadline: float
    serial: int  # tells this entry from an earlier one that reused the route id


class InFlightLedger:
    """Routed, unfinished requests per pod."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._routes: dict[str, _Route] = {}
        self._per_pod: dict[str, list[int]] = {}  # pod -> [requests, prompt_blocks]
        self._expiry: dict[float, deque[tuple[float, str, int]]] = {}  # ttl -> FIFO
        self._serial = 0
        self.expired_total = 0  # routes released by their TTL, not by done()

    def begin(self, pod: str, route_id: str, prompt_blocks: int, ttl_s: float) -> None:
        """Count ``route_id`` against ``pod`` for at most ``ttl_s`` seconds. Beginning a
        route id that is still open moves it (a gateway retrying on another pod)."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        if prompt_blocks < 0:
            raise ValueError("prompt_blocks must not be negative")
        with self._lock:
            now = self._clock()
            self._expire(now)
            if route_id in self._routes:
                self._release(route_id)
            self._serial += 1
            deadline = now + ttl_s
            self._routes[route_id] = _Route(pod, prompt_blocks, deadline, self._serial)
            counts = self._per_pod.setdefault(pod, [0, 0])
            counts[0] += 1
            counts[1] += prompt_blocks
            self._expiry.setdefault(ttl_s, deque()).append((deadline, route_id, self._serial))

    def done(self, route_id: str) -> str | None:
        """Release ``route_id``; the pod it counted against, or None when it is unknown
        or already expired."""
        with self._lock:
            self._expire(self._clock())
            route = self._routes.get(route_id)
            if route is None:
                return None
            self._release(route_id)
            return route.pod

    def of(self, pod: str) -> InFlight:
        with self._lock:
            self._expire(self._clock())
            counts = self._per_pod.get(pod)
            return InFlight(counts[0], counts[1]) if counts else InFlight()

    def all(self) -> dict[str, InFlight]:
        with self._lock:
            self._expire(self._clock())
            return {pod: InFlight(c[0], c[1]) for pod, c in self._per_pod.items()}

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._routes)

    def _release(self, route_id: str) -> None:
        route = self._routes.pop(route_id)
        counts = self._per_pod[route.pod]
        counts[0] -= 1
        counts[1] -= route.prompt_blocks
        if counts[0] == 0:
            del self._per_pod[route.pod]

    def _expire(self, now: float) -> None:
        for ttl in list(self._expiry):
            fifo = self._expiry[ttl]
            while fifo and fifo[0][0] <= now:
                _, route_id, serial = fifo.popleft()
                route = self._routes.get(route_id)
                if route is not None and route.serial == serial:
                    self._release(route_id)
                    self.expired_total += 1
            if not fifo:
                del self._expiry[ttl]

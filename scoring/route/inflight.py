"""kvindex's own count of the requests it routed to each pod that have not finished yet,
and of the prefill work they bring.

A pod's ``/metrics`` lag; a burst routed between two scrapes would all land on the same
idle-looking pod. Each decision is entered (``begin``) and counts against its pod until
``done`` or its TTL (a crashed gateway never reports). Its predicted prefill counts as
queued until ``first_token``. Finished routes leave session homes
(:mod:`kvindex.scoring.route.sessions`), counted in each pod's ``sessions``. Thread-safe, every
operation O(1) amortised: each distinct TTL keeps a FIFO of deadlines, so expiry needs
no heap.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvindex.scoring.route.sessions import SessionHomes


@dataclass(frozen=True, slots=True)
class InFlight:
    """What kvindex has routed to one pod and not yet seen finish."""

    requests: int = 0
    prompt_blocks: int = 0  # the blocks the routed requests hold (prompt and output)
    prefilling: int = 0  # of the requests, those whose first token was not reported
    prefill_tokens: int = 0  # their predicted uncached prompt tokens: prefill queued
    sessions: float = 0.0  # sessions between turns homed here, times the share that return


@dataclass(slots=True)
class _Route:
    pod: str
    prompt_blocks: int
    prefill_tokens: int  # 0 once the first token was reported
    deadline: float
    serial: int  # tells this entry from an earlier one that reused the route id
    prefilling: bool = True
    tail: int | None = None  # the prompt's last full block key: its session's home
    session: str | None = None  # the client's session id: its home's other claim


class InFlightLedger:
    """Routed, unfinished requests per pod."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._routes: dict[str, _Route] = {}
        # pod -> its counts, an immutable record replaced on every change: all() (per
        # /route request, over every pod) copies the dict and builds nothing
        self._per_pod: dict[str, InFlight] = {}
        self._expiry: dict[float, deque[tuple[float, str, int]]] = {}  # ttl -> FIFO
        self._serial = 0
        self.expired_total = 0  # routes released by their TTL, not by done()
        self._homes = SessionHomes()
        self._homed: dict[str, int] = {}  # pod -> homes there
        self._returning = 0.0  # the returning share the records were built with

    def begin(
        self,
        pod: str,
        route_id: str,
        prompt_blocks: int,
        ttl_s: float,
        prefill_tokens: int = 0,
        tail: int | None = None,
        continues: bool = False,
        session: str | None = None,
    ) -> None:
        """Count ``route_id`` against ``pod`` for at most ``ttl_s`` seconds, with
        ``prefill_tokens`` of prefill queued until its first token. Beginning a route id
        that is still open moves it (a gateway retrying on another pod). With ``tail``,
        the prompt's last full block key, or ``session``, the client's session id, its
        session is homed on ``pod`` when done. ``continues``: the request claimed a home
        (``arrive``), so its prefill is a continuation turn's."""
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        if prompt_blocks < 0 or prefill_tokens < 0:
            raise ValueError("prompt_blocks and prefill_tokens must not be negative")
        with self._lock:
            now = self._clock()
            self._expire(now)
            if route_id in self._routes:
                self._release(route_id)
            self._serial += 1
            deadline = now + ttl_s
            self._routes[route_id] = _Route(
                pod,
                prompt_blocks,
                prefill_tokens,
                deadline,
                self._serial,
                tail=tail,
                session=session,
            )
            self._count(pod, 1, prompt_blocks, 1, prefill_tokens)
            self._expiry.setdefault(ttl_s, deque()).append((deadline, route_id, self._serial))
            if continues:
                self._homes.turn(prefill_tokens)

    def arrive(self, keys: list[int], session: str | None = None) -> bool:
        """A request whose prompt holds the block ``keys`` (and that names the client's
        ``session``) is being routed: the sessions it continues are no longer between
        turns (claimed before its decision, so a session's own home does not count
        against its pod). Whether it continues one."""
        if not keys and session is None:
            return False
        with self._lock:
            now = self._clock()
            self._expire(now)
            claimed = self._homes.claim(keys, now, session)
            self._rehome(claimed, -1)
            return bool(claimed)

    def future_prefill(self) -> float:
        """The prefill tokens a request's session is expected to bring to its pod in
        its later turns (:attr:`~kvindex.scoring.route.sessions.SessionHomes.future_prefill`)."""
        with self._lock:
            return self._homes.future_prefill

    def first_token(self, route_id: str) -> str | None:
        """The request's prefill is over: its prefill tokens no longer count as queued
        (it still counts as a request until ``done``). The pod, or None when the route
        is not open; a second report changes nothing."""
        with self._lock:
            self._expire(self._clock())
            route = self._routes.get(route_id)
            if route is None:
                return None
            if route.prefilling:
                self._count(route.pod, 0, 0, -1, -route.prefill_tokens)
                route.prefilling, route.prefill_tokens = False, 0
            return route.pod

    def done(self, route_id: str) -> str | None:
        """Release ``route_id``; the pod it counted against, or None when it is unknown
        or already expired."""
        with self._lock:
            self._expire(self._clock())
            route = self._routes.get(route_id)
            if route is None:
                return None
            self._release(route_id)
            if route.tail is not None or route.session is not None:
                replaced = self._homes.leave(route.pod, route.tail, self._clock(), route.session)
                self._rehome([] if replaced is None else [replaced], -1)
                self._rehome([route.pod], 1)
            return route.pod

    @property
    def homes(self) -> SessionHomes:
        """The sessions between turns (read-only use: the ledger owns them)."""
        return self._homes

    def of(self, pod: str) -> InFlight:
        with self._lock:
            self._expire(self._clock())
            return self._per_pod.get(pod) or InFlight()

    def all(self) -> dict[str, InFlight]:
        with self._lock:
            self._expire(self._clock())
            return dict(self._per_pod)

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._routes)

    def _release(self, route_id: str) -> None:
        route = self._routes.pop(route_id)
        prefilling = 1 if route.prefilling else 0
        self._count(
            route.pod, -1, -route.prompt_blocks, -prefilling, -prefilling * route.prefill_tokens
        )

    def _count(
        self, pod: str, requests: int, prompt_blocks: int, prefilling: int, prefill_tokens: int
    ) -> None:
        """Add to ``pod``'s counts; a pod with no request and no session left is dropped."""
        old = self._per_pod.get(pod)
        if old is not None:
            requests += old.requests
            prompt_blocks += old.prompt_blocks
            prefilling += old.prefilling
            prefill_tokens += old.prefill_tokens
        sessions = self._homed.get(pod, 0) * self._returning
        if requests == 0 and sessions == 0:
            self._per_pod.pop(pod, None)
        else:
            self._per_pod[pod] = InFlight(
                requests, prompt_blocks, prefilling, prefill_tokens, sessions
            )

    def _rehome(self, pods: list[str], change: int) -> None:
        """Add ``change`` homes on each of ``pods``; rebuild every record when the share
        of sessions that return moved (it scales each pod's count)."""
        homed = self._homed
        for pod in pods:
            left = homed.get(pod, 0) + change
            if left:
                homed[pod] = left
            else:
                homed.pop(pod, None)
        returning = self._homes.returning
        if abs(returning - self._returning) > 0.02:
            self._returning = returning
            pods = list(homed.keys() | self._per_pod.keys())
        for pod in pods:
            self._count(pod, 0, 0, 0, 0)

    def _expire(self, now: float) -> None:
        self._rehome(self._homes.expire(now), -1)
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

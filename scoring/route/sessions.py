"""Sessions between turns: which pod each one will come back to, and for how long to
expect it.

A chat user reading or an agent waiting on a tool has no request in flight, yet comes
back to the pod holding its history; counting those sessions keeps ``/route`` from
packing new sessions onto pods that only look idle. A finished route leaves a *home*
(its prompt's last full block key, on its pod), claimed by the session's next request,
whose prompt holds that key. A request that names the client's session id also claims
that session's home whatever its prompt holds (an agent that compacted or rewrote its
context); a route with a session id and no full block (a prompt that could not be read,
such as an image chat) leaves a home keyed by the session id alone. Homes are forgotten
after twice the 90th percentile of the return gaps seen, and count as the share of homes
that were claimed (traffic that never comes back counts nothing).
:attr:`SessionHomes.future_prefill` estimates the prefill a session's later turns will
bring. Not thread-safe: :class:`~kvindex.scoring.route.inflight.InFlightLedger` calls it
under its lock.
"""

from __future__ import annotations

from collections import deque

#: How long a home waits before any return gap has been seen, in seconds.
FIRST_WAIT_S = 30.0
#: The return gaps seen before the wait may fall below :data:`FIRST_WAIT_S`.
MIN_GAPS = 16
#: The bounds of the adapted wait, in seconds.
MIN_WAIT_S, MAX_WAIT_S = 0.01, 3600.0
#: The most homes kept; past it the oldest is forgotten first (memory stays bounded
#: whatever the traffic).
MAX_HOMES = 65_536
_GAPS_KEPT = 256  # the return gaps the wait is computed from
_OUTCOMES_KEPT = 256  # the homes, claimed or forgotten, the returning share is from
_REFRESH_EVERY = 16  # returns between two computations of the wait (it sorts the gaps)
#: The returning share :attr:`SessionHomes.future_prefill` uses at most: 9 later turns.
MAX_RETURNING = 0.9
_TURN_WEIGHT = 0.1  # the weight of the newest turn in the mean continuation prefill


#: A home's key: a prompt's last full block key, or (no block) the client's session id.
HomeKey = int | str


class SessionHomes:
    """Homes by block key (or session id), oldest first; the session ids of homes left
    with one, to claim them by it (each names a live home whose own session it is)."""

    def __init__(self) -> None:
        self._homes: dict[HomeKey, tuple[str, float, str | None]] = {}  # (pod, left at, session)
        self._order: deque[tuple[float, HomeKey]] = deque()  # (left at, key); stale ones skipped
        self._by_session: dict[str, HomeKey] = {}
        self._gaps: deque[float] = deque(maxlen=_GAPS_KEPT)
        self._unsorted = 0
        self._outcomes: deque[bool] = deque(maxlen=_OUTCOMES_KEPT)  # True: claimed
        self._claimed = 0  # of the outcomes kept
        self.wait_s = FIRST_WAIT_S
        self.returning = 0.0  # the share of homes claimed (0 until one was)
        self.turn_tokens = 0.0  # mean uncached tokens of a continuation turn (0: none seen)
        self._turns_seen = False

    def __len__(self) -> int:
        return len(self._homes)

    def leave(
        self, pod: str, tail: int | None, now: float, session: str | None = None
    ) -> str | None:
        """A route of the prompt ending in block ``tail`` (None: no full block) for the
        client's ``session`` (None: not named) finished on ``pod``: its session is homed
        there, under ``tail`` or else ``session``. The pod of the home this one replaces
        (the same prompt or session finished earlier), or None."""
        key: HomeKey | None = tail if tail is not None else session
        if key is None:
            return None
        replaced = self._homes.pop(key, None)
        if replaced is not None:
            self._unlink(key, replaced[2])
        self._homes[key] = (pod, now, session)
        self._order.append((now, key))
        if session is not None:
            self._by_session[session] = key
        return None if replaced is None else replaced[0]

    def claim(self, keys: list[int], now: float, session: str | None = None) -> list[str]:
        """A request whose prompt holds ``keys``, for the client's ``session`` (None: not
        named), arrived: the pods of the homes it claims (the sessions it continues)."""
        homes = self._homes
        if not homes:
            return []
        pods = []
        if session is not None:
            key = self._by_session.get(session)
            if key is not None:
                self._claim(key, now, pods)
        if homes.keys().isdisjoint(keys):  # a set operation, in C
            return pods
        for key in keys:
            self._claim(key, now, pods)
        return pods

    def _claim(self, key: HomeKey, now: float, pods: list[str]) -> None:
        home = self._homes.pop(key, None)
        if home is not None:
            self._unlink(key, home[2])
            pods.append(home[0])
            self._returned(now - home[1])
            self._outcome(True)

    def _unlink(self, key: HomeKey, session: str | None) -> None:
        """The home ``key`` of ``session`` is gone: so is its claim by session id."""
        if session is not None and self._by_session.get(session) == key:
            del self._by_session[session]

    def turn(self, prefill_tokens: int) -> None:
        """A request that continued a session (it claimed a home) was routed with
        ``prefill_tokens`` to compute: the mean continuation prefill moves toward it."""
        if self._turns_seen:
            self.turn_tokens += _TURN_WEIGHT * (prefill_tokens - self.turn_tokens)
        else:
            self.turn_tokens, self._turns_seen = float(prefill_tokens), True

    @property
    def future_prefill(self) -> float:
        """The prefill tokens a request's session is expected to bring in its later
        turns: ``p / (1 - p)`` turns (``p`` the returning share, at most
        :data:`MAX_RETURNING`) of the mean continuation prefill each."""
        share = min(self.returning, MAX_RETURNING)
        return share / (1.0 - share) * self.turn_tokens

    def expire(self, now: float) -> list[str]:
        """Forget the homes older than the wait, and the oldest past :data:`MAX_HOMES`;
        the pods of those forgotten."""
        homes, order = self._homes, self._order
        pods = []
        while order:
            left, key = order[0]
            if now - left <= self.wait_s and len(order) <= MAX_HOMES:
                break
            order.popleft()
            home = homes.get(key)
            if home is not None and home[1] == left:
                del homes[key]
                self._unlink(key, home[2])
                pods.append(home[0])
                self._outcome(False)
        return pods

    def _outcome(self, claimed: bool) -> None:
        outcomes = self._outcomes
        if len(outcomes) == outcomes.maxlen:
            self._claimed -= outcomes[0]
        outcomes.append(claimed)
        self._claimed += claimed
        self.returning = self._claimed / len(outcomes)

    def _returned(self, gap_s: float) -> None:
        self._gaps.append(gap_s)
        self._unsorted += 1
        if self._unsorted >= _REFRESH_EVERY or len(self._gaps) <= MIN_GAPS:
            self._unsorted = 0
            gaps = sorted(self._gaps)
            p90 = gaps[(len(gaps) - 1) * 9 // 10]
            floor = MIN_WAIT_S if len(gaps) >= MIN_GAPS else FIRST_WAIT_S
            self.wait_s = min(MAX_WAIT_S, max(floor, 2.0 * p90))

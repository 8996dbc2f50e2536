"""How far behind its engine each index member is: the event lag of its last batch.

An index whose events arrive seconds late describes the cache as it was; ``/route``
marks a candidate above ``--max-event-lag`` as doubted (``lagging``). A batch's lag is
the applier's wall clock at apply time minus the engine's batch timestamp (keep the
hosts in NTP sync); replayed batches are left out. vLLM sends batches only when its
scheduler produced events, so a lag counts only while recent (``window_s``): a quiet pod
is taken as caught up, while a backlog keeps delivering late batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kvindex.events.wire.identity import member_pod


@dataclass(frozen=True, slots=True)
class Lag:
    seconds: float
    at: float  # monotonic clock when the batch was applied
    ts: float | None = None  # the batch's own timestamp (the engine's clock)


class EventLag:
    """The last applied batch's lag per member; written by the ingest thread only."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.window_s = window_s
        self._clock = clock
        self._lags: dict[str, Lag] = {}

    def record(self, member: str, lag_s: float, ts: float | None = None) -> None:
        """The ingest path applied a batch of ``member`` that was ``lag_s`` old (stamped
        ``ts`` by its engine)."""
        self._lags[member] = Lag(max(0.0, lag_s), self._clock(), ts)  # one assignment: atomic

    def last_batch_ts(self, member: str) -> float | None:
        """The engine timestamp of ``member``'s last batch applied live since its stream
        began or was reset (an engine restart resets it); None if there was none. Tells
        whether the index heard from an engine since it started (``/route``: a pod whose
        ``process_start_time_seconds`` is newer has restarted unheard)."""
        lag = self._lags.get(member)
        return None if lag is None else lag.ts

    def batches(self) -> dict[str, Lag]:
        """Every member's last applied batch, the live dict (read it, never write it):
        ``/route``'s compiled candidate loop reads each candidate's ``ts`` from it."""
        return self._lags

    def forget(self, member: str) -> None:
        self._lags.pop(member, None)

    def current(self) -> dict[str, float]:
        """Each member's recent lag (members quiet for ``window_s`` are left out)."""
        now = self._clock()
        return {
            m: lag.seconds for m, lag in list(self._lags.items()) if now - lag.at <= self.window_s
        }

    def lagging(self, pods: Collection[str], threshold_s: float) -> dict[str, float]:
        """Of ``pods``, those with a member whose recent lag is above ``threshold_s``
        (0: never), with the worst lag."""
        if threshold_s <= 0 or not self._lags:
            return {}
        oldest = self._clock() - self.window_s
        late = [
            (m, lag.seconds)
            for m, lag in list(self._lags.items())
            if lag.seconds > threshold_s and lag.at >= oldest
        ]
        if not late:  # the usual case: one pass, no set of the candidates
            return {}
        wanted = set(pods)
        out: dict[str, float] = {}
        for member, seconds in late:
            pod = member_pod(member)
            if pod in wanted:
                out[pod] = max(seconds, out.get(pod, 0.0))
        return out

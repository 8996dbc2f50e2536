"""A clock that moves only when told: ``kvindex serve --clock external``.

``/route``'s state ages on a clock (the in-flight ledger's TTL, session homes' waits,
speculative entries, ejections, scrape ages). A simulator running a workload in virtual
time must age that state in the same virtual time, or one seed's figures depend on how
fast the machine ran it. Under ``--clock external`` every ``/route`` call carries the
simulator's time (``?now=SECONDS``) and kvindex reads nothing else.

Time never goes back: a reading earlier than the last one is refused, so a caller that
mixes two timelines fails loudly instead of resurrecting expired state.
"""

from __future__ import annotations

import math


class ExternalClock:
    """Seconds set by the caller; starts at 0. Reads and moves are single attribute
    operations, safe across threads (the scraper reads it while requests move it)."""

    def __init__(self) -> None:
        self._now = 0.0

    def __call__(self) -> float:
        return self._now

    def advance_to(self, now: float) -> None:
        """Move to ``now``; ValueError if it is not a finite time at or after the last."""
        if not math.isfinite(now):
            raise ValueError(f"now={now}: not a finite number of seconds")
        if now < self._now:
            raise ValueError(f"now={now}: before the last time given ({self._now})")
        self._now = now

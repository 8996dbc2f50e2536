"""Which engine batch timestamps can be trusted as a clock reading.

A batch's ``ts`` is the engine's wall clock (``time.time()`` in vLLM 0.9-0.33) when the
scheduler step made it. kvindex uses it for one thing, the event lag (now - ts), which
an operator reads to tell a slow pipeline from a healthy one. A broken engine clock
(an unset RTC reading 1970, a clock years ahead), a corrupt payload or a hostile sender
can put anything there - 0, negative values, ±inf, NaN - and one such value in a
histogram sum makes the lag graph meaningless (NaN poisons ``_sum`` for good, 1e18 s
dwarfs every real delay). Such timestamps are classified here and left out of the lag;
the batch itself is still applied (its events are fine, only its clock is not).
"""

from __future__ import annotations

import math

#: A timestamp further than this from kvindex's clock, either way, is not skew but a
#: broken clock or corrupt input. A day keeps replayed catch-up batches of an engine
#: idle for hours (legitimately old) while rejecting the 1970s and the far future.
MAX_CLOCK_SKEW_S = 86_400.0

#: Reasons :func:`timestamp_problem` returns, for metric labels.
TIMESTAMP_PROBLEMS = ("not_a_number", "infinite", "not_positive", "too_old", "in_the_future")


def timestamp_problem(ts: float, now: float, max_skew_s: float = MAX_CLOCK_SKEW_S) -> str | None:
    """Why ``ts`` is not a usable engine clock reading at ``now``, or None when it is."""
    if math.isnan(ts):
        return "not_a_number"
    if math.isinf(ts):
        return "infinite"
    if ts <= 0.0:
        return "not_positive"
    if ts < now - max_skew_s:
        return "too_old"
    if ts > now + max_skew_s:
        return "in_the_future"
    return None

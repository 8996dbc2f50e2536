"""Memory a burst used goes back to the system once the applier has been idle a moment,
not between the batches of a burst (events/ingest/heap.py; the inbox's default budget, from
the same module's memory_limit, is checked in test_events_groups.py)."""

from __future__ import annotations

import pytest

from kvindex.events.ingest import heap


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.skipif(heap.free_bytes() is None, reason="not glibc: nothing to give back")
def test_free_memory_goes_back_after_a_quiet_moment_not_between_batches() -> None:
    clock = Clock()
    trim = heap.HeapTrim(clock, min_free=0, quiet_s=0.2)
    assert trim.idle() is None  # no work done: nothing to give back
    trim.busy()
    assert trim.idle() == pytest.approx(0.2)  # idle from now: asks to be called again
    clock.now += 0.1
    assert trim.idle() == pytest.approx(0.1) and trim.trims == 0
    trim.busy()  # the next batch of the burst: the quiet moment starts over
    clock.now += 0.15
    assert trim.idle() == pytest.approx(0.2) and trim.trims == 0
    clock.now += 0.2
    assert trim.idle() is None and trim.trims == 1
    clock.now += 5
    assert trim.idle() is None and trim.trims == 1  # once per quiet spell


@pytest.mark.skipif(heap.free_bytes() is None, reason="not glibc")
def test_little_free_memory_is_kept() -> None:
    clock = Clock()
    trim = heap.HeapTrim(clock, min_free=1 << 62, quiet_s=0.0)
    trim.busy()
    assert trim.idle() is None and trim.trims == 0

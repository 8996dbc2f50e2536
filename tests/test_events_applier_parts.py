"""The applier's helper objects on their own: the stream table and the owed sink resets."""

from __future__ import annotations

import logging

from kvindex.events.ingest.inbox import Lane
from kvindex.events.ingest.ratelog import RateLimitedLog
from kvindex.events.ingest.sink_resets import PendingResets
from kvindex.events.ingest.status import ReasonCounts
from kvindex.events.ingest.stream import Stream
from kvindex.events.ingest.stream_table import StreamTable
from kvindex.events.ingest.testing import RecordingSink
from kvindex.events.wire.identity import StreamId

A, B = StreamId("10.0.0.1:8000"), StreamId("10.0.0.2:8000")


def stream(sid: StreamId, *, pinned: bool = False, created_at: float = 0.0) -> Stream:
    return Stream(sid, Lane(sid), "m", None, pinned=pinned, created_at=created_at)


def test_a_removed_stream_keeps_counting_in_the_totals() -> None:
    table = StreamTable(lambda pod: False)
    a = stream(A)
    a.delivered = 3
    table.add(a)
    assert table.discard(a) and not table.discard(a)  # the second time: not there
    assert A not in table and table.totals()["delivered"] == 3


def test_a_forgotten_pod_refuses_stragglers_until_its_quiet_period_ends() -> None:
    table = StreamTable(lambda pod: False)
    table.forget(A.pod, until=10.0)
    assert table.forgotten(A.pod, received_at=9.0)
    assert not table.forgotten(A.pod, received_at=10.0)
    assert not table.forgotten(A.pod, received_at=9.0)  # the quiet period is over


def test_a_full_table_gives_up_an_unpinned_stream_unless_its_pod_was_discovered() -> None:
    discovered: set[str] = set()
    table = StreamTable(lambda pod: pod in discovered)
    a, b = stream(A, created_at=1.0), stream(B, created_at=2.0)
    table.add(a)
    table.add(b)
    assert table.victim(now=100.0, evict_idle_s=10.0) is a  # the least recently active
    discovered.add(A.pod)
    assert table.victim(now=100.0, evict_idle_s=10.0) is b
    assert a.pinned  # asked once, pinned for good
    assert table.idle(now=100.0, idle_s=10.0) == [b]
    assert table.idle(now=100.5, idle_s=10.0) == []  # between two scans


def test_an_owed_reset_is_retried_until_the_sink_takes_it() -> None:
    sink = RecordingSink()
    errors = ReasonCounts()
    now = [0.0]
    resets = PendingResets(sink, errors, RateLimitedLog(logging.getLogger(__name__)),
                           lambda: now[0], retry_s=1.0)  # fmt: skip
    sink.failing = True
    resets.owe(A, "engine_restart")
    assert not resets.settle(A)
    assert errors.snapshot() == {"sink_error": 1}
    resets.retry_orphans(now[0], live={A})  # A is in the table: its own stream settles it
    assert sink.failed_calls == 1
    resets.retry_orphans(now[0], live=set())
    assert resets.next_orphan_retry(set()) == 1.0  # failed: again after retry_s
    sink.failing = False
    now[0] = 1.0
    resets.retry_orphans(now[0], live=set())
    assert [(r.stream, r.reason) for r in sink.resets] == [(A, "engine_restart")]
    assert resets.settle(A) and resets.next_orphan_retry(set()) == float("inf")

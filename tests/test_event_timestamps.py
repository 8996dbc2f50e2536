"""Clock skew (issue 10 item 10): absurd engine timestamps stay out of the event lag."""

from __future__ import annotations

import math

import pytest
import zmq
from prometheus_client import CollectorRegistry

from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.timestamps import MAX_CLOCK_SKEW_S, timestamp_problem
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.instrumented import InstrumentedSink

NOW = 1_800_000_000.0
DAY = 86_400.0


@pytest.mark.parametrize(
    ("ts", "problem"),
    [
        (NOW, None),
        (NOW - 3600.0, None),  # an hour-old replayed batch is real lag
        (NOW + 30.0, None),  # small skew ahead: lag 0, not an error
        (0.0, "not_positive"),
        (-5.0, "not_positive"),
        (math.nan, "not_a_number"),
        (math.inf, "infinite"),
        (-math.inf, "infinite"),
        (NOW - 3 * 365 * DAY, "too_old"),
        (NOW + 5 * 365 * DAY, "in_the_future"),
        (NOW - MAX_CLOCK_SKEW_S - 1, "too_old"),
        (NOW + MAX_CLOCK_SKEW_S + 1, "in_the_future"),
    ],
)
def test_timestamp_problem(ts: float, problem: str | None) -> None:
    assert timestamp_problem(ts, NOW) == problem


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_absurd_timestamps_through_a_live_stream_do_not_pollute_the_lag() -> None:
    """Real publisher -> real subscriber -> InstrumentedSink: only the sane batch is timed."""
    registry = CollectorRegistry()
    recorder = RecordingSink()
    sink = InstrumentedSink(recorder, registry, clock=lambda: NOW)
    ctx = zmq.Context()
    sub = Subscriber(sink, SubscriberConfig(replay_timeout_s=5.0), context=ctx)
    stamps = [NOW - 0.25, 0.0, -1.0, math.nan, math.inf, -math.inf, NOW + 10 * 365 * DAY,
              NOW - 40 * 365 * DAY]  # fmt: skip
    try:
        sub.start()
        with EnginePublisher("tcp://127.0.0.1:0", bind=True, context=ctx) as pub:
            sub.connect(PodEndpoint(pub.endpoint, pod="127.0.0.1:8000", model="m"))
            assert pub.wait_for_subscribers(1, 5.0)
            for i, ts in enumerate(stamps):
                pub.publish([BlockStored([100 + i], None, [1] * 16, 16)], ts=ts)
            assert recorder.wait_for_count(len(stamps), 10.0)
    finally:
        sub.stop()
        ctx.destroy(linger=0)
    # Every batch was applied: a broken clock costs the lag sample, not the events.
    assert [h for d in recorder.deliveries for h in d.batch.events[0].block_hashes] == [
        100 + i for i in range(len(stamps))
    ]
    assert _sample(registry, "kvindex_event_lag_seconds_count") == 1.0
    assert _sample(registry, "kvindex_event_lag_seconds_sum") == pytest.approx(0.25)
    bad = "kvindex_event_bad_timestamps_total"
    assert _sample(registry, bad, reason="not_positive") == 2.0
    assert _sample(registry, bad, reason="not_a_number") == 1.0
    assert _sample(registry, bad, reason="infinite") == 2.0
    assert _sample(registry, bad, reason="in_the_future") == 1.0
    assert _sample(registry, bad, reason="too_old") == 1.0

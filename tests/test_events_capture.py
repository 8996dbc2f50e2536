"""Recording live traffic to a file and publishing it again."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import zmq

from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink
from kvindex.events.wire.capture import CaptureError, read_capture, record, replay_capture
from kvindex.events.wire.identity import make_topic
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored

POD = "127.0.0.1:8000"


def test_record_then_replay_into_a_subscriber(ctx: zmq.Context, tmp_path: Path) -> None:
    path = tmp_path / "kv.cap"
    with EnginePublisher(
        "tcp://127.0.0.1:0", bind=True, topic=make_topic(POD, "m"), context=ctx
    ) as pub:
        counted: list[int] = []
        recorder = threading.Thread(
            target=lambda: counted.append(
                record(pub.endpoint, path, max_messages=4, duration_s=10, context=ctx)
            )
        )
        recorder.start()
        assert pub.wait_for_subscribers(1)
        for i in range(3):
            pub.publish([BlockStored([i], None, [1] * 16, 16)], ts=100.0 + i)
        pub.send_frames([b"odd", b"frames", b"kept", b"as-is"])
        recorder.join(10)
        assert not recorder.is_alive() and counted == [4]

    header, messages = read_capture(path)
    captured = list(messages)
    assert header.endpoint == pub.endpoint
    assert [len(m.frames) for m in captured] == [3, 3, 3, 4]
    assert [int.from_bytes(m.frames[1], "big") for m in captured[:3]] == [0, 1, 2]

    sink = RecordingSink()
    sub = Subscriber(sink, SubscriberConfig())
    endpoint = sub.bind("tcp://127.0.0.1:0")
    sub.start()
    try:
        # A non-wildcard endpoint connects, like an engine configured for bind mode.
        sent = replay_capture(path, endpoint, speed=50.0, wait_for_subscribers=1, context=ctx)
        assert sent == 4
        assert sink.wait_for_count(3)
    finally:
        sub.stop()
    assert sink.seqs() == [0, 1, 2]
    assert [d.batch.ts for d in sink.deliveries] == [100.0, 101.0, 102.0]


def test_record_stops_on_duration_and_event(ctx: zmq.Context, tmp_path: Path) -> None:
    ready: list[str] = []
    n = record(
        "tcp://127.0.0.1:0", tmp_path / "a.cap", duration_s=0.05, bind=True,
        on_ready=ready.append, context=ctx,
    )  # fmt: skip
    assert n == 0 and ready and not ready[0].endswith(":0")
    stop = threading.Event()
    stop.set()
    assert record("tcp://127.0.0.1:1", tmp_path / "b.cap", stop=stop, context=ctx) == 0
    header, messages = read_capture(tmp_path / "b.cap")
    assert list(messages) == [] and header.version == 1


def test_not_a_capture(tmp_path: Path) -> None:
    bad = tmp_path / "bad.cap"
    bad.write_bytes(b"\x00\x00\x00\x02hi")
    with pytest.raises(CaptureError):
        read_capture(bad)
    (tmp_path / "empty.cap").write_bytes(b"")
    with pytest.raises(CaptureError):
        read_capture(tmp_path / "empty.cap")
    with pytest.raises(ValueError):
        replay_capture(bad, "tcp://127.0.0.1:1", speed=0)

"""Bad input costs only itself: skipped, counted by reason, and the next message applies.

The hypothesis tests are derandomized so every run checks the same examples; drop
``derandomize`` (and raise max_examples) for a fuzzing session.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.door import Arrival, Door, Source
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink, wait_until
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import (
    MAX_HASHES_PER_EVENT,
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    DecodeError,
    Layout,
)

POD = "127.0.0.1:8000"
FIELDS = [
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "type",
]  # fmt: skip

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Nope", ""]) | values
hash_lists = st.lists(st.integers(-5, 2**64 - 1) | st.binary(max_size=40) | values, max_size=5)
array_events = st.builds(
    lambda tag, hashes, rest: [tag, hashes, *rest], tags, hash_lists, st.lists(values, max_size=13)
)
map_events = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    tags,
    st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), values | hash_lists, max_size=6),
)
events = array_events | map_events | values
batches = st.one_of(
    st.tuples(st.floats() | values, st.lists(events, max_size=4), st.integers(0, 5) | values),
    st.tuples(st.floats() | values, st.lists(events, max_size=4)),
    st.lists(values, max_size=4),
    values,
).map(lambda b: list(b) if isinstance(b, tuple) else b)
wrong_payloads = batches.map(msgspec.msgpack.encode)


def check_decodes_or_refuses(payload: bytes) -> None:
    decoder = BatchDecoder()
    for prefer in Layout:
        try:
            decoded = decoder.decode(payload, prefer)
        except DecodeError as exc:
            assert exc.reason in {"malformed_msgpack", "invalid_batch"}
            continue
        assert isinstance(decoded.batch.ts, float)
        for event in decoded.batch.events:
            assert isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared)
            for h in getattr(event, "block_hashes", []):
                assert (type(h) is int and 0 <= h < 2**64) or type(h) is bytes
            assert len(getattr(event, "block_hashes", [])) <= MAX_HASHES_PER_EVENT


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.binary(max_size=200))
def test_decoder_random_bytes(payload: bytes) -> None:
    check_decodes_or_refuses(payload)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(wrong_payloads)
def test_decoder_well_typed_but_wrong_structures(payload: bytes) -> None:
    check_decodes_or_refuses(payload)


def test_decoder_counts_what_it_skips() -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [1]], ["Mystery", 1], ["BlockRemoved", "x"], {"type": 3}], 0]
    )
    decoded = BatchDecoder().decode(payload)
    (event,) = decoded.batch.events
    assert isinstance(event, BlockStored) and event.block_hashes == [1]
    assert decoded.skipped == {"unknown_event_type": 1, "invalid_event": 2}


# -- a live subscriber --------------------------------------------------------------------


@pytest.fixture
def live() -> Iterator[tuple[Subscriber, EnginePublisher, RecordingSink]]:
    ctx = zmq.Context()
    sink = RecordingSink()
    sub = Subscriber(sink, SubscriberConfig(replay_timeout_s=0.3))
    pub = EnginePublisher("tcp://127.0.0.1:0", bind=True, topic=f"kv@{POD}@m", context=ctx)
    sub.connect(PodEndpoint(pub.endpoint))  # no replay endpoint: gaps are simply counted
    sub.start()
    assert pub.wait_for_subscribers(1)
    yield sub, pub, sink
    sub.stop()
    pub.close()
    ctx.destroy(linger=0)


def publish_valid_and_wait(pub: EnginePublisher, sink: RecordingSink, marker: int) -> None:
    pub.publish([BlockStored([marker], None, [1] * 16, 16)])
    assert sink.wait_for(
        lambda s: any(
            marker in getattr(e, "block_hashes", ()) for d in s.deliveries for e in d.batch.events
        )
    ), f"valid message {marker} was not delivered after bad input"


SEQ = (0).to_bytes(8, "big")
TOPIC = f"kv@{POD}@m".encode()


def bad_inputs() -> list[tuple[str, str, object]]:
    """(case, reason counted, frames or a payload to publish under the next seq)."""
    huge_event = msgspec.msgpack.encode([1.0, [["BlockStored", list(range(1_000_000))]], 0])
    return [
        ("one frame", "bad_frame_count", [TOPIC]),
        ("four frames", "bad_frame_count", [TOPIC, SEQ, b"\x90", b"extra"]),
        ("short seq", "bad_seq_frame", [TOPIC, b"\x00" * 7, b"\x90"]),
        ("non-utf8 topic", "bad_topic_encoding", [b"kv@\xff\xfe", SEQ, b"\x90"]),
        ("100 MB frame", "payload_too_large", [TOPIC, SEQ, bytes(100 * 1024 * 1024)]),
        ("malformed msgpack", "malformed_msgpack", b"\xc1\xc1"),
        ("truncated msgpack", "malformed_msgpack", msgspec.msgpack.encode([1.0, [1, 2]])[:-1]),
        ("not a batch", "invalid_batch", msgspec.msgpack.encode({"ts": 1.0})),
        ("events not a list", "invalid_batch", msgspec.msgpack.encode([1.0, 5, 0])),
        ("negative rank", "invalid_batch", msgspec.msgpack.encode([1.0, [], -1])),
        ("unknown tag", "unknown_event_type", msgspec.msgpack.encode([1.0, [["Evicted", [1]]], 0])),
        ("wrong field types", "invalid_event",
         msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "no"}], 0])),
        ("negative hash", "invalid_event",
         msgspec.msgpack.encode([1.0, [["BlockRemoved", [-1]]], 0])),
        ("a million hashes", "too_many_hashes", huge_event),
        ("1,000 arrays deep", "too_deeply_nested",  # msgspec: RecursionError (issue 26)
         b"\x92\xcb\x41\xd0" + bytes(6) + b"\x91\x92\xabBlockStored" + b"\x91" * 1000 + b"\x01"),
    ]  # fmt: skip


def test_each_bad_input_is_skipped_counted_and_followed(live) -> None:
    sub, pub, sink = live
    for marker, (case, reason, bad) in enumerate(bad_inputs()):
        before = sub.error_counts().get(reason, 0)
        if isinstance(bad, list):
            pub.send_frames(bad)
        else:
            pub.publish_payload(bad)
        publish_valid_and_wait(pub, sink, marker)
        assert sub.error_counts().get(reason, 0) == before + 1, case
    status = sub.streams()[0]
    assert status.state == "live" and status.missed_batches == 0 and status.restarts == 0


def test_an_error_no_check_expected_costs_only_its_message(live, monkeypatch) -> None:
    """Whatever one message raises in the receiver is that message's error (counted as
    internal_error), never the receiver thread's."""
    sub, pub, sink = live
    admit, admit_group = Door.admit, Door.admit_group

    def failing_admit(
        self: Door, source: Source, frames: list[bytes], peer: str | None
    ) -> Arrival | None:
        if frames[0] == b"boom":
            raise RuntimeError("a bug the door did not expect")
        return admit(self, source, frames, peer)

    def failing_admit_group(self: Door, source: Source, topic: bytes, *rest: Any) -> Arrival | None:
        if topic == b"boom":
            raise RuntimeError("a bug the door did not expect")
        return admit_group(self, source, topic, *rest)

    monkeypatch.setattr(Door, "admit", failing_admit)
    monkeypatch.setattr(Door, "admit_group", failing_admit_group)
    payload = pub.encode([BlockStored([7], None, [1] * 16, 16)])
    pub.send_frames([b"boom", SEQ, payload])
    publish_valid_and_wait(pub, sink, 1)
    assert sub.error_counts().get("internal_error") == 1
    assert sub.is_running() and sub.failure is None


def test_random_garbage_at_a_live_subscriber(live) -> None:
    sub, pub, sink = live
    garbage = st.one_of(
        st.lists(st.binary(max_size=24), min_size=1, max_size=5),
        st.tuples(st.just(TOPIC), st.binary(min_size=8, max_size=8), st.binary(max_size=64)),
        st.tuples(st.just(TOPIC), st.binary(min_size=8, max_size=8), wrong_payloads),
        st.tuples(st.binary(max_size=12), st.just(SEQ), wrong_payloads),
    ).map(list)
    markers = iter(range(10_000, 20_000))

    @settings(
        max_examples=30,
        derandomize=True,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(garbage)
    def throw(frames: list[bytes]) -> None:
        pub.send_frames(frames)
        publish_valid_and_wait(pub, sink, next(markers))

    throw()
    assert sub.is_running()
    assert wait_until(lambda: sum(s.queue_depth for s in sub.streams()) == 0)

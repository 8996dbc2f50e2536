"""Consecutive messages of a stream taken as one: what ingest gets is what it gets from
them one by one.

Three places join messages: the receiver's compiled drain reads a sender's consecutive
messages off the socket as one group (``events/wire/_wire_scan_zmq.h``), the applier delivers
a stream's in-order messages of one turn as one delivery (``ScannedBatch.merge``), and
the inbox counts a group as its messages. Each is checked against the one-by-one
reference: the merged scan against msgspec's decode of every payload in turn, the drain's
groups against the scans of their messages (and broken where the stream's order or the
framing asks), deliveries against the batches published, queue capacity in messages.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.events.ingest import drain as drain_module
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.door import Arrival
from kvindex.events.ingest.inbox import Inbox
from kvindex.events.ingest.sink import Delivery
from kvindex.events.ingest.status import ReasonCounts
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink, wait_until
from kvindex.events.wire import scanned as scanned_module
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.layouts import RELEASES
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.runs import runs_of
from kvindex.events.wire.scanned import ScannedBatch, scan
from kvindex.events.wire.vllm import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    EventBatch,
)

COMPILED = scanned_module.scanner is not None
needs_scanner = pytest.mark.skipif(not COMPILED, reason="events/wire/_wire_scan.c is not built")
needs_drain = pytest.mark.skipif(
    drain_module.drain() is None, reason="the compiled drain is not bound to libzmq"
)

event = st.one_of(
    st.builds(
        lambda hashes, parent, medium, group: BlockStored(
            hashes, parent, [7] * 16 * len(hashes), 16, medium=medium, group_idx=group
        ),
        st.lists(st.integers(0, 2**64 - 1), max_size=4),
        st.none() | st.integers(0, 2**64 - 1),
        st.sampled_from([None, "GPU", "CPU"]),
        st.sampled_from([None, 0, 1]),
    ),
    st.builds(lambda hashes: BlockRemoved(hashes, "GPU"), st.lists(st.integers(0, 99), max_size=3)),
    st.just(AllBlocksCleared()),
)
batches = st.lists(st.lists(event, max_size=4), min_size=1, max_size=6)


def encoded(fmt, batch_events: list[list], rank: int | None = 0) -> list[bytes]:
    return [fmt.encode_batch(events, 100.0 + i, rank) for i, events in enumerate(batch_events)]


def assert_is_the_batches_in_turn(merged: ScannedBatch, payloads: Sequence[bytes]) -> None:
    """``merged`` reads as the payloads one after another, by msgspec."""
    decoded = [BatchDecoder().decode(p).batch for p in payloads]
    events = [e for batch in decoded for e in batch.events]
    reference = runs_of(EventBatch(decoded[-1].ts, events))
    assert [tuple(r) for r in merged.runs] == [tuple(r) for r in reference.runs]
    assert merged.hashes == bytes(reference.hashes)
    assert merged.n_events == len(events)
    assert [merged.event(i) for i in range(merged.n_events)] == events
    assert merged.events == events
    assert merged.ts == decoded[-1].ts
    assert merged.timestamps == [batch.ts for batch in decoded]
    assert merged.batches == len(payloads) and merged.payloads == tuple(payloads)
    assert [part.payloads[0] for part in merged.parts()] == list(payloads)


@needs_scanner
@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.sampled_from(RELEASES), batches, st.integers(1, 3))
def test_merged_scans_read_as_the_batches_in_turn(fmt, batch_events, pieces) -> None:
    payloads = encoded(fmt, batch_events)
    scans = [scan(p) for p in payloads]
    assert all(s is not None for s in scans)
    # Merge in pieces, then the pieces: a merge of merges is the same thing.
    size = max(1, len(scans) // pieces)
    chunks = [scans[i : i + size] for i in range(0, len(scans), size)]
    parts = [c[0] if len(c) == 1 else ScannedBatch.merge(c) for c in chunks]
    merged = parts[0] if len(parts) == 1 else ScannedBatch.merge(parts)
    if len(payloads) > 1:
        assert_is_the_batches_in_turn(merged, payloads)


# -- the receiver's drain -------------------------------------------------------------------


def _frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


@needs_drain
def test_the_drain_groups_a_senders_consecutive_messages(ctx: zmq.Context) -> None:
    fmt = RELEASES[-1]
    good = encoded(fmt, [[BlockStored([i, i + 1], None, [1] * 32, 16)] for i in range(12)])
    other_rank = fmt.encode_batch([BlockRemoved([5], "GPU")], 1.0, 1)
    map_envelope = msgspec.msgpack.encode({"ts": 1.0, "events": [], "data_parallel_rank": 0})
    a, b = b"kv@127.0.0.1:8000@m", b"kv@127.0.0.2:8000@m"
    sent = [
        _frames(a, 0, good[0]), _frames(a, 1, good[1]), _frames(a, 2, good[2]),  # group
        _frames(b, 0, good[3]),  # another sender
        _frames(a, 3, good[4]),  # continues a's seqs, but not its group
        _frames(a, 5, good[5]), _frames(a, 6, good[6]),  # a gap before it: a new group
        _frames(a, 7, other_rank),  # another rank: another stream
        _frames(a, 8, map_envelope),  # not the scanner's: left to msgspec
        [a, b"x"],  # 2 frames
        [a, b"123456789", good[7]],  # a 9-byte seq
        _frames(a, 9, good[8] + bytes(4096)),  # over max_payload
        _frames(a, 10, good[9]), _frames(a, 11, good[10]), _frames(a, 12, good[11]),
    ]  # fmt: skip
    pub, sub = ctx.socket(zmq.XPUB), ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("inproc://drain-groups")  # inproc: everything sent is waiting when drained
    pub.connect("inproc://drain-groups")
    deadline = time.monotonic() + 5
    while not pub.poll(10):  # the subscription is through (the SUB socket must run)
        sub.poll(0)
        assert time.monotonic() < deadline, "no subscription"
    assert pub.recv() == b"\x01"
    for frames in sent:
        pub.send_multipart(frames)
    drain = drain_module.drain()
    assert drain is not None
    items = drain(sub.underlying, 64, 4096, False, 2)
    kinds = [(item[0], item[1][:2] if item[0] != 1 else None) for item in items]
    got = []
    for item in items:
        if item[0] == 0:
            _, topic, peer, seq, payloads, scanned = item
            batch = ScannedBatch(payloads, scanned)
            assert peer is None  # only bind mode asks for the sender's address
            if len(payloads) > 1:
                assert_is_the_batches_in_turn(batch, payloads)
            got.append(("group", topic, seq, len(payloads)))
        elif item[0] == 1:
            got.append(("single", item[1][0], int.from_bytes(item[1][1], "big")))
        else:
            got.append(("bad", item[1], item[2]))
    assert got == [
        ("group", a, 0, 2),  # group_max 2
        ("group", a, 2, 1),
        ("group", b, 0, 1),
        ("group", a, 3, 1),
        ("group", a, 5, 2),
        ("group", a, 7, 1),
        ("single", a, 8),
        ("bad", "bad_frame_count", 2),
        ("bad", "bad_seq_frame", 9),
        ("bad", "payload_too_large", len(good[8]) + 4096),
        ("group", a, 10, 2),
        ("group", a, 12, 1),
    ], kinds
    assert drain(sub.underlying, 64, 4096, False, 2) == []  # nothing left: no wait
    pub.close(0)
    sub.close(0)


@needs_drain
def test_the_drain_reads_the_senders_address_in_bind_mode(ctx: zmq.Context) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    payload = RELEASES[-1].encode_batch([BlockRemoved([1], "GPU")], 1.0, 0)
    drain = drain_module.drain()
    assert drain is not None
    items: list = []
    deadline = time.monotonic() + 10
    seq = 0
    while not items and time.monotonic() < deadline:  # until the subscription is through
        pub.send_multipart(_frames(b"kv@127.0.0.1:8000@m", seq, payload))
        seq += 1
        time.sleep(0.01)
        items = drain(sub.underlying, 64, 1 << 20, True, 64)
    assert items and items[0][0] == 0 and items[0][2] == "127.0.0.1"
    pub.close(0)
    sub.close(0)


# -- the inbox counts messages ------------------------------------------------------------


@needs_scanner
def test_a_group_past_the_lane_capacity_keeps_its_oldest_messages() -> None:
    payloads = encoded(RELEASES[-1], [[BlockRemoved([i], "GPU")] for i in range(8)])
    group = ScannedBatch.merge([scan(p) for p in payloads])  # type: ignore[misc]
    sid = StreamId("127.0.0.1:8000")
    errors, overflowed = ReasonCounts(), []
    inbox = Inbox(5, 10, errors, lambda s, c: overflowed.append(s), lambda s: None)

    def arrival(seq: int, batch: ScannedBatch) -> Arrival:
        return Arrival(
            sid, "m", seq, batch.payloads[-1], 1.0, None,
            decoded=DecodedBatch(batch, batch.layout), batches=batch.batches,
        )  # fmt: skip

    inbox.put_arrivals([arrival(0, scan(payloads[0]))])  # type: ignore[arg-type]
    inbox.put_arrivals([arrival(1, ScannedBatch.merge(group.parts()[1:]))])  # seqs 1..7
    lane = inbox.lane(sid)
    assert lane is not None and len(lane) == 5 and lane.received == 8
    assert lane.overflows == 3 and errors.snapshot()["queue_overflow"] == 3
    assert inbox.peek_dropped(lane) == 7 and overflowed == [sid]
    taken = inbox.pop(lane, 100)
    assert [a.seq for a in taken] == [0, 1, 2, 3, 4]  # split: the newest three dropped
    assert [a.payload for a in taken] == payloads[:5]
    assert len(lane) == 0


@needs_scanner
def test_pop_takes_whole_groups_up_to_the_turn() -> None:
    payloads = encoded(RELEASES[-1], [[BlockRemoved([i], "GPU")] for i in range(6)])
    scans = [scan(p) for p in payloads]
    sid = StreamId("127.0.0.1:8000")
    inbox = Inbox(100, 10, ReasonCounts(), lambda s, c: None, lambda s: None)
    arrivals = []
    for seq, chunk in ((0, scans[0:3]), (3, scans[3:5]), (5, scans[5:6])):
        batch = chunk[0] if len(chunk) == 1 else ScannedBatch.merge(chunk)  # type: ignore[arg-type]
        arrivals.append(
            Arrival(sid, "m", seq, batch.payloads[-1], 1.0, None,  # type: ignore[union-attr]
                    decoded=DecodedBatch(batch, batch.layout), batches=batch.batches)  # type: ignore[union-attr]
        )  # fmt: skip
    inbox.put_arrivals(arrivals)
    lane = inbox.lane(sid)
    assert lane is not None and len(lane) == 6
    assert [a.seq for a in inbox.pop(lane, 4)] == [0]  # 3 + 2 > 4: the turn ends at 3
    assert [a.seq for a in inbox.pop(lane, 1)] == [3]  # at least one arrival, whole
    assert [a.seq for a in inbox.pop(lane, 4)] == [5]
    assert len(lane) == 0


# -- through a live subscriber -----------------------------------------------------------


class RawSink(RecordingSink):
    """Keeps the deliveries as the subscriber made them (besides per batch), and holds the
    first delivery until released so the rest pile up."""

    def __init__(self) -> None:
        super().__init__()
        self.raw: list[Delivery] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def deliver(self, deliveries: Sequence[Delivery]) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10), "test never released the sink"
        self.raw += deliveries
        super().deliver(deliveries)


@pytest.mark.parametrize("compiled_drain", [True, False])
def test_a_backlog_is_delivered_in_runs_in_order(
    ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch, compiled_drain: bool
) -> None:
    if not compiled_drain:
        monkeypatch.setattr(drain_module, "_drain", None)
    sink = RawSink()
    sub = Subscriber(sink, SubscriberConfig(batches_per_turn=16))
    sub.start()
    pub = EnginePublisher("tcp://127.0.0.1:0", bind=True, context=ctx)
    try:
        sub.connect(PodEndpoint(pub.endpoint, pod="127.0.0.1:8000", model="m"))
        assert pub.wait_for_subscribers(1)
        pub.publish([BlockStored([0], None, [1] * 16, 16)])
        assert sink.entered.wait(5)  # the applier waits in the sink: the rest queue up
        for i in range(1, 100):
            pub.publish([BlockStored([i], None, [1] * 16, 16)])
        assert wait_until(lambda: sub.streams()[0].received == 100)
        sink.release.set()
        assert sink.wait_for_count(100)
    finally:
        sub.stop()
        pub.close()
    assert sink.seqs() == list(range(100))
    hashes = [h for d in sink.deliveries for e in d.batch.events for h in e.block_hashes]
    assert hashes == list(range(100))
    assert sum(d.batches for d in sink.raw) == 100
    if COMPILED:
        assert len(sink.raw) < 20  # runs of up to 16, not one delivery per batch
        assert max(d.batches for d in sink.raw) > 1
    for d in sink.raw:
        assert d.last_seq == d.seq + d.batches - 1
    status = sub.streams()[0]
    assert status.delivered == 100 and status.last_seq == 99 and status.state == "live"


def _singles(sid: StreamId, seqs: range, payload_events: int = 1) -> list[Arrival]:
    payload = RELEASES[-1].encode_batch(
        [BlockRemoved(list(range(32)), "GPU")] * payload_events, 1.0, 0
    )
    out = []
    for seq in seqs:
        decoded = BatchDecoder().decode(payload)
        out.append(Arrival(sid, "m", seq, payload, 1.0, None, decoded=decoded))
    return out


def test_a_flooding_stream_is_cut_at_its_share_of_the_memory_budget() -> None:
    a, b = StreamId("127.0.0.1:8000"), StreamId("127.0.0.2:8000")
    size = _singles(a, range(1))[0].nbytes
    errors = ReasonCounts()
    inbox = Inbox(10_000, 10, errors, lambda s, c: None, lambda s: None, budget=100 * size)
    inbox.put_arrivals(_singles(a, range(300)))  # alone: the whole budget is its share
    lane_a = inbox.lane(a)
    assert lane_a is not None and len(lane_a) == 100 and lane_a.overflows == 200
    assert inbox.peek_dropped(lane_a) == 299 and inbox.queued_bytes == 100 * size
    inbox.put_arrivals(_singles(b, range(80)))  # over the budget, but b is under its half
    lane_b = inbox.lane(b)
    assert lane_b is not None and len(lane_b) == 50 and lane_b.overflows == 30
    assert inbox.queued_bytes == 150 * size <= 2 * inbox.budget
    assert errors.snapshot()["queue_overflow"] == 230
    assert [x.seq for x in inbox.pop(lane_a, 100)] == list(range(100))  # the oldest kept
    inbox.put_arrivals(_singles(b, range(50, 60)))  # room again
    assert len(lane_b) == 60
    inbox.take_all(lane_b)
    assert inbox.queued_bytes == 0


def test_the_default_budget_follows_the_memory_the_process_may_use() -> None:
    from kvindex.events.ingest.heap import memory_limit

    limit = memory_limit()
    assert 0 < limit <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for config, budget in (
        (SubscriberConfig(), limit // 4),
        (SubscriberConfig(queue_bytes=5 << 20), 5 << 20),
    ):
        sub = Subscriber(RecordingSink(), config)
        try:
            assert sub._inbox.budget == budget
        finally:
            sub.stop()

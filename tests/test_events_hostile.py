"""Hostile and faulty streams against a live subscriber: real sockets on loopback.

Bad replay replies, restarts kvindex never saw, losses nothing can fill, and a flood of
made-up pods. Each test ends by checking the stream is exact (the batches delivered are
the engine's, in order) or says loudly that it is not (its state).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.replay_client import END_SEQ
from kvindex.events.ingest.status import StreamStatus
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink, wait_until
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.wire.identity import make_topic
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import AllBlocksCleared, BlockStored

LOOPBACK = "tcp://127.0.0.1:0"
POD = "127.0.0.1:8000"
TOPIC = make_topic(POD, "m").encode()
FAST = {"replay_timeout_s": 5.0, "retry_initial_s": 0.02, "retry_max_s": 0.2}
END = [b"", END_SEQ, b""]


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def stored(*hashes: int) -> list[BlockStored]:
    return [BlockStored(list(hashes), None, [1] * 16 * len(hashes), 16)]


def hashes(sink: RecordingSink) -> list[int]:
    return [
        h for d in sink.deliveries for e in d.batch.events for h in getattr(e, "block_hashes", [])
    ]


def stream_of(sub: Subscriber, pod: str = POD) -> StreamStatus:
    (status,) = [s for s in sub.streams() if s.pod == pod]
    return status


def state(sub: Subscriber, pod: str = POD) -> str | None:
    found = [s.state for s in sub.streams() if s.pod == pod]
    return found[0] if found else None


class ScriptedReplay:
    """A replay ROUTER whose answers the test writes: ``answer(start, call)`` returns the
    reply messages (frames after the client id) or None to stay silent. Served on its
    own thread, bounded in time."""

    def __init__(
        self, ctx: zmq.Context, answer: Callable[[int, int], list[list[bytes]] | None]
    ) -> None:
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(LOOPBACK)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests: list[int] = []
        self._answer = answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        deadline = time.monotonic() + 60
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                if not self._sock.poll(50, zmq.POLLIN):
                    continue
                client, _, start = self._sock.recv_multipart()
                self.requests.append(int.from_bytes(start, "big"))
                replies = self._answer(self.requests[-1], len(self.requests))
                for frames in replies or ():
                    self._sock.send_multipart([client, b"", *frames])
        finally:
            self._sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Engine:
    """An EnginePublisher (0.33 layout, no replay of its own) plus the payloads it
    published, by seq, so a scripted replay can serve them - or lie about them."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.pub = EnginePublisher(LOOPBACK, bind=True, topic=TOPIC.decode(), context=ctx)
        self.sent: dict[int, bytes] = {}

    def publish(self, events: list, send: bool = True) -> int:
        payload = self.pub.encode(events)
        # Recorded before it is sent: the subscriber may ask the scripted replay for it
        # before publish_payload returns here.
        self.sent[self.pub.next_seq] = payload
        return self.pub.publish_payload(payload, send=send)

    def reply(self, seq: int) -> list[bytes]:
        return [TOPIC, seq_frame(seq), self.sent[seq]]

    def buffered_from(self, start: int) -> list[list[bytes]]:
        return [self.reply(s) for s in sorted(self.sent) if s >= start] + [END]

    def restart(self) -> None:
        self.pub.restart()
        self.sent.clear()


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def make_sub(sink: RecordingSink) -> Iterator:
    made: list[Subscriber] = []

    def make(**config: object) -> Subscriber:
        sub = Subscriber(sink, SubscriberConfig(**{**FAST, **config}))
        made.append(sub)
        return sub

    yield make
    for sub in made:
        sub.stop()


@pytest.fixture
def engine(ctx: zmq.Context) -> Iterator[Engine]:
    made = Engine(ctx)
    yield made
    made.pub.close()


def connect(sub: Subscriber, engine: Engine, replay: str | None) -> None:
    sub.connect(PodEndpoint(engine.pub.endpoint, pod=POD, model="m", replay_endpoint=replay))
    assert engine.pub.wait_for_subscribers(1)


# -- bad replay replies ----------------------------------------------------------------


def test_bad_replies_among_good_ones_are_counted_and_the_stream_ends_exact(
    ctx, sink, make_sub, engine
) -> None:
    def answer(start: int, call: int) -> list[list[bytes]]:
        return [
            engine.reply(0),  # the anchor: same digest, same engine
            [TOPIC, seq_frame(10**12), engine.sent[1]],  # far ahead
            [b"x"],  # not a reply at all
            [b"kv@127.16.6.6:8000@m", seq_frame(1), engine.sent[1]],  # another stream's
            engine.reply(1),
            [TOPIC, seq_frame(2), b"\xc1 not msgpack"],
            [TOPIC, seq_frame(0), engine.sent[0]],  # repeated
            engine.reply(2),
            engine.reply(3),
            END,
        ]

    router = ScriptedReplay(ctx, answer)
    sub = make_sub()
    sub.start()
    connect(sub, engine, router.endpoint)
    engine.publish(stored(0))
    engine.publish(stored(1), send=False)
    engine.publish(stored(2), send=False)
    engine.publish(stored(3))
    assert sink.wait_for_count(4)
    engine.publish(stored(4))
    assert sink.wait_for_count(5)
    router.close()
    assert sink.seqs() == [0, 1, 2, 3, 4] and hashes(sink) == [0, 1, 2, 3, 4]
    assert router.requests == [0]  # from the last applied seq: fills and verifies at once
    errors = sub.error_counts()
    assert {k: v for k, v in errors.items() if k.startswith("bad_replay")} == {
        "bad_replay_reply": 1,
        "bad_replay_seq_out_of_range": 1,
        "bad_replay_wrong_topic": 1,
        "bad_replay_bad_payload": 1,
        "bad_replay_seq_repeated": 1,
    }
    status = stream_of(sub)
    assert (status.state, status.missed_batches, status.replays_ok) == ("live", 0, 1)


def test_a_far_ahead_reply_never_freezes_the_stream(ctx, sink, make_sub, engine) -> None:
    router = ScriptedReplay(
        ctx, lambda start, call: [[TOPIC, seq_frame(2**62), engine.sent[0]], END]
    )
    sub = make_sub()
    sub.start()
    connect(sub, engine, router.endpoint)
    engine.publish(stored(0))
    engine.publish(stored(1), send=False)
    for n in range(2, 103):
        engine.publish(stored(n))
    assert sink.wait_for_count(102), sink.seqs()
    router.close()
    assert sink.seqs() == [0, *range(2, 103)]  # every live batch after the bad reply
    status = stream_of(sub)
    assert (status.missed_batches, status.replays_failed, status.duplicates) == (1, 1, 0)
    assert status.state == "gapped"
    assert sub.error_counts()["bad_replay_seq_out_of_range"] == 1
    assert sub.totals()["missed_batches"] == 1


def test_a_replay_from_another_engine_is_never_indexed(ctx, sink, make_sub, engine) -> None:
    # The endpoint answers with another engine's batches for the seqs kvindex holds live.
    foreign = {n: engine.pub.encode(stored(1000 + n)) for n in range(4)}
    router = ScriptedReplay(
        ctx,
        lambda start, call: [[TOPIC, seq_frame(s), foreign[s]] for s in range(start, 4)] + [END],
    )
    sub = make_sub(catch_up_on_first_contact=True)
    sub.start()
    connect(sub, engine, router.endpoint)
    engine.publish(stored(0), send=False)
    engine.publish(stored(1), send=False)
    engine.publish(stored(2))  # first contact: catch up from 0, but the reply is foreign
    assert sink.wait_for_count(1)
    router.close()
    assert hashes(sink) == [2]
    status = stream_of(sub)
    assert status.state == "incomplete" and status.replays_failed == 1
    assert sub.error_counts()["replay_foreign"] == 1


# -- restarts ----------------------------------------------------------------------------


def test_replay_cooldown_resets_with_the_engine(ctx, sink, make_sub, engine) -> None:
    # The first replay gets no answer (the endpoint was down): a long cooldown starts.
    router = ScriptedReplay(
        ctx, lambda start, call: None if call == 1 else engine.buffered_from(start)
    )
    sub = make_sub(replay_timeout_s=0.5, retry_max_s=60.0)
    sub.start()
    connect(sub, engine, router.endpoint)
    engine.publish(stored(0))
    engine.publish(stored(1), send=False)
    engine.publish(stored(2))
    assert sink.wait_for_count(2)
    assert wait_until(lambda: stream_of(sub).replays_failed == 1)
    assert state(sub) == "gapped"
    # The engine restarts; its first batch is lost live but still in its buffer. The new
    # engine owes nothing to the old one's cooldown: its batch is fetched.
    engine.restart()
    engine.publish(stored(10), send=False)
    engine.publish(stored(11))
    assert sink.wait_for_count(4)
    router.close()
    kinds = [(kind, getattr(item, "seq", None)) for kind, item in sink.log]
    assert kinds == [
        ("deliver", 0),
        ("deliver", 2),
        ("reset", None),
        ("deliver", 0),
        ("deliver", 1),
    ]
    assert hashes(sink)[2:] == [10, 11]
    assert router.requests == [0, 0]
    assert state(sub) == "live"


def test_a_restart_kvindex_never_saw_is_detected_and_old_blocks_dropped(
    ctx, sink, make_sub
) -> None:
    sub = make_sub()
    sub.start()
    with EnginePublisher(LOOPBACK, bind=True, replay_endpoint=LOOPBACK, context=ctx) as pub:
        sub.connect(
            PodEndpoint(pub.endpoint, pod=POD, model="m", replay_endpoint=pub.replay_endpoint)
        )
        assert pub.wait_for_subscribers(1)
        for n in range(3):
            pub.publish(stored(n))
        assert sink.wait_for_count(3)
        # The engine restarts and overtakes its old seq before kvindex hears from it:
        # seen live, seq 5 is just a gap after 2.
        pub.restart()
        for n in range(5):
            pub.publish(stored(100 + n), send=False)
        pub.publish(stored(105))
        assert sink.wait_for_count(9), sink.seqs()
    kinds = [(kind, getattr(item, "seq", None)) for kind, item in sink.log]
    assert kinds == [
        ("deliver", 0), ("deliver", 1), ("deliver", 2), ("reset", None),
        *[("deliver", n) for n in range(6)],
    ]  # fmt: skip
    assert sink.resets[0].reason == "engine_restart"
    assert hashes(sink)[3:] == [100, 101, 102, 103, 104, 105]
    status = stream_of(sub)
    assert (status.restarts, status.state, status.missed_batches) == (1, "live", 0)
    assert sub.error_counts()["unseen_restart"] == 1


# -- incomplete --------------------------------------------------------------------------


def test_incomplete_until_the_engine_clears_or_restarts(ctx, sink, make_sub, engine) -> None:
    sub = make_sub()
    sub.start()
    for n in range(3):  # published before kvindex listened; nothing can fetch them
        engine.publish(stored(n), send=False)
    connect(sub, engine, None)
    engine.publish(stored(3))
    assert sink.wait_for_count(1)
    status = stream_of(sub)
    assert (status.state, status.first_seq, status.missed_batches) == ("incomplete", 3, 0)
    engine.publish([AllBlocksCleared()])  # the engine forgot everything: complete again
    assert sink.wait_for_count(2) and wait_until(lambda: state(sub) == "live")
    engine.publish(stored(5))
    engine.publish(stored(6), send=False)
    engine.publish(stored(7))
    assert sink.wait_for_count(4)
    assert wait_until(lambda: state(sub) == "gapped")
    engine.restart()  # a new engine starts from nothing: its stream is complete
    engine.publish(stored(20))
    assert sink.wait_for_count(5)
    assert state(sub) == "live" and [r.reason for r in sink.resets] == ["engine_restart"]


def test_history_past_the_replay_buffer_is_incomplete(ctx, sink, make_sub) -> None:
    sub = make_sub()
    sub.start()
    with EnginePublisher(
        LOOPBACK, bind=True, replay_endpoint=LOOPBACK, buffer_steps=2, context=ctx
    ) as pub:
        for n in range(5):
            pub.publish(stored(n), send=False)
        sub.connect(
            PodEndpoint(pub.endpoint, pod=POD, model="m", replay_endpoint=pub.replay_endpoint)
        )
        assert pub.wait_for_subscribers(1)
        pub.publish(stored(5))  # first contact: the buffer holds only 4 and 5
        assert sink.wait_for_count(2)
    assert sink.seqs() == [4, 5]
    status = stream_of(sub)
    assert status.state == "incomplete" and status.missed_batches == 0
    assert sub.error_counts()["incomplete_streams"] == 1


# -- the stream table --------------------------------------------------------------------


def test_a_flood_of_fake_pods_does_not_lock_out_a_real_one(ctx, sink, make_sub) -> None:
    # The table, not bind mode's door, is under test: pods in 127/8 may send from loopback,
    # with no per-sender stream cap (the flood and the real pod share 127.0.0.1).
    sub = make_sub(
        max_streams=4, stream_evict_idle_s=0.5, default_serving_port=8000,
        bind_allow=("127.0.0.0/8",), max_streams_per_sender=1_000_000,
    )  # fmt: skip
    endpoint = sub.bind(LOOPBACK)
    sub.start()
    real_pod = "127.10.0.7:8000"
    flood = EnginePublisher(endpoint, topic=make_topic("127.19.0.1", "m"), context=ctx)
    real = EnginePublisher(endpoint, topic=make_topic(real_pod, "m"), context=ctx)
    assert flood.wait_for_subscribers(1) and real.wait_for_subscribers(1)
    payload = flood.encode(stored(1))
    fakes = iter(range(10_000))

    def fake() -> None:  # one batch under a made-up pod's topic
        n = next(fakes)
        topic = make_topic(f"127.19.{n // 200}.{n % 200 + 1}", "m").encode()
        flood.send_frames([topic, seq_frame(0), payload])

    for _ in range(4):
        fake()
    assert wait_until(lambda: len(sub.streams()) == 4 and sink.wait_for_count(4, 0.01))
    real.publish(stored(7))  # every slot holds a fake that just spoke: refused for now
    assert wait_until(lambda: sub.error_counts().get("too_many_streams", 0) >= 1)
    # The flood goes on; the real pod keeps publishing and gets in once fakes go quiet.
    deadline = time.monotonic() + 10
    while state(sub, real_pod) is None and time.monotonic() < deadline:
        fake()
        real.publish(stored(7))
        time.sleep(0.05)
    assert state(sub, real_pod) is not None, sub.streams()
    admitted_from = stream_of(sub, real_pod).first_seq
    for _ in range(40):  # the flood cannot push an active pod out
        fake()
        real.publish(stored(7))
        time.sleep(0.02)
    last = real.next_seq - 1
    assert wait_until(lambda: stream_of(sub, real_pod).last_seq == last)
    real_seqs = [d.seq for d in sink.deliveries if d.stream.pod == real_pod]
    assert real_seqs == list(range(admitted_from, last + 1))
    assert len(sub.streams()) <= 4
    evicted = [r for r in sink.resets if r.reason == "stream_evicted"]
    assert evicted and all(r.stream.pod != real_pod for r in sink.resets)
    assert sub.error_counts()["stream_evicted"] == len(evicted)
    flood.close()
    real.close()


def test_idle_unpinned_streams_are_evicted_pinned_ones_stay(ctx, sink, make_sub) -> None:
    sub = make_sub(stream_idle_s=0.3, default_serving_port=8000, bind_allow=("127.0.0.0/8",))
    endpoint = sub.bind(LOOPBACK)
    sub.start()
    with (
        EnginePublisher(endpoint, topic=make_topic("127.10.0.1", "m"), context=ctx) as bound,
        EnginePublisher(LOOPBACK, bind=True, context=ctx) as connected,
    ):
        sub.connect(PodEndpoint(connected.endpoint, pod="127.10.0.2:8000", model="m"))
        assert bound.wait_for_subscribers(1) and connected.wait_for_subscribers(1)
        bound.publish(stored(1))
        connected.publish(stored(2))
        assert sink.wait_for_count(2)
        assert sink.wait_for(lambda s: len(s.resets) == 1)
    (reset,) = sink.resets
    assert reset.stream.pod == "127.10.0.1:8000" and reset.reason == "stream_evicted"
    assert [s.pod for s in sub.streams()] == ["127.10.0.2:8000"]


def test_a_resubscribed_pod_is_verified_before_it_reads_live(ctx, sink, make_sub) -> None:
    sub = make_sub()
    sub.start()
    with EnginePublisher(LOOPBACK, bind=True, replay_endpoint=LOOPBACK, context=ctx) as pub:
        target = PodEndpoint(pub.endpoint, pod=POD, model="m", replay_endpoint=pub.replay_endpoint)
        sub.connect(target)
        assert pub.wait_for_subscribers(1)
        for n in range(3):
            pub.publish(stored(n))
        assert sink.wait_for_count(3)
        # While kvindex was away the engine restarted and published exactly as many
        # batches as before: seq 3 comes next, in sequence, from another incarnation.
        pub.restart()
        for n in range(3):
            pub.publish(stored(100 + n), send=False)
        sub.connect(target)  # re-subscribed (discovery saw the pod again)
        pub.publish(stored(103))
        assert sink.wait_for_count(7), sink.seqs()
    kinds = [(kind, getattr(item, "seq", None)) for kind, item in sink.log]
    assert kinds == [
        ("deliver", 0), ("deliver", 1), ("deliver", 2), ("reset", None),
        ("deliver", 0), ("deliver", 1), ("deliver", 2), ("deliver", 3),
    ]  # fmt: skip
    assert hashes(sink)[3:] == [100, 101, 102, 103]
    assert stream_of(sub).state == "live" and sub.error_counts()["unseen_restart"] == 1


def test_a_pod_discovered_after_its_stream_opened_keeps_it(ctx, sink) -> None:
    discovered: set[str] = set()
    config = SubscriberConfig(
        **{**FAST, "stream_idle_s": 0.3, "default_serving_port": 8000},
        bind_allow=("127.0.0.0/8",),  # pods in 127/8 may send from loopback
    )
    sub = Subscriber(sink, config, pod_known=lambda pod: pod in discovered)
    endpoint = sub.bind(LOOPBACK)
    sub.start()
    try:
        with (
            EnginePublisher(endpoint, topic=make_topic("127.10.0.1", "m"), context=ctx) as known,
            EnginePublisher(endpoint, topic=make_topic("127.10.0.3", "m"), context=ctx) as stranger,
        ):
            assert known.wait_for_subscribers(1) and stranger.wait_for_subscribers(1)
            known.publish(stored(1))
            stranger.publish(stored(2))
            assert sink.wait_for_count(2)
            discovered.add("127.10.0.1:8000")  # discovery saw the pod only now
            assert sink.wait_for(lambda s: len(s.resets) == 1)
        assert [r.stream.pod for r in sink.resets] == ["127.10.0.3:8000"]
        assert [s.pod for s in sub.streams()] == ["127.10.0.1:8000"]
    finally:
        sub.stop()


class SteppedClock:
    """time.time, plus an offset the test moves forward (a silence without sleeping)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def test_a_silent_stream_is_verified_before_it_reads_live(ctx, sink) -> None:
    clock = SteppedClock()
    sub = Subscriber(sink, SubscriberConfig(**FAST), clock=clock)
    sub.start()
    try:
        with EnginePublisher(LOOPBACK, bind=True, replay_endpoint=LOOPBACK, context=ctx) as pub:
            sub.connect(
                PodEndpoint(pub.endpoint, pod=POD, model="m", replay_endpoint=pub.replay_endpoint)
            )
            assert pub.wait_for_subscribers(1)
            for n in range(3):
                pub.publish(stored(n))
            assert sink.wait_for_count(3)
            # A minute of silence, during which the engine restarted and its first three
            # batches never reached kvindex: seq 3 continues the old numbering exactly.
            pub.restart()
            for n in range(3):
                pub.publish(stored(100 + n), send=False)
            clock.offset += 60.0
            pub.publish(stored(103))
            assert sink.wait_for_count(7), sink.seqs()
            pub.publish(stored(104))  # no silence: applied as it comes
            assert sink.wait_for_count(8)
        kinds = [(kind, getattr(item, "seq", None)) for kind, item in sink.log]
        assert kinds == [
            ("deliver", 0), ("deliver", 1), ("deliver", 2), ("reset", None),
            *[("deliver", n) for n in range(5)],
        ]  # fmt: skip
        assert hashes(sink)[3:] == [100, 101, 102, 103, 104]
        assert stream_of(sub).state == "live" and stream_of(sub).replays_ok == 2
    finally:
        sub.stop()


def test_a_silence_that_hid_nothing_costs_one_verification(ctx, sink) -> None:
    clock = SteppedClock()
    sub = Subscriber(sink, SubscriberConfig(**FAST), clock=clock)
    sub.start()
    try:
        with EnginePublisher(LOOPBACK, bind=True, replay_endpoint=LOOPBACK, context=ctx) as pub:
            sub.connect(
                PodEndpoint(pub.endpoint, pod=POD, model="m", replay_endpoint=pub.replay_endpoint)
            )
            assert pub.wait_for_subscribers(1)
            pub.publish(stored(0))
            assert sink.wait_for_count(1)
            clock.offset += 60.0
            pub.publish(stored(1))
            pub.publish(stored(2))
            assert sink.wait_for_count(3)
        assert sink.seqs() == [0, 1, 2] and sink.resets == []
        status = stream_of(sub)
        assert (status.state, status.replays_ok, status.restarts) == ("live", 1, 0)
    finally:
        sub.stop()

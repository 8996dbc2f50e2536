"""The subscriber end to end: real sockets on loopback, both topologies, recovery paths."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import msgspec
import pytest
import zmq

from kvindex.api.testing import free_port
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.sink import Delivery
from kvindex.events.ingest.status import StreamStatus
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink, wait_until
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.wire.identity import StreamId, make_topic
from kvindex.events.wire.layouts import EngineBlockStored
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import AllBlocksCleared, BlockRemoved, BlockStored

VERSIONS = ["0.9", "0.10.2", "0.14", "0.17", "0.20", "0.22", "0.24", "0.26", "0.29", "0.33"]
LOOPBACK = "tcp://127.0.0.1:0"
POD = "127.0.0.1:8000"
# Short retries keep sink-failure tests quick; replays get a generous timeout except
# where a test wants one to fail (a slow CI box must not turn a replay into a gap).
FAST = {"replay_timeout_s": 5.0, "retry_initial_s": 0.02, "retry_max_s": 0.2}


@pytest.fixture
def sink() -> RecordingSink:
    return RecordingSink()


@pytest.fixture
def make_sub(sink: RecordingSink) -> Iterator:
    made: list[Subscriber] = []

    def make(target: RecordingSink | None = None, **config: object) -> Subscriber:
        sub = Subscriber(target or sink, SubscriberConfig(**{**FAST, **config}))
        made.append(sub)
        return sub

    yield make
    for sub in made:
        sub.stop()


def publisher(
    ctx: zmq.Context, version: str = "0.33", replay: bool = True, **kw
) -> EnginePublisher:
    return EnginePublisher(
        LOOPBACK,
        bind=True,
        replay_endpoint=LOOPBACK if replay else None,
        vllm_version=version,
        context=ctx,
        **kw,
    )


def attach(sub: Subscriber, pub: EnginePublisher, pod: str = POD, model: str = "m", **kw) -> None:
    """Connect ``sub`` to ``pub`` (connect mode) and wait until subscribed."""
    sub.connect(
        PodEndpoint(pub.endpoint, pod=pod, model=model, replay_endpoint=pub.replay_endpoint, **kw)
    )
    assert pub.wait_for_subscribers(1), "subscriber never subscribed"


def stream_of(sub: Subscriber, pod: str = POD, rank: int = 0) -> StreamStatus:
    for status in sub.streams():
        if status.pod == pod and status.rank == rank:
            return status
    raise AssertionError(f"no stream {pod} rank {rank}: {sub.streams()}")


def stat(sub: Subscriber, name: str, pod: str = POD, rank: int = 0) -> int:
    """One counter of a stream, 0 while the stream does not exist yet (for waits)."""
    for status in sub.streams():
        if status.pod == pod and status.rank == rank:
            return getattr(status, name)
    return 0


def stored(*hashes: int) -> list[BlockStored]:
    return [BlockStored(list(hashes), None, [1] * 16 * len(hashes), 16)]


def hashes(deliveries: Sequence[Delivery]) -> list[int]:
    return [h for d in deliveries for e in d.batch.events for h in getattr(e, "block_hashes", [])]


# -- layouts through the live path ----------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_layout_through_the_live_subscriber(ctx, sink, make_sub, version) -> None:
    sub = make_sub()
    sub.start()
    with publisher(ctx, version, data_parallel_rank=0) as pub:
        attach(sub, pub)
        event = EngineBlockStored(
            [2**63, 2**64 - 1], 2**63 + 1, list(range(32)), 16, 1, "CPU", "lora", [["lora"], None],
            0, "full", None, locality="LOCAL", ownership="x", session_id="s",
            lookahead_token_ids=[[1], [2]],
        )  # fmt: skip
        pub.publish([event, BlockRemoved([5], "GPU"), AllBlocksCleared()], ts=123.0)
        assert sink.wait_for_count(1)
    (delivery,) = sink.deliveries
    assert delivery.stream == StreamId(POD, 0)
    assert delivery.model == "m" and delivery.seq == 0 and not delivery.replayed
    assert delivery.batch.ts == 123.0
    got_stored, got_removed, got_cleared = delivery.batch.events
    assert got_stored.block_hashes == [2**63, 2**64 - 1]
    assert got_stored.parent_block_hash == 2**63 + 1
    assert got_stored.medium == (None if version == "0.9" else "CPU")
    assert isinstance(got_removed, BlockRemoved) and got_removed.block_hashes == [5]
    assert isinstance(got_cleared, AllBlocksCleared)
    status = stream_of(sub)
    assert status.layout == ("map" if version in ("0.24", "0.26", "0.29", "0.33") else "array")
    assert status.state == "live" and status.delivered == 1
    assert sub.event_counts() == {"BlockStored": 1, "BlockRemoved": 1, "AllBlocksCleared": 1}
    assert sub.error_counts() == {}


# -- topologies --------------------------------------------------------------------------


def test_bind_mode_two_pods_by_topic(ctx, sink, make_sub) -> None:
    # 127.10.0.x pods send from 127.0.0.1, not their host: allowlisted, as pods behind NAT would be.
    sub = make_sub(default_serving_port=8000, bind_allow=("127.10.0.0/24",))
    endpoint = sub.bind(LOOPBACK)
    assert not endpoint.endswith(":0")
    sub.start()
    pubs = [
        EnginePublisher(endpoint, topic=make_topic(pod, "org/model@v2"), context=ctx)
        for pod in ("127.10.0.1", "127.10.0.2:9000")
    ]
    for pub in pubs:
        assert pub.wait_for_subscribers(1)
    pubs[0].send_frames([b"not-a-kv-topic", (0).to_bytes(8, "big"), b"\x90"])  # filtered out
    pubs[0].send_frames([b"kv@@m", (0).to_bytes(8, "big"), pubs[0].encode(stored(1))])
    for i in range(3):
        for n, pub in enumerate(pubs):
            pub.publish(stored(100 * n + i))
    assert sink.wait_for_count(6)
    by_pod = {(d.stream.pod, d.seq) for d in sink.deliveries}
    assert by_pod == {(p, s) for p in ("127.10.0.1:8000", "127.10.0.2:9000") for s in range(3)}
    assert {d.model for d in sink.deliveries} == {"org/model@v2"}
    assert sub.error_counts() == {"bad_topic": 1}
    for pub in pubs:
        pub.close()


def test_connect_mode_identity_sources(ctx, sink, make_sub) -> None:
    sub = make_sub(default_serving_port=8000, default_model="fallback")
    sub.start()
    with (
        publisher(ctx, topic="") as plain,
        publisher(ctx, topic="kv@127.19.9.9:7000@from-topic") as topical,
        publisher(ctx, topic="") as anonymous,
    ):
        attach(sub, plain, pod="127.10.0.5", model=None)  # normalised with the default port
        attach(sub, topical, pod="127.10.0.6:8000", model="ignored")  # the topic wins
        sub.connect(PodEndpoint(anonymous.endpoint))  # pod from the endpoint's host
        assert anonymous.wait_for_subscribers(1)
        for pub in (plain, topical, anonymous):
            pub.publish(stored(1))
        assert sink.wait_for_count(3)
    got = {(d.stream.pod, d.model) for d in sink.deliveries}
    assert got == {
        ("127.10.0.5:8000", "fallback"),
        ("127.19.9.9:7000", "from-topic"),
        ("127.0.0.1:8000", "fallback"),
    }


def test_connect_mode_without_model_is_counted(ctx, sink, make_sub) -> None:
    sub = make_sub()
    sub.start()
    with publisher(ctx) as pub:
        attach(sub, pub, model=None)
        pub.publish(stored(1))
        assert wait_until(lambda: sub.error_counts().get("unknown_model") == 1)
    assert sink.deliveries == []


def test_connect_mode_topics_inventing_models_are_capped(ctx, sink, make_sub) -> None:
    """A configured pod is still held to ``max_models``; its own configured model is not."""
    sub = make_sub(max_models=2)
    sub.start()
    with publisher(ctx) as pub:
        attach(sub, pub, model="own")
        payload = pub.encode(stored(1))
        for seq in range(6):
            topic = f"kv@{POD}@made-up-{seq % 4}".encode()  # four names, two admitted
            pub.send_frames([topic, seq.to_bytes(8, "big"), payload])
        pub.send_frames([b"not-kv", (6).to_bytes(8, "big"), payload])  # the endpoint's model
        assert wait_until(lambda: sub.error_counts().get("model_cap") == 2)
        assert sink.wait_for_count(5)
    assert [d.model for d in sink.deliveries] == [
        "made-up-0", "made-up-1", "made-up-0", "made-up-1", "own",
    ]  # fmt: skip


def test_connect_and_disconnect_while_running(ctx, sink, make_sub) -> None:
    sub = make_sub()
    sub.start()
    with publisher(ctx) as pub:
        attach(sub, pub)
        pub.publish(stored(1))
        assert sink.wait_for_count(1)
        assert sub.disconnect(pub.endpoint)
        assert not sub.disconnect(pub.endpoint)
        assert sub.endpoints() == []
    assert sub.is_running()
    sub.stop()
    assert not sub.is_running()


# -- gaps and replay ---------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.22", "0.25", "0.26", "0.33"])
def test_gap_recovered_by_replay_connect_mode(ctx, sink, make_sub, version) -> None:
    sub = make_sub()
    sub.start()
    with publisher(ctx, version) as pub:
        attach(sub, pub)
        pub.publish(stored(0))
        pub.publish(stored(1), send=False)
        pub.publish(stored(2), send=False)
        pub.publish(stored(3))
        assert sink.wait_for_count(4)
        pub.publish(stored(4))
        assert sink.wait_for_count(5)
    assert sink.seqs() == [0, 1, 2, 3, 4]
    assert hashes(sink.deliveries) == [0, 1, 2, 3, 4]
    # The replay was requested after seq 3 arrived, so it brought 1..3.
    assert [d.replayed for d in sink.deliveries] == [False, True, True, True, False]
    status = stream_of(sub)
    assert (status.gaps, status.replays_ok, status.missed_batches) == (1, 1, 0)
    assert status.duplicates == 1  # seq 3 arrived live after the replay applied it
    assert status.state == "live"


@pytest.mark.parametrize("version", ["0.25", "0.26"])
def test_gap_recovered_by_replay_bind_mode(ctx, sink, make_sub, version) -> None:
    # Bind mode derives the replay endpoint from the pod's host and replay_port, which
    # the subscriber must know before the engine exists: pick a free port, and pick
    # again in the rare case another process takes it first.
    for _ in range(20):
        replay_port = free_port()
        sub = make_sub(replay_port=replay_port)
        endpoint = sub.bind(LOOPBACK)
        try:
            pub = EnginePublisher(
                endpoint,
                topic=make_topic(POD, "m"),
                replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                vllm_version=version,
                context=ctx,
            )
            break
        except zmq.ZMQError:
            sub.stop()
    sub.start()
    with pub:
        assert pub.wait_for_subscribers(1)
        pub.publish(stored(0))
        pub.publish(stored(1), send=False)
        pub.publish(stored(2))
        assert sink.wait_for_count(3)
    assert sink.seqs() == [0, 1, 2]
    assert stream_of(sub).replay_endpoint == f"tcp://127.0.0.1:{replay_port}"
    assert stream_of(sub).replays_ok == 1


@pytest.mark.parametrize("dead", ["silent_router", "nothing_listening"])
def test_dead_replay_endpoint_marks_gapped_and_goes_on(ctx, sink, make_sub, dead) -> None:
    router = None
    if dead == "silent_router":
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(LOOPBACK)
        replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
    else:
        replay = f"tcp://127.0.0.1:{free_port()}"
    sub = make_sub(replay_timeout_s=0.3)
    sub.start()
    with publisher(ctx, replay=False) as pub:
        sub.connect(PodEndpoint(pub.endpoint, pod=POD, model="m", replay_endpoint=replay))
        assert pub.wait_for_subscribers(1)
        pub.publish(stored(0))
        pub.publish(stored(1), send=False)
        pub.publish(stored(2), send=False)
        pub.publish(stored(3))
        pub.publish(stored(4))
        assert sink.wait_for_count(3)
    assert sink.seqs() == [0, 3, 4]
    status = stream_of(sub)
    assert status.state == "gapped"
    assert (status.gaps, status.missed_batches, status.replays_failed) == (1, 2, 1)
    assert sub.error_counts()["replay_timeout"] == 1
    assert sub.error_counts()["missed_batches"] == 2
    if router is not None:
        router.close()


def test_gap_without_replay_endpoint(ctx, sink, make_sub) -> None:
    sub = make_sub()
    sub.start()
    with publisher(ctx, replay=False) as pub:
        attach(sub, pub)
        pub.publish(stored(0))
        pub.publish(stored(1), send=False)
        pub.publish(stored(2))
        assert sink.wait_for_count(2)
    assert sink.seqs() == [0, 2]
    assert stream_of(sub).missed_batches == 1 and stream_of(sub).replays_failed == 0


def test_first_contact_catches_up_from_zero(ctx, sink, make_sub) -> None:
    sub = make_sub()
    with publisher(ctx) as pub:
        for i in range(3):  # published before kvindex was listening
            pub.publish(stored(i), send=False)
        sub.start()
        attach(sub, pub)
        pub.publish(stored(3))
        assert sink.wait_for_count(4)
    assert sink.seqs() == [0, 1, 2, 3]
    status = stream_of(sub)
    assert status.first_seq == 0 and status.missed_batches == 0 and status.gaps == 0


def test_first_contact_without_catch_up(ctx, sink, make_sub) -> None:
    sub = make_sub(catch_up_on_first_contact=False)
    sub.start()
    with publisher(ctx) as pub:
        for i in range(3):
            pub.publish(stored(i), send=False)
        attach(sub, pub)
        pub.publish(stored(3))
        pub.publish(stored(4))
        assert sink.wait_for_count(2)
    assert sink.seqs() == [3, 4]
    assert stream_of(sub).first_seq == 3 and stream_of(sub).state == "live"


# -- restarts and removal ----------------------------------------------------------------


def test_engine_restart_resets_before_new_events(ctx, sink, make_sub) -> None:
    sub = make_sub()
    sub.start()
    with publisher(ctx) as pub:
        attach(sub, pub)
        for i in range(3):
            pub.publish(stored(i))
        assert sink.wait_for_count(3)
        pub.restart()
        pub.publish(stored(10), send=False)  # the new engine's seq 0 is lost live...
        pub.publish(stored(11))  # ...and recovered: first contact after the restart
        assert sink.wait_for_count(5)
    kinds = [(kind, getattr(item, "seq", None)) for kind, item in sink.log]
    assert kinds == [
        ("deliver", 0), ("deliver", 1), ("deliver", 2), ("reset", None), ("deliver", 0),
        ("deliver", 1),
    ]  # fmt: skip
    assert sink.resets[0].reason == "engine_restart"
    assert sink.resets[0].stream == StreamId(POD, 0)
    assert hashes(sink.deliveries[3:]) == [10, 11]
    assert stream_of(sub).restarts == 1


class GatedSink(RecordingSink):
    """Blocks inside the first deliver until released, to keep batches in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def deliver(self, deliveries: Sequence[Delivery]) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10), "test never released the sink"
        super().deliver(deliveries)


def test_forget_pod_with_batches_in_flight(ctx, make_sub) -> None:
    gated = GatedSink()
    sub = make_sub(gated, batches_per_turn=2, forget_quiet_s=60.0)
    sub.start()
    with publisher(ctx) as doomed, publisher(ctx) as other:
        attach(sub, doomed, pod="127.10.0.1:8000")
        attach(sub, other, pod="127.10.0.2:8000")
        for i in range(50):
            doomed.publish(stored(i))
        assert gated.entered.wait(5)
        assert wait_until(lambda: stat(sub, "queue_depth", "127.10.0.1:8000") > 0)
        forget = threading.Thread(target=sub.forget_pod, args=("127.10.0.1:8000",))
        forget.start()
        gated.release.set()
        forget.join(10)
        assert not forget.is_alive()
        doomed.publish(stored(999))  # its socket is gone; nothing may come back
        other.publish(stored(7))
        assert gated.wait_for(
            lambda s: any(d.stream.pod == "127.10.0.2:8000" for d in s.deliveries)
        )
    reset_at = [i for i, (kind, _) in enumerate(gated.log) if kind == "reset"]
    assert len(reset_at) == 1
    reset = gated.log[reset_at[0]][1]
    assert reset.stream == StreamId("127.10.0.1:8000") and reset.reason == "pod_removed"
    after = [item for kind, item in gated.log[reset_at[0] :] if kind == "deliver"]
    assert all(d.stream.pod != "127.10.0.1:8000" for d in after)
    assert [s.pod for s in sub.streams()] == ["127.10.0.2:8000"]
    assert len(sub.endpoints()) == 1
    # Totals keep what the forgotten pod's stream counted.
    delivered_before_reset = sum(1 for d in gated.log[: reset_at[0]] if d[0] == "deliver")
    assert sub.totals()["delivered"] == delivered_before_reset + stat(
        sub, "delivered", "127.10.0.2:8000"
    )


def test_forgotten_pod_in_bind_mode_stays_quiet(ctx, sink, make_sub) -> None:
    sub = make_sub(forget_quiet_s=60.0)
    endpoint = sub.bind(LOOPBACK)
    sub.start()
    with EnginePublisher(endpoint, topic=make_topic(POD, "m"), context=ctx) as pub:
        assert pub.wait_for_subscribers(1)
        pub.publish(stored(1))
        assert sink.wait_for_count(1)
        sub.forget_pod(POD)
        pub.publish(stored(2))  # a straggler of the deleted pod
        assert wait_until(lambda: sub.error_counts().get("forgotten_pod") == 1)
    assert sink.seqs() == [0] and [r.reason for r in sink.resets] == ["pod_removed"]
    assert sub.streams() == []


# -- back-pressure and sink failures ---------------------------------------------------


def test_queue_overflow_is_counted_and_recovered_by_replay(ctx, make_sub) -> None:
    gated = GatedSink()
    sub = make_sub(gated, queue_capacity=4, batches_per_turn=1)
    sub.start()
    with publisher(ctx) as pub:
        attach(sub, pub)
        for i in range(20):
            pub.publish(stored(i))
        assert gated.entered.wait(5)
        assert wait_until(lambda: stat(sub, "queue_overflows") > 0)
        gated.release.set()
        # No further message is needed: once the queue drains, the dropped seqs are
        # fetched by replay.
        assert gated.wait_for_count(20)
    assert gated.seqs() == list(range(20))
    assert hashes(gated.deliveries) == list(range(20))
    status = stream_of(sub)
    assert sub.error_counts()["queue_overflow"] == status.queue_overflows
    assert status.replays_ok >= 1 and status.missed_batches == 0


def test_sink_failure_resyncs_by_replay(ctx, sink, make_sub) -> None:
    sub = make_sub()
    sub.start()
    with publisher(ctx) as pub:
        attach(sub, pub)
        pub.publish(stored(0))
        assert sink.wait_for_count(1)
        sink.failing = True
        pub.publish(stored(1))
        pub.publish(stored(2))
        assert wait_until(lambda: sub.error_counts().get("sink_error", 0) >= 1)
        sink.failing = False  # the backend is back
        assert sink.wait_for_count(3)
        pub.publish(stored(3))
        assert sink.wait_for_count(4)
    assert sink.seqs() == [0, 1, 2, 3]
    assert hashes(sink.deliveries) == [0, 1, 2, 3]
    status = stream_of(sub)
    assert status.sink_errors >= 1 and status.missed_batches == 0
    assert status.state == "live"


def test_sink_failure_without_replay_is_counted_lost(ctx, sink, make_sub) -> None:
    sub = make_sub()
    sub.start()
    with publisher(ctx, replay=False) as pub:
        attach(sub, pub)
        sink.failing = True
        pub.publish(stored(0))
        assert wait_until(lambda: stat(sub, "sink_errors") >= 1)
        sink.failing = False
        pub.publish(stored(1))
        assert sink.wait_for_count(1)
    assert sink.seqs() == [1]
    assert stream_of(sub).missed_batches == 1 and stream_of(sub).state == "gapped"


def test_sink_failing_on_reset_holds_new_events(ctx, sink, make_sub) -> None:
    sub = make_sub()
    sub.start()
    with publisher(ctx) as pub:
        attach(sub, pub)
        pub.publish(stored(0))
        assert sink.wait_for_count(1)
        pub.restart()
        sink.failing = True
        pub.publish(stored(5))
        assert wait_until(lambda: sink.failed_calls >= 2)  # the reset was retried
        sink.failing = False
        assert sink.wait_for_count(2)
    assert [kind for kind, _ in sink.log] == ["deliver", "reset", "deliver"]


# -- data parallelism --------------------------------------------------------------------


def test_data_parallel_ranks_are_separate_streams(ctx, sink, make_sub) -> None:
    sub = make_sub()
    # vLLM offsets a connecting rank's endpoint too: rank r connects to the base port + r,
    # so bind mode binds one port per rank.
    base = sub.bind(LOOPBACK)
    second_port = int(sub.bind(LOOPBACK).rsplit(":", 1)[1])
    sub.start()
    topic = make_topic(POD, "m")
    pubs = [
        EnginePublisher(base, topic=topic, context=ctx),
        EnginePublisher(
            f"tcp://127.0.0.1:{second_port - 1}", topic=topic, data_parallel_rank=1, context=ctx
        ),
    ]
    for pub in pubs:
        assert pub.wait_for_subscribers(1)
    for i in range(3):
        for pub in pubs:
            pub.publish(stored(i))
    assert sink.wait_for_count(6)
    assert sink.seqs(StreamId(POD, 0)) == [0, 1, 2]
    assert sink.seqs(StreamId(POD, 1)) == [0, 1, 2]
    assert [s.member for s in sub.streams()] == [POD, f"{POD}/dp1"]
    for pub in pubs:
        pub.close()


def test_rank_from_pod_endpoint_when_batch_has_none(ctx, sink, make_sub) -> None:
    sub = make_sub()
    sub.start()
    with publisher(ctx, "0.9") as pub:
        attach(sub, pub, rank=1)
        pub.publish(stored(1))
        assert sink.wait_for_count(1)
    assert sink.deliveries[0].stream == StreamId(POD, 1)
    assert msgspec.msgpack.decode(pub.encode(stored(1)))[1:] == [
        [["BlockStored", [1], None, [1] * 16, 16, None]]
    ]


# -- limits and lifecycle ----------------------------------------------------------------


def test_max_streams_bounds_new_pods(ctx, sink, make_sub) -> None:
    sub = make_sub(max_streams=1, default_serving_port=8000, bind_allow=("a", "b"))
    endpoint = sub.bind(LOOPBACK)
    sub.start()
    pubs = [EnginePublisher(endpoint, topic=make_topic(p, "m"), context=ctx) for p in ("a", "b")]
    for pub in pubs:
        assert pub.wait_for_subscribers(1)
    pubs[0].publish(stored(1))
    assert sink.wait_for_count(1)
    pubs[1].publish(stored(2))
    assert wait_until(lambda: sub.error_counts().get("too_many_streams") == 1)
    assert [s.pod for s in sub.streams()] == ["a:8000"]
    for pub in pubs:
        pub.close()


def test_stop_while_a_replay_hangs(ctx, sink, make_sub) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(LOOPBACK)
    sub = make_sub(replay_timeout_s=0.5)
    sub.start()
    with publisher(ctx, replay=False) as pub:
        replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
        sub.connect(PodEndpoint(pub.endpoint, pod=POD, model="m", replay_endpoint=replay))
        assert pub.wait_for_subscribers(1)
        pub.publish(stored(0), send=False)
        pub.publish(stored(1))  # first contact at 1: catch-up replay to a silent ROUTER
        assert router.poll(5000, zmq.POLLIN)  # the replay request arrived
        sub.stop()  # bounded by the replay timeout
    assert not sub.is_running()
    with pytest.raises(RuntimeError):
        sub.connect(PodEndpoint("tcp://127.0.0.1:1"))
    router.close()


def test_configure_and_forget_before_start(sink) -> None:
    sub = Subscriber(sink, SubscriberConfig())
    sub.connect(PodEndpoint("tcp://127.0.0.1:1", pod="127.10.0.1:8000", model="m"))
    assert len(sub.endpoints()) == 1
    sub.forget_pod("127.10.0.1:8000")
    assert sub.endpoints() == []
    assert not sub.is_running()
    sub.stop()

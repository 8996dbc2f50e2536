"""An engine that restarts and publishes only while nobody is subscribed.

ZMQ's PUB drops what it sends before a subscription reaches it (the "slow joiner"), so
a restarted engine's first batches can exist only in its replay buffer. If the engine
then goes quiet, no later batch reveals the restart: kvindex kept the old incarnation's
blocks and read ``live`` (the conformance suite's restart phase hit this on a loaded
machine). A (re)connection now makes the pod's streams prove their position by replay
within ``verify_after_reconnect_s``, with or without a next batch. Real sockets on
loopback, both topologies; the engine's PUB is made to drop by publishing with
``send=False`` (into the replay buffer only).
"""

from __future__ import annotations

import zmq

from kvindex.api.testing import free_port
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink, wait_until
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.wire.identity import StreamId, make_topic
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored

POD = "127.0.0.1:8000"
STREAM = StreamId(POD)
FAST = {"replay_timeout_s": 5.0, "retry_initial_s": 0.02, "retry_max_s": 0.2}


def stored(*hashes: int) -> list[BlockStored]:
    return [BlockStored(list(hashes), None, [1] * 16 * len(hashes), 16)]


def status(sub: Subscriber):
    return next(s for s in sub.streams() if s.pod == POD)


def engine_on_its_ports(make: callable, attempts: int = 50) -> EnginePublisher:
    """An engine on its fixed ports. ZMQ closes sockets in its I/O thread, so a port just
    given up (by the old incarnation) may take a moment to be free again (bounded
    retries)."""
    for _ in range(attempts):
        try:
            return make()
        except zmq.ZMQError:
            wait_until(lambda: False, timeout_s=0.05)
    raise AssertionError("the old engine's ports never came free")


def old_incarnation_then_silent_restart(sink: RecordingSink, sub: Subscriber, first, second):
    """The first engine publishes three batches, live; the second publishes two that
    nobody receives, then stays quiet. The index must end on the second engine's."""
    with first() as engine:
        assert engine.wait_for_subscribers(1)
        for h in (1, 2, 3):
            engine.publish(stored(h))
        assert sink.wait_for_count(3)
    new = engine_on_its_ports(second)
    with new:
        new.publish(stored(7), send=False)  # dropped at the PUB: nobody subscribed yet
        new.publish(stored(8), send=False)
        # The new engine must answer the verifying replay, so keep it serving until then.
        assert wait_until(
            lambda: status(sub).restarts == 1 and status(sub).state == "live", timeout_s=15
        ), f"restart never found: {status(sub)}"
    assert [r.reason for r in sink.resets] == ["engine_restart"]
    after = sink.resets[0].index
    assert [d.seq for d in sink.deliveries[:after]] == [0, 1, 2]
    assert [d.seq for d in sink.deliveries[after:]] == [0, 1]
    new_engine = sink.deliveries[after:]
    assert [d.batch.events[0].block_hashes for d in new_engine] == [[7], [8]]
    assert all(d.replayed for d in new_engine)  # fetched from its buffer, not heard live


def test_bind_mode_an_engine_that_restarted_unheard_is_found_and_fetched(ctx) -> None:
    sink = RecordingSink()
    replay_port = free_port()  # known before the engine exists: bind mode derives it
    sub = Subscriber(sink, SubscriberConfig(**FAST, replay_port=replay_port))
    endpoint = sub.bind("tcp://127.0.0.1:0")
    sub.start()

    def engine() -> EnginePublisher:
        return EnginePublisher(
            endpoint,
            topic=make_topic(POD, "m"),
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            context=ctx,
        )

    try:
        first = engine_on_its_ports(engine)
        old_incarnation_then_silent_restart(sink, sub, lambda: first, engine)
    finally:
        sub.stop()


def test_connect_mode_an_engine_that_restarted_unheard_is_found_and_fetched(ctx) -> None:
    sink = RecordingSink()
    pub_port, replay_port = free_port(), free_port()
    sub = Subscriber(sink, SubscriberConfig(**FAST))
    sub.start()

    def engine() -> EnginePublisher:
        return EnginePublisher(
            f"tcp://127.0.0.1:{pub_port}",
            bind=True,
            topic=make_topic(POD, "m"),
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
            context=ctx,
        )

    first = engine_on_its_ports(engine)
    sub.connect(
        PodEndpoint(
            f"tcp://127.0.0.1:{pub_port}",
            pod=POD,
            model="m",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        )
    )
    try:
        old_incarnation_then_silent_restart(sink, sub, lambda: first, engine)
    finally:
        sub.stop()

"""An engine that restarts on the same address, reconnected by ZMQ on its own.

ZMQ reconnects a connect-mode SUB socket silently. The new engine's first batches go out
before the reconnect and are dropped (a PUB sends to nobody), so the first batch kvindex
sees can continue the old engine's seqs exactly: no gap, no seq going backwards. Only
the reconnect itself says the position must be proven; the silence check
(``verify_after_silence_s``) is set out of reach here so it cannot be what catches it.
"""

from __future__ import annotations

import time

import zmq

from kvindex.api.testing import free_port
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored

POD = "127.0.0.1:8000"


def restarted(endpoint: str, replay: str, ctx: zmq.Context) -> EnginePublisher:
    """A new engine on the old engine's addresses (ZMQ frees a closed socket's port
    asynchronously: bounded retries)."""
    for _ in range(100):
        try:
            return EnginePublisher(endpoint, bind=True, replay_endpoint=replay, context=ctx)
        except zmq.ZMQError:
            time.sleep(0.05)
    raise AssertionError(f"{endpoint} stayed in use")


def stored(key: int) -> list[BlockStored]:
    return [BlockStored([key], None, [key % 1000] * 16, 16)]


def test_a_restart_whose_seqs_continue_is_caught_at_the_zmq_reconnect(ctx) -> None:
    sink = RecordingSink()
    sub = Subscriber(sink, SubscriberConfig(verify_after_silence_s=3600.0))
    sub.start()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    old = EnginePublisher(endpoint, bind=True, replay_endpoint=replay, context=ctx)
    new = None
    try:
        sub.connect(PodEndpoint(endpoint, pod=POD, model="m", replay_endpoint=replay))
        assert old.wait_for_subscribers(1)
        for i in range(4):
            old.publish(stored(100 + i))
        assert sink.wait_for(lambda s: s.seqs() == [0, 1, 2, 3]), sink.seqs()
        old.close()
        new = restarted(endpoint, replay, ctx)
        for i in range(4):  # published before kvindex reconnected: nobody received them
            new.publish_payload(new.encode(stored(200 + i)), send=False)
        assert new.wait_for_subscribers(1, timeout_s=10.0)
        new.publish(stored(204))  # seq 4: continues the old engine's seqs
        assert sink.wait_for(lambda s: len(s.resets) == 1, timeout_s=10.0), sink.seqs()
        assert [(r.stream, r.reason) for r in sink.resets] == [(StreamId(POD), "engine_restart")]
        # After the reset, the new engine's whole history, fetched by replay.
        assert sink.wait_for(lambda s: s.seqs()[4:] == [0, 1, 2, 3, 4]), sink.seqs()
    finally:
        sub.stop()
        old.close()
        if new is not None:
            new.close()

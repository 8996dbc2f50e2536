"""Per-stream replay endpoints (issue 10 item 4): every engine replays only its own batches."""

from __future__ import annotations

import pytest
import zmq

from kvindex.api.serve.service_parts import parse_connect, replay_endpoints
from kvindex.api.serve.settings_derived import ConfigError
from kvindex.api.serve.settings_sources import from_flags
from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.replay_endpoints import (
    ReplayEndpointError,
    ReplayEndpoints,
    parse_pod_replay_endpoint,
    split_connect_spec,
    stream_replay_endpoint,
)
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink
from kvindex.events.wire.identity import StreamId, make_topic
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored


def test_the_rule_in_order() -> None:
    known = KnownPods()
    replays = ReplayEndpoints(
        {"127.10.0.1:8000": "tcp://127.10.0.1:6000"}, replay_port=5558, known=known
    )
    # 1. the operator's --replay-endpoint, offset by the rank as vLLM offsets its ports
    assert replays(StreamId("127.10.0.1:8000")) == "tcp://127.10.0.1:6000"
    assert replays(StreamId("127.10.0.1:8000", 3)) == "tcp://127.10.0.1:6003"
    # 2. the pod's annotation as discovery learned it; the flag still wins for its pod
    known.learn("127.10.0.1:8001", "tcp://127.10.0.1:7000")
    known.learn("127.10.0.1:8000", "tcp://127.10.0.1:7100")
    assert replays(StreamId("127.10.0.1:8001", 1)) == "tcp://127.10.0.1:7001"
    assert replays(StreamId("127.10.0.1:8000")) == "tcp://127.10.0.1:6000"
    # 3. the host:port rule, only as the fallback
    assert replays(StreamId("127.10.0.2:8000", 2)) == "tcp://127.10.0.2:5560"
    assert replays(StreamId("[fd00::1]:8000")) == "tcp://[fd00::1]:5558"
    known.forget("127.10.0.1:8001")
    assert replays(StreamId("127.10.0.1:8001")) == "tcp://127.10.0.1:5558"
    # 4. nothing: the gap is counted as missed
    assert ReplayEndpoints()(StreamId("127.10.0.1:8000")) is None
    assert stream_replay_endpoint(StreamId("p:1", 2), None, None) is None


def test_specs_parse_or_say_why() -> None:
    assert parse_pod_replay_endpoint("127.10.0.1=tcp://127.10.0.1:6000", 8000) == (
        "127.10.0.1:8000",
        "tcp://127.10.0.1:6000",
    )
    assert split_connect_spec("tcp://h:5557;replay=tcp://h:6000") == (
        "tcp://h:5557",
        "tcp://h:6000",
    )
    assert split_connect_spec("tcp://h:5557") == ("tcp://h:5557", None)
    for bad in ("tcp://127.10.0.1:6000", "p:1=tcp://*:6000", "p:1=ipc:///x", "p:1=tcp://h:x",
                "p:1=tcp://h:70000", "=tcp://h:1"):  # fmt: skip
        with pytest.raises(ReplayEndpointError):
            parse_pod_replay_endpoint(bad, 8000)
    with pytest.raises(ReplayEndpointError):
        split_connect_spec("tcp://h:5557;replay=tcp://*:6000")


def test_settings_reach_connect_targets() -> None:
    settings = from_flags(
        replay_port=5558, replay_endpoint=["127.10.0.2:8000=tcp://127.10.0.2:6100"], model="m"
    )
    replays = replay_endpoints(settings, None)
    own = parse_connect(
        "127.10.0.1:8000@m=tcp://127.10.0.1:5557;replay=tcp://127.10.0.1:6000", settings
    )
    assert (own.endpoint, own.pod, own.replay_endpoint) == (
        "tcp://127.10.0.1:5557", "127.10.0.1:8000", "tcp://127.10.0.1:6000",
    )  # fmt: skip
    flagged = parse_connect("tcp://127.10.0.2:5557", settings, replays)
    assert flagged.replay_endpoint == "tcp://127.10.0.2:6100"
    fallback = parse_connect("tcp://127.10.0.3:5557", settings, replays)
    assert fallback.replay_endpoint == "tcp://127.10.0.3:5558"
    with pytest.raises(ConfigError, match="replay-endpoint"):
        replay_endpoints(from_flags(replay_endpoint=["nope"]), None)
    with pytest.raises(ConfigError, match="zmq-connect"):
        parse_connect("tcp://h:1;replay=nope", settings)


def test_two_engines_on_one_host_never_replay_each_others_batches() -> None:
    """Two real publishers on 127.0.0.1, each with its own replay ROUTER, in bind mode.

    Both drop their first batches (a PUB drop); the gap each stream sees is recovered from
    its own ROUTER. With the host-wide port rule, the second pod would have been sent to
    the first pod's ROUTER and indexed its blocks.
    """
    ctx = zmq.Context()
    sink = RecordingSink()
    pods = ("127.0.0.1:8001", "127.0.0.1:8002")
    pubs: list[EnginePublisher] = []
    # The ROUTERs' ports are known only once the publishers exist: learned as discovery
    # would learn annotations. (Not handed to the subscriber: no discovered-only rule.)
    learned = KnownPods()
    sub = Subscriber(
        sink,
        SubscriberConfig(replay_timeout_s=5.0),
        context=ctx,
        replay_resolver=ReplayEndpoints(known=learned),
    )
    try:
        endpoint = sub.bind("tcp://127.0.0.1:0")
        for pod in pods:
            pub = EnginePublisher(
                endpoint,
                topic=make_topic(pod, "m"),
                replay_endpoint="tcp://127.0.0.1:0",
                bind=False,
                context=ctx,
            )
            pubs.append(pub)
            learned.learn(pod, pub.replay_endpoint)
        routers = {pod: learned.replay_endpoint(pod) for pod in pods}
        assert len(set(routers.values())) == 2
        sub.start()
        for pub in pubs:
            assert pub.wait_for_subscribers(1, 5.0)
        own = {pod: 1000 * (n + 1) for n, pod in enumerate(pods)}
        for pod, pub in zip(pods, pubs, strict=True):
            for k in range(3):  # seq 0..2 dropped on the way, still in the replay buffer
                pub.publish([BlockStored([own[pod] + k], None, [1] * 16, 16)], send=False)
            pub.publish([BlockStored([own[pod] + 3], None, [1] * 16, 16)])
        assert sink.wait_for_count(8, 15.0)
    finally:
        sub.stop()
        for pub in pubs:
            pub.close()
        ctx.destroy(linger=0)
    for pod in pods:
        got = [
            (d.seq, h)
            for d in sink.deliveries
            if d.stream == StreamId(pod)
            for e in d.batch.events
            for h in e.block_hashes
        ]
        assert got == [(k, own[pod] + k) for k in range(4)], pod
    statuses = {s.pod: s for s in sub.streams()}
    for pod in pods:
        assert statuses[pod].replay_endpoint == routers[pod]
        assert statuses[pod].missed_batches == 0 and statuses[pod].state == "live"

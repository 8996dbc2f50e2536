"""Pushed load (SGLang's load topic) beside the scrape: the /server_info descriptor, the
subscriber thread over real ZMQ PUB sockets on loopback, and which record a decision
reads.

Each pod is a real HTTP server on loopback (its ``/metrics`` an SGLang 0.5.23 page, its
``/server_info`` the ``kv_events`` block SGLang serves) and a PUB socket per rank sending
SGLang's frames, ``[b"load", seq, LoadStat]``, encoded here by kvindex's own struct (its
decoding of SGLang's own encoder is checked in ``tests/test_sglang_events.py``; SGLang's
own publisher drives a whole service in ``tests/test_sglang_load.py``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import pytest
import zmq

from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from kvindex.api.testing import eventually, free_port
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.sglang import LOAD_TOPIC, LoadStat, load_endpoints
from kvindex.events.wire.vllm import BlockStored, DecodeError
from kvindex.scoring.load import LoadView, PodLoad, Unknown
from kvindex.scoring.load_metrics import MAX_REQUESTS
from kvindex.scoring.load_push import MAX_LOAD_MESSAGE, PushedLoads
from tests.test_load import SGLANG_DP2, FakeClock


def descriptor(base: int | None, dp_size: int = 1, **extra: object) -> bytes:
    """An SGLang 0.5.23 /server_info body around its kv_events block (a few of the other
    keys it serves, which kvindex does not read)."""
    kv: dict[str, object] = {
        "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "",
        "block_size": 16, "dp_size": dp_size,
    }  # fmt: skip
    if base is not None:
        kv |= {"load_endpoint_port_base": base, "load_topic": "load"}
    kv |= extra
    return json.dumps(
        {"model_path": "m", "tp_size": 1, "kv_events": kv, "version": "0.5.23"}
    ).encode()


class Pod:
    """A pod's HTTP side (GET /metrics, GET /server_info) on loopback."""

    def __init__(self, metrics: str, server_info: bytes | None) -> None:
        self.metrics, self.server_info = metrics, server_info
        self.asked = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/server_info":
                    owner.asked += 1
                    body = owner.server_info
                else:
                    body = owner.metrics.encode() if self.path == "/metrics" else None
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.pod = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Ranks:
    """A pod's load sockets: one PUB per rank, bound where SGLang binds them
    (``tcp://*:base + rank``; here loopback)."""

    def __init__(self, ranks: int) -> None:
        self.context = zmq.Context()
        self.socks = []
        for _ in range(ranks):
            sock = self.context.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            self.socks.append(sock)
        self.base = self._bind_consecutive()
        self.seq = 0

    def _bind_consecutive(self) -> int:
        for _ in range(50):
            base = self.socks[0].bind_to_random_port("tcp://127.0.0.1")
            try:
                for rank, sock in enumerate(self.socks[1:], 1):
                    sock.bind(f"tcp://127.0.0.1:{base + rank}")
            except zmq.ZMQError:
                self.socks[0].unbind(f"tcp://127.0.0.1:{base}")
                continue
            return base
        raise AssertionError("no consecutive free ports")

    def send(self, rank: int, payload: bytes, topic: bytes = LOAD_TOPIC) -> None:
        self.socks[rank].send_multipart([topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def stat(self, rank: int, running: int, waiting: int, tokens: int, capacity: int) -> None:
        self.send(rank, msgspec.msgpack.encode(LoadStat(running, waiting, tokens, capacity, rank)))

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.context.term()


def reaches(pushes: PushedLoads, ranks: Ranks, pod: str, rank: int, **figures: int) -> None:
    """Send the rank's stat until the subscriber counts it: a SUB socket that has just
    connected misses what is sent before its subscription arrives (ZMQ's slow joiner)."""
    before = pushes.received().get(pod, 0)
    values = (figures["running"], figures["waiting"], figures["tokens"], figures["capacity"])
    for _ in range(200):
        ranks.stat(rank, *values)
        if eventually_counted(pushes, pod, before):
            return
    raise AssertionError(f"{pod} rank {rank}'s stat never arrived")


def eventually_counted(pushes: PushedLoads, pod: str, before: int) -> bool:
    from kvindex.events.ingest.testing import wait_until

    return wait_until(lambda: pushes.received().get(pod, 0) > before, timeout_s=0.1)


@pytest.fixture
def closing() -> Iterator[list]:
    made: list = []
    yield made
    for thing in reversed(made):
        (thing.stop if isinstance(thing, PushedLoads | LoadView) else thing.close)()


def test_server_info_names_one_load_socket_per_rank_at_the_pods_own_host() -> None:
    assert load_endpoints(descriptor(6000, dp_size=2), "10.0.0.7") == [
        "tcp://10.0.0.7:6000",
        "tcp://10.0.0.7:6001",
    ]
    assert load_endpoints(descriptor(6000), "[fd00::7]") == ["tcp://[fd00::7]:6000"]
    # SGLang without --load-publish-endpoint, without KV events, or not SGLang at all
    assert load_endpoints(descriptor(None), "10.0.0.7") == []
    assert load_endpoints(b'{"kv_events": null}', "10.0.0.7") == []
    assert load_endpoints(b'{"version": "0.33.0"}', "10.0.0.7") == []
    for bad in (
        b"<html>",
        descriptor(6000, dp_size=0),
        descriptor(70000),
        descriptor(65535, dp_size=2),
        descriptor(6000, load_topic="kv"),
        b"[" * 100_000,
    ):
        with pytest.raises(DecodeError, match="invalid_server_info"):
            load_endpoints(bad, "h")


def test_a_pushed_load_sums_the_ranks_and_beats_the_scrape_while_fresh(closing) -> None:
    clock = FakeClock()
    ranks = Ranks(2)
    started = "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e+09\n"
    pod = Pod(SGLANG_DP2 + started, descriptor(ranks.base, dp_size=2))
    pushes = PushedLoads(lambda: [pod.pod], clock=clock)
    view = LoadView(interval_s=1.0, clock=clock, pushes=pushes)  # stale after 3 s
    closing += [ranks, pod, view]
    view.set_pods([pod.pod])
    view.scrape_once()
    scraped = view.snapshot([pod.pod])[pod.pod]
    assert isinstance(scraped, PodLoad)
    assert (scraped.source, scraped.running, scraped.waiting) == ("scrape", 5, 2)
    pushes.start()
    eventually(lambda: pushes.advertised() == {pod.pod: 2}, "the pod's load sockets followed")

    # One rank alone is no pod's load: the sum would read the other as idle.
    reaches(pushes, ranks, pod.pod, 0, running=1, waiting=30, tokens=2048, capacity=8192)
    assert pushes.current() == {}
    assert view.snapshot([pod.pod])[pod.pod] == scraped
    clock.now += 1.0
    reaches(pushes, ranks, pod.pod, 1, running=2, waiting=10, tokens=8192, capacity=8192)
    pushed = view.snapshot([pod.pod])[pod.pod]
    assert isinstance(pushed, PodLoad) and pushed.source == "push"
    assert (pushed.running, pushed.waiting) == (3, 40)
    assert (pushed.kv_usage, pushed.kv_usage_max) == (0.625, 1.0)
    assert {rank: e.waiting for rank, e in pushed.engines.items()} == {"0": 30, "1": 10}
    assert pushed.scraped_at == 1000.0  # as old as its oldest rank's figure
    assert pushed.started == 1.7e9  # a restart shows on the scraped page only
    assert view.age(pushed) == 1.0

    # A scrape taken later does not override a live push (SGLang's /metrics gauges
    # trail its pushes), ...
    clock.now += 1.5
    view.scrape_once()
    assert view.snapshot([pod.pod])[pod.pod].source == "push"
    # ... until the push goes stale: then the scrape, ...
    clock.now += 1.0
    fallback = view.snapshot([pod.pod])[pod.pod]
    assert isinstance(fallback, PodLoad)
    assert (fallback.source, fallback.waiting) == ("scrape", 2)
    # ... and with both stale, unknown, aged from the newer of the two.
    clock.now += 3.0
    unknown = view.snapshot([pod.pod])[pod.pod]
    assert isinstance(unknown, Unknown)
    assert (unknown.reason, unknown.age_s) == ("stale", 4.0)
    # Pushes resuming make the pod's load known again without a scrape.
    reaches(pushes, ranks, pod.pod, 0, running=0, waiting=0, tokens=0, capacity=8192)
    reaches(pushes, ranks, pod.pod, 1, running=0, waiting=0, tokens=0, capacity=8192)
    resumed = view.snapshot([pod.pod])[pod.pod]
    assert isinstance(resumed, PodLoad) and (resumed.source, resumed.waiting) == ("push", 0)


def test_garbage_on_the_load_topic_is_counted_and_the_next_stat_applies(closing) -> None:
    ranks = Ranks(1)
    pod = Pod(SGLANG_DP2, descriptor(ranks.base))
    pushes = PushedLoads(lambda: [pod.pod], recheck_s=1.0)
    closing += [ranks, pod, pushes]
    pushes.start()
    reaches(pushes, ranks, pod.pod, 0, running=1, waiting=1, tokens=0, capacity=100)
    applied = pushes.received()[pod.pod]
    ranks.send(0, b"\xc1")  # not msgpack
    ranks.send(0, msgspec.msgpack.encode(["LoadStat", -1, 0, 0, 0]))  # not a count
    ranks.send(0, msgspec.msgpack.encode(LoadStat(MAX_REQUESTS + 1, 0, 0, 100)))
    ranks.send(0, msgspec.msgpack.encode(["BlockStored", [1]]))  # another struct
    ranks.send(0, msgspec.msgpack.encode(LoadStat(0, 0, 0, 100)), topic=b"load-extra")
    ranks.socks[0].send_multipart([LOAD_TOPIC, b"\x00" * 8])  # two frames
    ranks.stat(0, 4, 7, 50, 100)
    eventually(lambda: pushes.current()[pod.pod].waiting == 7, "the stat after the garbage")
    assert pushes.errors() == {pod.pod: {"invalid_load": 4, "bad_frame": 2}}
    assert pushes.received() == {pod.pod: applied + 1}
    # A message past the bound costs its connection for good (ZMQ drops it unread and
    # ends the session); once the rank is silent for recheck_s, the pod's /server_info
    # is asked again and its sockets opened anew.
    ranks.send(0, b"\x00" * (MAX_LOAD_MESSAGE + 1))
    eventually(lambda: pod.asked == 2, "the silent pod's /server_info asked again")
    reaches(pushes, ranks, pod.pod, 0, running=0, waiting=9, tokens=0, capacity=100)
    assert pushes.current()[pod.pod].waiting == 9


def test_pods_without_a_load_topic_are_scraped_only_and_gone_pods_are_dropped(
    closing,
) -> None:
    ranks = Ranks(1)
    pushing = Pod(SGLANG_DP2, descriptor(ranks.base))
    plain = Pod(SGLANG_DP2, descriptor(None))  # SGLang without --load-publish-endpoint
    vllm = Pod(SGLANG_DP2, None)  # no /server_info
    broken = Pod(SGLANG_DP2, b"{not json")
    pods = [pushing.pod, plain.pod, vllm.pod, broken.pod]
    pushes = PushedLoads(lambda: list(pods))
    closing += [ranks, pushing, plain, vllm, broken, pushes]
    pushes.start()
    eventually(
        lambda: (
            pushes.advertised() == {pushing.pod: 1, plain.pod: 0, vllm.pod: 0}
            and broken.pod in pushes.errors()
        ),
        "every pod's /server_info read",
    )
    assert pushes.errors() == {broken.pod: {"invalid_server_info": 1}}
    reaches(pushes, ranks, pushing.pod, 0, running=0, waiting=3, tokens=0, capacity=100)
    assert list(pushes.current()) == [pushing.pod]
    pods.remove(pushing.pod)  # no longer a known pod: its record and socket go
    eventually(lambda: pushing.pod not in pushes.advertised(), "the pod forgotten")
    assert pushes.current() == {} and pushing.pod not in pushes.received()
    asked = (plain.asked, vllm.asked)
    assert asked == (1, 1)  # asked again only after a minute


def test_the_pods_followed_are_the_known_ones_but_those_of_vllm_models_only(
    tmp_path: Path,
) -> None:
    config = tmp_path / "models.json"
    engines = {"mixed": ["vllm", "sglang"], "plain": ["vllm"]}
    config.write_text(json.dumps({"models": {m: {"engines": e} for m, e in engines.items()}}))
    port = free_port()
    settings = {
        "zmq_bind": [f"tcp://127.0.0.1:{port}"],
        "model_config": str(config),
        "bind_allow": ["127.0.0.0/8"],
        "pod_role": ["127.0.0.1:9001=both"],  # known before it publishes: its engine unknown
    }
    service = Service(from_flags(**settings))
    publishers = []
    try:
        service.start()
        for pod, model in (("127.0.0.1:9002", "mixed"), ("127.0.0.1:9003", "plain")):
            publisher = EnginePublisher(f"tcp://127.0.0.1:{port}", topic=f"kv@{pod}@{model}")
            publishers.append(publisher)
            assert publisher.wait_for_subscribers(1, 5.0)
            publisher.publish([BlockStored([7], None, list(range(16)), 16)])
        eventually(lambda: len(service.subscriber.streams()) == 2, "both pods' streams")
        assert service.may_push_load() == ["127.0.0.1:9001", "127.0.0.1:9002"]
        assert service.load.pushes is not None
    finally:
        for publisher in publishers:
            publisher.close()
        service.stop()
    # Without a model with SGLang pods, or with --no-load-push, nothing is followed.
    assert Service(from_flags(model="m")).load.pushes is None
    assert Service(from_flags(**settings, load_push=False)).load.pushes is None

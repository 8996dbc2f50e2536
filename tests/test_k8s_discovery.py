"""Kubernetes discovery against a real list/watch HTTP server on loopback.

The real ``kubernetes`` client talks to :mod:`tests.k8s_fake_api`; discovery drives a
recording target (the seam: the three Subscriber calls), and in one test a real
Subscriber receiving from a real EnginePublisher. Every wait is bounded; nothing
asserts on timing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from kvindex.api.testing import eventually
from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.discovery.kubernetes import KubernetesDiscovery
from kvindex.events.discovery.pods import (
    DiscoveryConfig,
    DiscoveryMode,
    PodConfigError,
    PodFacts,
    plan_pod,
    pod_role,
)
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from tests.k8s_fake_api import FakeKubeAPI, make_pod
from tests.support.lazy import LazyModule

kubernetes = LazyModule("kubernetes")

NS = "llm"
WAIT_S = 10.0
# Fast retries so outages in tests end quickly; a long grace unless a test wants it short.
FAST = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2, "request_timeout_s": 5.0}


class RecordingTarget:
    """A DiscoveryTarget that records every call and tracks what is connected."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.calls: list[tuple[str, Any]] = []
        self.connected: dict[str, PodEndpoint] = {}

    def connect(self, target: PodEndpoint) -> None:
        with self._cond:
            self.calls.append(("connect", target))
            self.connected[target.endpoint] = target
            self._cond.notify_all()

    def disconnect(self, endpoint: str) -> bool:
        with self._cond:
            self.calls.append(("disconnect", endpoint))
            found = self.connected.pop(endpoint, None) is not None
            self._cond.notify_all()
            return found

    def forget_pod(self, pod: str) -> None:
        with self._cond:
            self.calls.append(("forget", pod))
            for endpoint, target in list(self.connected.items()):
                if target.pod == pod:
                    del self.connected[endpoint]
            self._cond.notify_all()

    def count(self, kind: str, arg: Any = None) -> int:
        with self._cond:
            return sum(
                1
                for k, a in self.calls
                if k == kind and (arg is None or a == arg or getattr(a, "pod", None) == arg)
            )

    def pods(self) -> set[str]:
        with self._cond:
            return {t.pod for t in self.connected.values() if t.pod}

    def wait(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        with self._cond:
            while not predicate():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out waiting for {what}; calls: {self.calls}")
                self._cond.wait(min(remaining, 0.05))


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    server = FakeKubeAPI()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def target() -> RecordingTarget:
    return RecordingTarget()


@pytest.fixture
def start(api: FakeKubeAPI, target: RecordingTarget) -> Iterator[Callable[..., Any]]:
    """Start a discovery against ``api``; it is stopped (and checked to stop) after."""
    started: list[KubernetesDiscovery] = []

    def make(
        driven: Any = None, known: KnownPods | None = None, **config: Any
    ) -> KubernetesDiscovery:
        configuration = kubernetes.client.Configuration()
        configuration.host = api.url
        discovery = KubernetesDiscovery(
            driven or target,
            DiscoveryConfig(**{"namespaces": (NS,), "grace_s": 60.0, **FAST, **config}),
            api_client=kubernetes.client.ApiClient(configuration),
            known=known,
        )
        discovery.start()
        started.append(discovery)
        return discovery

    yield make
    for discovery in started:
        discovery.stop()
        alive = [t.name for t in threading.enumerate() if t.name.startswith("kvindex-discovery")]
        assert not alive, f"discovery threads still running after stop: {alive}"


def vllm_pod(name: str, ip: str | None, ready: bool = True, **kw: Any) -> dict[str, Any]:
    kw.setdefault("annotations", {"kvindex.io/model": "acme/chat"})
    return make_pod(NS, name, ip=ip, ready=ready, **kw)


def synced(discovery: KubernetesDiscovery, lists: int = 1) -> None:
    eventually(
        lambda: (
            discovery.stats().get("lists", 0) >= lists
            and discovery.stats().get("applied", 0) >= lists
        ),
        f"{lists} list(s) applied",
    )


def state(discovery: KubernetesDiscovery, pod: str) -> str | None:
    entry = discovery.discovered().get(pod)
    return entry["state"] if entry else None


# -- the pod lifecycle ----------------------------------------------------------------


def test_pod_added_then_ready_is_subscribed_per_rank(api, target, start) -> None:
    api.put_pod(
        vllm_pod(
            "vllm-0",
            None,
            ready=False,
            annotations={
                "kvindex.io/model": "acme/chat",
                "kvindex.io/data-parallel-size": "2",
                "kvindex.io/replay-port": "5600",
            },
        )
    )
    api.put_pod(make_pod(NS, "other", ip="127.0.0.9", ready=True, labels={"app": "x"}))
    discovery = start()
    synced(discovery)
    assert target.calls == [] and discovery.discovered() == {}  # no IP, no label

    api.update_pod(NS, "vllm-0", ip="127.0.0.2", phase="Running", ready=False)
    eventually(lambda: state(discovery, "127.0.0.2:8000") == "waiting", "pod with an IP")
    assert target.calls == []  # Running but not Ready

    api.update_pod(NS, "vllm-0", ready=True)
    target.wait(lambda: len(target.connected) == 2, "both ranks connected")
    by_rank = sorted(target.connected.values(), key=lambda t: t.rank)
    assert by_rank == [
        PodEndpoint("tcp://127.0.0.2:5557", "127.0.0.2:8000", "acme/chat",
                    "tcp://127.0.0.2:5600", 0),
        PodEndpoint("tcp://127.0.0.2:5558", "127.0.0.2:8000", "acme/chat",
                    "tcp://127.0.0.2:5601", 1),
    ]  # fmt: skip
    entry = discovery.discovered()["127.0.0.2:8000"]
    assert entry["name"] == "vllm-0" and entry["namespace"] == NS
    assert entry["address"] == "127.0.0.2:8000" and entry["ip"] == "127.0.0.2"
    assert entry["ready"] is True and entry["state"] == "subscribed"
    assert entry["model"] == "acme/chat" and entry["data_parallel_size"] == 2


def test_flap_shorter_than_grace_keeps_the_warm_cache(api, target, start) -> None:
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2"))
    discovery = start(grace_s=60.0)
    target.wait(lambda: target.pods() == {"127.0.0.2:8000"}, "subscription")

    api.update_pod(NS, "vllm-0", ready=False)
    eventually(lambda: state(discovery, "127.0.0.2:8000") == "unready", "unready state")
    api.update_pod(NS, "vllm-0", ready=True)
    eventually(lambda: state(discovery, "127.0.0.2:8000") == "subscribed", "ready again")

    assert target.count("forget") == 0 and target.count("disconnect") == 0
    assert target.count("connect") == 1  # the subscription was never touched


def test_flap_longer_than_grace_purges_then_resubscribes(api, target, start) -> None:
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2"))
    discovery = start(grace_s=0.2)
    target.wait(lambda: target.pods() == {"127.0.0.2:8000"}, "subscription")

    api.update_pod(NS, "vllm-0", ready=False)
    target.wait(lambda: target.count("forget", "127.0.0.2:8000") == 1, "purge after grace")
    assert target.pods() == set()
    assert state(discovery, "127.0.0.2:8000") == "waiting"

    api.update_pod(NS, "vllm-0", ready=True)
    target.wait(lambda: target.count("connect") == 2, "resubscription")
    assert target.pods() == {"127.0.0.2:8000"}


def test_deleted_pod_is_forgotten(api, target, start) -> None:
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2"))
    api.put_pod(vllm_pod("vllm-1", "127.0.0.3"))
    discovery = start()
    target.wait(lambda: len(target.pods()) == 2, "two subscriptions")

    api.delete_pod(NS, "vllm-0")
    target.wait(lambda: target.count("forget", "127.0.0.2:8000") == 1, "forget")
    assert target.pods() == {"127.0.0.3:8000"}
    assert set(discovery.discovered()) == {"127.0.0.3:8000"}


def test_terminating_pod_is_forgotten_without_grace(api, target, start) -> None:
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2"))
    start(grace_s=60.0)
    target.wait(lambda: target.pods() == {"127.0.0.2:8000"}, "subscription")

    api.update_pod(NS, "vllm-0", terminating=True)  # still Ready: kubelet is slower
    target.wait(lambda: target.count("forget", "127.0.0.2:8000") == 1, "forget at once")


def test_ip_change_after_restart_moves_the_subscription(api, target, start) -> None:
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2"))
    discovery = start()
    target.wait(lambda: target.pods() == {"127.0.0.2:8000"}, "subscription")

    # Rescheduled: not ready, then Running elsewhere with a new IP.
    api.update_pod(NS, "vllm-0", ready=False, phase="Pending")
    api.update_pod(NS, "vllm-0", ip="127.0.0.4", phase="Running", ready=True)
    target.wait(lambda: target.pods() == {"127.0.0.4:8000"}, "subscription at the new IP")
    assert target.count("forget", "127.0.0.2:8000") == 1
    assert set(discovery.discovered()) == {"127.0.0.4:8000"}
    forget_at = target.calls.index(("forget", "127.0.0.2:8000"))
    assert all(
        kind != "connect" or call.pod == "127.0.0.2:8000" for kind, call in target.calls[:forget_at]
    )


def test_recreated_pod_with_the_same_ip_is_purged_and_resubscribed(api, target, start) -> None:
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2", uid="uid-1"))
    start()
    target.wait(lambda: target.pods() == {"127.0.0.2:8000"}, "subscription")

    # A StatefulSet pod replaced while the watch saw only the final state.
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2", uid="uid-2"))
    target.wait(lambda: target.count("connect") == 2, "resubscription")
    assert [k for k, _ in target.calls] == ["connect", "forget", "connect"]


# -- the API server misbehaving ------------------------------------------------------


def test_watch_expiry_relists(api, target, start) -> None:
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2"))
    discovery = start()
    target.wait(lambda: target.pods() == {"127.0.0.2:8000"}, "subscription")
    eventually(lambda: api.watch_requests() >= 1, "a watch")

    # Changes no watch will report, then the watch expires: only a relist finds them.
    api.put_pod(vllm_pod("vllm-1", "127.0.0.3"), notify=False)
    api.delete_pod(NS, "vllm-0", notify=False)
    api.expire_watches()

    target.wait(lambda: target.pods() == {"127.0.0.3:8000"}, "state after the relist")
    assert discovery.stats()["expired"] >= 1 and discovery.stats()["lists"] >= 2
    assert target.count("forget", "127.0.0.2:8000") == 1


def test_api_server_away_for_a_while(api, target, start) -> None:
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2"))
    discovery = start()
    target.wait(lambda: target.pods() == {"127.0.0.2:8000"}, "subscription")

    api.stop()
    api.delete_pod(NS, "vllm-0", notify=False)
    api.put_pod(vllm_pod("vllm-1", "127.0.0.3"), notify=False)
    eventually(lambda: discovery.stats().get("errors", 0) >= 2, "failed retries")
    # Meanwhile the last known pods stay subscribed, and discovery is not "unready".
    assert target.pods() == {"127.0.0.2:8000"}
    assert discovery.problems() == []

    api.start()
    target.wait(lambda: target.pods() == {"127.0.0.3:8000"}, "state after the outage")
    assert target.count("forget", "127.0.0.2:8000") == 1


def test_periodic_resync_repairs_a_missed_event(api, target, start) -> None:
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2"))
    discovery = start(resync_s=1.0)
    target.wait(lambda: target.pods() == {"127.0.0.2:8000"}, "subscription")

    api.delete_pod(NS, "vllm-0", notify=False)  # the DELETED event is lost
    target.wait(lambda: target.count("forget", "127.0.0.2:8000") == 1, "forget by resync")
    assert discovery.stats()["lists"] >= 2 and discovery.stats().get("expired", 0) == 0


def test_forbidden_says_which_role_is_missing(api, target, start) -> None:
    api.forbid = True
    discovery = start()
    eventually(lambda: discovery.problems() != [] and "403" in discovery.problems()[0], "403")
    (problem,) = discovery.problems()
    assert "namespace llm" in problem and "get, list and watch on pods" in problem

    api.forbid = False
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2"))
    target.wait(lambda: target.pods() == {"127.0.0.2:8000"}, "subscription once allowed")
    assert discovery.problems() == []


# -- modes, namespaces, bad annotations --------------------------------------------------


def test_bind_mode_names_and_forgets_without_connecting(api, target, start) -> None:
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2"))
    discovery = start(mode=DiscoveryMode.BIND)
    eventually(lambda: state(discovery, "127.0.0.2:8000") == "subscribed", "tracked")
    entry = discovery.discovered()["127.0.0.2:8000"]
    assert entry["mode"] == "bind" and entry["endpoints"] == [] and entry["name"] == "vllm-0"

    api.delete_pod(NS, "vllm-0")
    target.wait(lambda: target.count("forget", "127.0.0.2:8000") == 1, "forget")
    assert target.count("connect") == 0


def test_discovered_pods_and_their_replay_annotation_reach_bind_mode(api, target, start) -> None:
    """What bind mode's door and replay endpoints read: pods in, their annotation, pods out."""
    known = KnownPods()
    annotated = {"kvindex.io/model": "acme/chat", "kvindex.io/replay-endpoint": "tcp://*:6000"}
    api.put_pod(vllm_pod("vllm-0", "127.0.0.2", annotations=annotated))
    api.put_pod(vllm_pod("vllm-1", "127.0.0.3"))
    api.put_pod(vllm_pod("vllm-2", "127.0.0.4", ready=False))
    discovery = start(mode=DiscoveryMode.BIND, known=known)
    eventually(lambda: len(known) == 2, "two ready pods known")
    assert "127.0.0.4:8000" not in known  # not ready: not yet a pod to accept
    assert known.replay_endpoint("127.0.0.2:8000") == "tcp://127.0.0.2:6000"
    assert known.replay_endpoint("127.0.0.3:8000") is None
    assert discovery.discovered()["127.0.0.2:8000"]["replay_endpoints"] == ["tcp://127.0.0.2:6000"]
    api.delete_pod(NS, "vllm-0")
    eventually(lambda: "127.0.0.2:8000" not in known, "the deleted pod forgotten")
    assert "127.0.0.3:8000" in known


def test_replay_endpoint_annotation_beats_the_port_rule() -> None:
    annotation = "kvindex.io/replay-endpoint"
    plan = plan_pod(
        facts(
            annotations={annotation: "tcp://127.11.2.3:7000", "kvindex.io/data-parallel-size": "2"}
        ),
        DiscoveryConfig(),
    )
    assert [e.replay_endpoint for e in plan.endpoints] == [
        "tcp://127.11.2.3:7000", "tcp://127.11.2.3:7001",
    ]  # fmt: skip
    assert plan.replay_endpoint == "tcp://127.11.2.3:7000"
    bind = plan_pod(
        facts(annotations={annotation: "tcp://*:7000"}), DiscoveryConfig(mode=DiscoveryMode.BIND)
    )
    assert bind.endpoints == () and bind.replay_endpoint == "tcp://127.11.2.3:7000"
    assert plan_pod(facts(), DiscoveryConfig()).replay_endpoint is None
    for bad in ("7000", "tcp://127.11.2.3", "ipc:///tmp/r", "tcp://h:99999"):
        with pytest.raises(PodConfigError, match=annotation):
            plan_pod(facts(annotations={annotation: bad}), DiscoveryConfig())


def test_several_namespaces(api, target, start) -> None:
    api.put_pod(make_pod("a", "vllm-0", ip="127.0.0.2", ready=True))
    api.put_pod(make_pod("b", "vllm-0", ip="127.0.0.3", ready=True))
    api.put_pod(make_pod("c", "vllm-0", ip="127.0.0.4", ready=True))
    discovery = start(namespaces=("a", "b"))
    target.wait(lambda: target.pods() == {"127.0.0.2:8000", "127.0.0.3:8000"}, "two pods")
    assert {e["namespace"] for e in discovery.discovered().values()} == {"a", "b"}


def test_bad_annotation_skips_only_that_pod(api, target, start) -> None:
    api.put_pod(vllm_pod("bad", "127.0.0.2", annotations={"kvindex.io/events-port": "x"}))
    api.put_pod(vllm_pod("good", "127.0.0.3"))
    start()
    target.wait(lambda: target.pods() == {"127.0.0.3:8000"}, "the good pod")
    assert target.count("connect") == 1


# -- end to end: discovery -> Subscriber -> events --------------------------------------


def test_events_flow_from_a_discovered_pod(api, start) -> None:
    sink = RecordingSink()
    subscriber = Subscriber(sink, SubscriberConfig(replay_timeout_s=5.0))
    subscriber.start()
    publisher = EnginePublisher(
        "tcp://127.0.0.2:0", bind=True, replay_endpoint="tcp://127.0.0.2:0", vllm_version="0.33"
    )
    try:
        events_port = int(publisher.endpoint.rsplit(":", 1)[1])
        replay_port = int((publisher.replay_endpoint or "").rsplit(":", 1)[1])
        api.put_pod(
            vllm_pod(
                "vllm-0",
                "127.0.0.2",
                annotations={
                    "kvindex.io/model": "acme/chat",
                    "kvindex.io/events-port": str(events_port),
                    "kvindex.io/replay-port": str(replay_port),
                },
            )
        )
        start(subscriber)
        assert publisher.wait_for_subscribers(1, WAIT_S), "discovery never connected"
        publisher.publish([BlockStored([11, 12], None, list(range(32)), 16)])
        assert sink.wait_for_count(1, WAIT_S)
        (delivery,) = sink.deliveries
        assert delivery.stream == StreamId("127.0.0.2:8000", 0)
        assert delivery.model == "acme/chat"

        api.delete_pod(NS, "vllm-0")
        assert sink.wait_for(lambda s: any(r.reason == "pod_removed" for r in s.resets), WAIT_S), (
            "the deleted pod was not purged"
        )
        assert sink.resets[-1].stream == StreamId("127.0.0.2:8000", 0)
        eventually(lambda: subscriber.streams() == [], "the pod's stream to be dropped")
    finally:
        publisher.close()
        subscriber.stop()


# -- reading pods (no server) ----------------------------------------------------------


def facts(**kw: Any) -> PodFacts:
    base: dict[str, Any] = {
        "namespace": NS, "name": "p", "uid": "u", "ip": "127.11.2.3", "phase": "Running",
        "ready": True, "terminating": False, "node": None, "annotations": {}, "ports": {},
    }  # fmt: skip
    return PodFacts(**{**base, **kw})


def test_annotations_beat_named_ports_beat_defaults() -> None:
    config = DiscoveryConfig()
    plan = plan_pod(facts(ports={"http": 9000, "kv-events": 6000, "kv-replay": 6100}), config)
    assert plan.pod_id == "127.11.2.3:9000"
    assert plan.endpoints[0].endpoint == "tcp://127.11.2.3:6000"
    assert plan.endpoints[0].replay_endpoint == "tcp://127.11.2.3:6100"
    plan = plan_pod(
        facts(
            ports={"http": 9000, "kv-events": 6000},
            annotations={"kvindex.io/serving-port": "8001", "kvindex.io/replay-port": "0"},
        ),
        config,
    )
    assert plan.pod_id == "127.11.2.3:8001" and plan.endpoints[0].replay_endpoint is None
    plan = plan_pod(facts(), DiscoveryConfig(model="m"))
    assert plan.pod_id == "127.11.2.3:8000" and plan.model == "m"
    assert plan.endpoints[0].endpoint == "tcp://127.11.2.3:5557"


def test_ipv6_pods_and_port_mistakes() -> None:
    plan = plan_pod(facts(ip="fd00::0001"), DiscoveryConfig())
    assert plan.pod_id == "[fd00::1]:8000"
    assert plan.endpoints[0].endpoint == "tcp://[fd00::1]:5557"
    with pytest.raises(PodConfigError, match="overlap"):  # vLLM's defaults with DP 2
        plan_pod(facts(annotations={"kvindex.io/data-parallel-size": "2"}), DiscoveryConfig())
    with pytest.raises(PodConfigError, match=r"kvindex\.io/serving-port"):
        plan_pod(facts(annotations={"kvindex.io/serving-port": "0"}), DiscoveryConfig())
    with pytest.raises(PodConfigError, match="data-parallel size"):
        plan_pod(facts(annotations={"kvindex.io/data-parallel-size": "800"}), DiscoveryConfig())


def test_config_decodes_from_settings() -> None:
    config = msgspec.convert(
        {"namespaces": ["a", "b"], "mode": "bind", "grace_s": 5}, DiscoveryConfig
    )
    assert config.namespaces == ("a", "b") and config.mode is DiscoveryMode.BIND
    with pytest.raises(msgspec.ValidationError, match="grace_s"):
        msgspec.convert({"grace_s": -1}, DiscoveryConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"label_selecter": "x"}, DiscoveryConfig)


def test_the_role_label_gives_a_pod_its_pd_role(api, target, start) -> None:
    labels = {"kvindex.io/enabled": "true", "kvindex.io/role": "prefill"}
    api.put_pod(vllm_pod("vllm-p", "127.0.0.2", labels=labels))
    bad = {"kvindex.io/enabled": "true", "kvindex.io/role": "prefil"}
    api.put_pod(vllm_pod("vllm-x", "127.0.0.3", labels=bad))
    api.put_pod(vllm_pod("vllm-b", "127.0.0.4"))
    discovery = start()
    target.wait(lambda: len(target.connected) == 3, "three pods connected")
    found = discovery.discovered()
    assert found["127.0.0.2:8000"]["role"] == "prefill"
    assert found["127.0.0.4:8000"]["role"] == "both"
    assert found["127.0.0.3:8000"]["role"] == "both"  # a typo is not a role: the default
    assert "kvindex.io/role='prefil'" in found["127.0.0.3:8000"]["problem"]


def test_pod_role_reads_the_label_apart_from_the_plan() -> None:
    config = DiscoveryConfig()
    assert pod_role(facts(labels={"kvindex.io/role": " Decode "}), config) == ("decode", None)
    assert pod_role(facts(), config) == ("both", None)
    role, problem = pod_role(facts(labels={"kvindex.io/role": ""}), config)
    assert role == "both" and problem is None

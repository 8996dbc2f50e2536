"""A pod deleted while kvindex was down, restored from the snapshot.

Discovery removes pods by watching them go; a pod deleted while kvindex was down never
goes, from kvindex's point of view: it is simply absent from the first list. Its entries,
restored from the snapshot, must go once every watched namespace has been listed, or
/score keeps routing to a pod that no longer exists. A pod that is listed keeps its
restored entries until its engine is heard. Real pieces: bind-mode ZMQ, the snapshot
file, and the kubernetes client against a loopback fake API server (KUBECONFIG).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from kvindex.events.ingest.testing import wait_until
from kvindex.events.wire.identity import make_topic
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.memory.snapshot_file import read_snapshot
from tests.k8s_fake_api import FakeKubeAPI, make_pod

NS = "llm"
KEPT, GONE = "127.0.0.41:8000", "127.0.0.42:8000"


def stored(*hashes: int) -> list[BlockStored]:
    return [BlockStored(list(hashes), None, [1] * 16 * len(hashes), 16)]


def index_two_pods_and_stop(snapshot: Path) -> None:
    """kvindex indexes one block of each pod, then stops: its final snapshot has both."""
    service = Service(
        from_flags(
            zmq_bind=["tcp://127.0.0.1:0"], bind_allow=["127.0.0.0/8"], snapshot=str(snapshot)
        )
    )
    service.start()
    try:
        for pod, block in ((KEPT, 1), (GONE, 2)):
            with EnginePublisher(service.bound[0], topic=make_topic(pod, "m")) as engine:
                assert engine.wait_for_subscribers(1, 10.0)
                engine.publish(stored(block))
        assert wait_until(
            lambda: all(service.backend.member_keys(p, "m") for p in (KEPT, GONE)), 10.0
        )
    finally:
        service.stop()


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: fake, user: {}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
    )
    return path


def test_a_restored_pod_missing_from_discovery_is_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshot = tmp_path / "kvindex.snap"
    index_two_pods_and_stop(snapshot)
    api = FakeKubeAPI()
    api.start()
    try:
        model = {"kvindex.io/model": "m"}
        api.put_pod(make_pod(NS, "kept", ip=KEPT.split(":")[0], ready=True, annotations=model))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", api.url)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        saved = {s["pod"] for s in read_snapshot(snapshot)["streams"]}
        assert saved == {KEPT, GONE}
        service = Service(from_flags(snapshot=str(snapshot), k8s_namespace=[NS]))
        service.start()  # restores both pods' entries, then discovery lists only KEPT
        try:
            assert wait_until(lambda: service.backend.member_keys(GONE, "m") == [], 15.0), (
                "the pod deleted while kvindex was down kept its entries"
            )
            assert service.backend.member_keys(KEPT, "m") == [1]  # restored, still listed
        finally:
            service.stop()
    finally:
        api.stop()

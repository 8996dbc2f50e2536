"""`--peers` in one process: the setting, the dump endpoint's refusals, and a dump read
back into an index equal to the one it was taken from. Two real processes copying each
other are in test_peer_recovery.py."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvindex.api.http.app import create_app
from kvindex.api.serve.cli import _settings_from, build_parser
from kvindex.api.serve.peers import DUMP_PATH, DUMP_SIZE_HEADER, parse_peers
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_derived import ConfigError
from kvindex.api.serve.settings_sources import from_flags
from kvindex.api.testing import free_port
from kvindex.events.ingest.testing import wait_until
from kvindex.events.wire.endpoints import from_source
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.snapshot_file import read_snapshot_from

POD = "127.0.0.1:8000"
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_peers_are_base_urls_from_comma_lists_or_repeated_flags() -> None:
    given = ["http://10.0.0.7:8080/, https://kv-1.kv:8443", "http://10.0.0.7:8080"]
    assert parse_peers(given) == ["http://10.0.0.7:8080", "https://kv-1.kv:8443"]
    for wrong in ("10.0.0.7:8080", "http://10.0.0.7", "ftp://h:1", "http://h:1/index"):
        with pytest.raises(ConfigError, match="--peers"):
            parse_peers([wrong])
    args = build_parser().parse_args(["serve", "--peers", "http://a:1", "--peers", "http://b:2"])
    assert _settings_from(args, {}).index.peers == ["http://a:1", "http://b:2"]
    env = {"KVINDEX_PEERS": "http://a:1,http://b:2"}
    assert _settings_from(build_parser().parse_args(["serve"]), env).index.peers == [
        "http://a:1",
        "http://b:2",
    ]


def test_peers_that_cannot_work_are_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="memory backend"):
        Service(
            from_flags(backend="redis://127.0.0.1:6379/15", peers=["http://a:1"], admin_token="t")
        )
    with pytest.raises(ConfigError, match="admin token"):
        Service(from_flags(peers=["http://127.0.0.1:1"]))
    with pytest.raises(ConfigError, match="http://HOST:PORT"):
        Service(from_flags(peers=["127.0.0.1:1"], admin_token="t"))


@pytest.fixture
def peer() -> Iterator[tuple[TestClient, str, Service]]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    nobody = f"http://127.0.0.1:{free_port()}"  # its own peer is down: it starts empty
    service = Service(from_flags(zmq_bind=[endpoint], admin_token=TOKEN, peers=[nobody]))
    with TestClient(create_app(service)) as client:
        yield client, endpoint, service


def publish(endpoint: str, service: Service, keys: list[int]) -> None:
    with EnginePublisher(from_source(endpoint, "127.0.0.1"), topic=f"kv@{POD}@m") as pub:
        assert pub.wait_for_subscribers(1, 5.0)
        pub.publish([BlockStored(keys, None, [], 16)])
        assert wait_until(
            lambda: any(s.pod == POD and s.delivered for s in service.subscriber.streams()), 5.0
        )


def test_a_dump_reads_back_into_the_same_index_with_its_stream_position(peer) -> None:
    client, endpoint, service = peer
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready"
    assert "peer recovery failed at start" in ready["notes"][0]
    assert "unreachable" in ready["notes"][0]
    assert 'kvindex_peer_recovery{result="unreachable"} 1.0' in client.get("/metrics").text
    keys = list(range(1, 101))
    publish(endpoint, service, keys)
    answer = client.get(DUMP_PATH, headers=AUTH)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/octet-stream"
    body = answer.content
    assert int(answer.headers[DUMP_SIZE_HEADER]) == len(body)
    tree = read_snapshot_from(io.BytesIO(body), len(body), "dump")
    copy = MemoryBackend()
    copy.from_state(tree["index"])
    assert copy.member_keys(POD, "m") == service.backend.member_keys(POD, "m") == keys
    assert [(s["pod"], s["seq"], s["model"]) for s in tree["streams"]] == [(POD, 0, "m")]


def test_the_dump_needs_the_admin_token_and_a_replica_that_keeps_positions(peer) -> None:
    client, _, _ = peer
    assert client.get(DUMP_PATH).status_code == 401
    wrong = client.get(DUMP_PATH, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"] == "unauthorized"
    plain = Service(from_flags(zmq_bind=[f"tcp://127.0.0.1:{free_port()}"], admin_token=TOKEN))
    with TestClient(create_app(plain)) as other:
        refused = other.get(DUMP_PATH, headers=AUTH)
        assert refused.status_code == 403
        assert refused.json()["error"] == "dump_unavailable"
        assert "--peers" in refused.json()["detail"]
    untokened = Service(from_flags(zmq_bind=[f"tcp://127.0.0.1:{free_port()}"]))
    with TestClient(create_app(untokened)) as other:
        assert other.get(DUMP_PATH).json()["error"] == "admin_token_unset"

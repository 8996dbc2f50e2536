"""/score for a hybrid model, end to end: events over real ZMQ, the HTTP answer per pod."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvindex.api.http.app import create_app
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from kvindex.api.testing import free_port
from kvindex.events.ingest.testing import wait_until
from kvindex.events.wire.endpoints import from_source
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockRemoved, BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig

TOKENS = list(range(1, 16 * 12 + 1))
KEYS = BlockHasher(HashConfig()).keys(TOKENS)
POD_A, POD_B = "127.0.0.1:8000", "127.0.0.2:8000"
WINDOW = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 48}


@pytest.fixture
def served() -> Iterator[tuple[TestClient, str, Service]]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = Service(from_flags(zmq_bind=[endpoint], model="m"))
    with TestClient(create_app(service)) as client:
        yield client, endpoint, service


def publish(endpoint: str, pod: str, service: Service, *events: object) -> None:
    # Sent from the pod's own host: bind mode checks the sender's address.
    source = from_source(endpoint, pod.split(":")[0])
    with EnginePublisher(source, topic=f"kv@{pod}@m", bind=False) as pub:
        assert pub.wait_for_subscribers(1, 5.0)
        pub.publish(list(events))
        applied = wait_until(
            lambda: any(s.pod == pod and s.delivered == 1 for s in service.subscriber.streams()),
            5.0,
        )
        assert applied


def stored(n: int, group: int, **kind: object) -> BlockStored:
    return BlockStored(KEYS[:n], None, TOKENS[: n * 16], 16, group_idx=group, **kind)


def test_score_reports_each_pods_hybrid_hit(served) -> None:
    client, endpoint, service = served
    full = {"kv_cache_spec_kind": "full_attention"}
    # A: full attention holds 12 blocks, the window group evicted blocks 9-11 and 5:
    # its last run of 3 is blocks 6-8, so vLLM hits 9 blocks.
    publish(
        endpoint,
        POD_A,
        service,
        stored(12, 0, **full),
        stored(12, 1, **WINDOW),
        BlockRemoved([KEYS[5], *KEYS[9:12]], group_idx=1),
    )
    # B: both groups hold 4 blocks.
    publish(endpoint, POD_B, service, stored(4, 0, **full), stored(4, 1, **WINDOW))
    answer = client.post("/score", json={"model": "m", "token_ids": TOKENS}).json()
    assert [(p["pod"], p["matched_blocks"], p["matched_tokens"]) for p in answer["pods"]] == [
        (POD_A, 9, 144),
        (POD_B, 4, 64),
    ]
    assert answer["warnings"] == []
    # the window group's namespace is not a model anyone can ask about
    missing = client.post("/score", json={"model": "m#kv-group-1", "token_ids": TOKENS})
    assert missing.status_code == 404

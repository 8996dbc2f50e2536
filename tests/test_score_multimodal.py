"""/score and /route with ``mm_features``: a prompt's images enter its block keys as they
enter vLLM's, and bad items are 400s that say what is wrong.

The keys vLLM itself computes for such prompts are checked in tests/test_keys_vllm.py
and tests/conformance; here a real EnginePublisher sends a pod's stores, with the extra
keys vLLM 0.33 publishes, to a composed Service over loopback ZMQ.
"""

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
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockExtras, BlockHasher, ExtraKeyStyle, HashConfig, MmFeature

POD_A, POD_B = "127.0.0.1:8000", "127.0.0.2:8000"
TOKENS = list(range(1, 16 * 8 + 1))
# An image over blocks 1-3 (tokens 20..59) and one inside block 5.
IMAGE = {"identifier": "img-cat", "offset": 20, "length": 40}
SMALL = {"identifier": "img-dog", "offset": 82, "length": 6}
FEATURES = (MmFeature(**IMAGE), MmFeature(**SMALL))


def event_extra_keys(extras: BlockExtras, blocks: int) -> list:
    """vLLM 0.33's published form (``to_event_extra_keys``): tags dropped, an item as
    (identifier, offset - block_start)."""
    out = []
    for index in range(blocks):
        keys = extras.for_block(index, ExtraKeyStyle.TAGGED, 16)
        out.append(None if keys is None else [k[1:] if k[0] == "mm" else k[1] for k in keys])
    return out


@pytest.fixture
def setup() -> Iterator[tuple[TestClient, Service]]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = Service(from_flags(zmq_bind=[endpoint], max_prompt_tokens=4096))
    with TestClient(create_app(service)) as client:
        extras = BlockExtras(mm_features=FEATURES)
        keys = BlockHasher(HashConfig()).keys(TOKENS, extras)
        event = BlockStored(keys, None, TOKENS, 16, extra_keys=event_extra_keys(extras, 8))
        # Pod B holds the same tokens as a text prompt: no image keys.
        text = BlockStored(BlockHasher(HashConfig()).keys(TOKENS), None, TOKENS, 16)
        for pod, stored in ((POD_A, event), (POD_B, text)):
            with EnginePublisher(
                from_source(endpoint, pod.split(":")[0]), topic=f"kv@{pod}@m", bind=False
            ) as pub:
                assert pub.wait_for_subscribers(1, 5.0)
                pub.publish([stored])
                assert wait_until(
                    lambda pod=pod: any(
                        s.pod == pod and s.delivered for s in service.subscriber.streams()
                    ),
                    5.0,
                )
        yield client, service


def matched(client: TestClient, path: str = "/score", **body) -> dict[str, int]:
    response = client.post(path, json={"model": "m", "token_ids": TOKENS} | body)
    assert response.status_code == 200, response.text
    answer = response.json()
    rows = answer["pods"] if path == "/score" else answer["candidates"]
    return {row["pod"]: row["matched_blocks"] for row in rows}


def test_images_enter_the_keys_as_vllms(setup) -> None:
    client, _ = setup
    # Block 0 holds no image: the text and the image prompt share it.
    assert matched(client, mm_features=[IMAGE, SMALL]) == {POD_A: 8, POD_B: 1}
    # The order items are given in does not matter; vLLM keeps them by offset.
    assert matched(client, mm_features=[SMALL, IMAGE])[POD_A] == 8
    # Without the images the prompt is the text one; with another image it parts ways
    # where that image starts.
    assert matched(client) == {POD_A: 1, POD_B: 8}
    other = dict(SMALL, identifier="img-bird")
    assert matched(client, mm_features=[IMAGE, other])[POD_A] == 5
    moved = dict(IMAGE, offset=21, length=39)
    assert matched(client, mm_features=[moved, SMALL])[POD_A] == 1


def test_route_takes_mm_features(setup) -> None:
    client, _ = setup
    rows = matched(client, "/route", mm_features=[IMAGE, SMALL], pods=[POD_A, POD_B])
    assert rows == {POD_A: 8, POD_B: 1}


def test_the_events_images_are_hash_checked(setup) -> None:
    client, _ = setup
    check = client.get(f"/index/pods/{POD_A}").json()["hash_check"][POD_A]
    assert (check["state"], check["checked_events"], check["skipped_events"]) == ("ok", 1, 0)


@pytest.mark.parametrize(
    ("fields", "detail"),
    [
        ({"mm_features": [dict(IMAGE, offset=-1)]}, "Expected `int` >= 0"),
        ({"mm_features": [dict(IMAGE, length=0)]}, "Expected `int` >= 1"),
        ({"mm_features": [dict(IMAGE, identifier="")]}, "length >= 1"),
        ({"mm_features": [dict(IMAGE, offset="20")]}, "Expected `int`, got `str`"),
        ({"mm_features": [dict(IMAGE, extra=1)]}, "unknown field `extra`"),
        ({"mm_features": [{"identifier": "x", "offset": 1}]}, "missing required field"),
        ({"mm_features": {"identifier": "x"}}, "Expected `array | null`"),
        ({"mm_features": [dict(IMAGE, length=200)]}, "run past the prompt's 128 tokens"),
        (
            {"mm_features": [IMAGE, dict(SMALL, offset=59)]},
            "mm_features[1] (offset 59, length 6) overlaps mm_features[0]",
        ),
        (
            {"mm_features": [IMAGE], "token_ids": None, "prompt": "a cat"},
            "mm_features apply to token_ids only",
        ),
        (
            {"mm_features": [IMAGE], "token_ids": None, "block_hashes": [1]},
            "do not apply to block_hashes",
        ),
    ],
)
def test_bad_mm_features_are_400s(setup, fields, detail) -> None:
    client, _ = setup
    for path in ("/score", "/route"):
        response = client.post(path, json={"model": "m", "token_ids": TOKENS} | fields)
        assert response.status_code == 400, (path, response.text)
        assert detail in response.json()["detail"], (path, response.text)


def test_token_key_models_key_images_too() -> None:
    """Content keys (--key-mode tokens) hold the items as events publish them: the same
    placeholder tokens with another image, or none, are another prompt."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = Service(from_flags(zmq_bind=[endpoint], model="t", key_mode="tokens"))
    pod_c = "127.0.0.3:8000"
    other = (MmFeature("img-bird", 20, 40), MmFeature(**SMALL))
    with TestClient(create_app(service)) as client:
        for pod, features in ((POD_A, FEATURES), (POD_B, other), (pod_c, ())):
            extras = BlockExtras(mm_features=features)
            engine_keys = list(range(1000 * len(pod), 1000 * len(pod) + 8))  # opaque
            stored = BlockStored(
                engine_keys, None, TOKENS, 16, extra_keys=event_extra_keys(extras, 8)
            )
            with EnginePublisher(
                from_source(endpoint, pod.split(":")[0]), topic=f"kv@{pod}@t", bind=False
            ) as pub:
                assert pub.wait_for_subscribers(1, 5.0)
                pub.publish([stored])
                assert wait_until(
                    lambda pod=pod: any(
                        s.pod == pod and s.delivered for s in service.subscriber.streams()
                    ),
                    5.0,
                )
        body = {"model": "t", "token_ids": TOKENS, "mm_features": [IMAGE, SMALL]}
        response = client.post("/score", json=body)
        assert response.status_code == 200, response.text
        rows = {row["pod"]: row["matched_blocks"] for row in response.json()["pods"]}
        assert rows == {POD_A: 8, POD_B: 1, pod_c: 1}
        text = client.post("/score", json={"model": "t", "token_ids": TOKENS}).json()
        assert {row["pod"]: row["matched_blocks"] for row in text["pods"]}[pod_c] == 8


def test_openapi_documents_mm_features(setup) -> None:
    client, _ = setup
    schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    item = components["MmFeatureSpec"]
    assert set(item["required"]) == {"identifier", "offset", "length"}
    assert item["properties"]["offset"]["minimum"] == 0
    assert item["properties"]["length"]["minimum"] == 1
    assert "mm_features" in components["ScoreRequest"]["properties"]

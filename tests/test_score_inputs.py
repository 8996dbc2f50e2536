"""/score and /route read a prompt in three forms with one answer: JSON ``token_ids``,
JSON ``block_hashes`` (the engine's published hashes, as ints or hex) and a binary body
of little-endian uint32 token ids.

The app runs in-process over a composed Service whose subscriber is bound to a loopback
ZMQ port; the pod is a real EnginePublisher, and one test sends the bytes vLLM 0.33.0's
own publisher code produced (tests/fixtures/vllm/0.33.0), whose hashes are the engine's.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import uvicorn
from fastapi.testclient import TestClient

from kvindex.api.client import ApiError, Client, Retries
from kvindex.api.http.app import create_app
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from kvindex.api.testing import free_port
from kvindex.events.ingest.testing import wait_until
from kvindex.events.wire.endpoints import from_source
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BatchDecoder, BlockStored, hashes_to_ints
from kvindex.indexer.keys import BlockHasher, HashConfig

TOKENS = list(range(1, 16 * 64 + 1))
KEYS = BlockHasher(HashConfig()).keys(TOKENS)
POD_A, POD_B, POD_C = "127.0.0.1:8000", "127.0.0.2:8000", "127.0.0.3:8000"
FIXTURE = Path(__file__).parent / "fixtures" / "vllm" / "0.33.0"
OCTET = {"content-type": "application/octet-stream"}
MAX_TOKENS = 4096


def binary(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


@pytest.fixture
def setup() -> Iterator[tuple[TestClient, str, Service]]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = from_flags(zmq_bind=[endpoint], max_prompt_tokens=MAX_TOKENS, max_pods=4)
    service = Service(settings)
    with TestClient(create_app(service)) as client:
        yield client, endpoint, service


def publish(
    endpoint: str, pod: str, service: Service, *, events=None, payload=None, model: str = "m"
) -> None:
    """Publish from the pod's own host (bind mode checks it) and wait until applied."""
    with EnginePublisher(
        from_source(endpoint, pod.split(":")[0]), topic=f"kv@{pod}@{model}", bind=False
    ) as pub:
        assert pub.wait_for_subscribers(1, 5.0)
        if payload is not None:
            pub.publish_payload(payload)
        else:
            pub.publish(events)
        applied = wait_until(
            lambda: (
                any(s.pod == pod and s.delivered for s in service.subscriber.streams())
                and service.knows_model(model)
            ),
            5.0,
        )
        assert applied


def three_pods(endpoint: str, service: Service) -> None:
    publish(endpoint, POD_A, service, events=[BlockStored(KEYS, None, TOKENS, 16)])
    publish(
        endpoint,
        POD_B,
        service,
        events=[BlockStored(KEYS[:10], None, TOKENS[:160], 16, medium="CPU")],
    )


def score(client: TestClient, **body) -> dict:
    response = client.post("/score", json={"model": "m"} | body)
    assert response.status_code == 200, response.text
    return response.json()


def test_token_ids_block_hashes_and_binary_give_one_answer(setup) -> None:
    client, endpoint, service = setup
    three_pods(endpoint, service)
    pods = [POD_A, POD_B, POD_C]
    by_tokens = score(client, token_ids=TOKENS, pods=pods)
    assert [(p["pod"], p["matched_blocks"]) for p in by_tokens["pods"]] == [
        (POD_A, 64),
        (POD_B, 10),
        (POD_C, 0),
    ]
    assert by_tokens["prompt_tokens"] == 1024 and by_tokens["prompt_blocks"] == 64

    assert score(client, block_hashes=KEYS, pods=pods) == by_tokens
    as_hex = [f"{k:016x}" for k in KEYS]
    assert score(client, block_hashes=as_hex, pods=pods) == by_tokens
    # A 32-byte digest: vLLM publishes its last 8 bytes, big-endian.
    digests = ["0x" + (bytes(range(24)) + k.to_bytes(8, "big")).hex() for k in KEYS]
    assert score(client, block_hashes=digests, pods=pods) == by_tokens
    mixed = [k if i % 2 else f"0X{k:X}" for i, k in enumerate(KEYS)]
    assert score(client, block_hashes=mixed, pods=pods) == by_tokens

    query = "?model=m&pods=" + ",".join(pods[:2]) + "&pods=" + pods[2]
    response = client.post("/score" + query, content=binary(TOKENS), headers=OCTET)
    assert response.status_code == 200, response.text
    assert response.json() == by_tokens

    # A prompt ending mid-block: token_ids count the tail, the hashes cannot.
    tail = score(client, token_ids=TOKENS[:170])
    hashed = score(client, block_hashes=KEYS[:10])
    assert tail["pods"] == hashed["pods"]
    assert (tail["prompt_tokens"], hashed["prompt_tokens"]) == (170, 160)


def test_hashes_vllm_published_score_like_its_tokens(setup) -> None:
    """Batch 0 of vLLM 0.33.0's own bytes: tokens 1..32 as two full-attention blocks
    from the root, two sliding-window blocks (KV group 1) chained after them, and two
    CPU blocks with no tokens, whose hashes (77, 78) only the engine's events carry."""
    client, endpoint, service = setup
    messages = msgspec.msgpack.decode((FIXTURE / "messages.msgpack").read_bytes())
    expected = json.loads((FIXTURE / "expected.json").read_text())
    _, _, payload = messages[0]
    events = BatchDecoder().decode(payload).batch.events
    published = [hashes_to_ints(e.block_hashes) for e in events]
    assert published[0] == expected["batches"][0]["events"][0]["block_hashes"]
    assert published[1][1] == 2**64 - 1  # the top of the uint64 range, as sent

    # KV group 0 alone (a plain full-attention model), republished as decoded.
    publish(endpoint, POD_A, service, events=[events[0], events[2]])
    prompt = list(range(1, 33))
    by_tokens = score(client, token_ids=prompt)
    assert [(p["pod"], p["matched_blocks"], p["gpu_blocks"]) for p in by_tokens["pods"]] == [
        (POD_A, 2, 2)
    ]
    assert score(client, block_hashes=published[0]) == by_tokens
    assert score(client, block_hashes=[f"{h:x}" for h in published[0]]) == by_tokens
    as_binary = client.post("/score?model=m", content=binary(prompt), headers=OCTET)
    assert as_binary.json() == by_tokens
    cpu_only = score(client, block_hashes=published[2])  # no tokens to score these by
    assert [(p["pod"], p["matched_blocks"], p["cpu_blocks"]) for p in cpu_only["pods"]] == [
        (POD_A, 2, 2)
    ]

    # The payload as sent, for a hybrid model: the hashes take vLLM's hybrid rule as the
    # tokens do (the window group does not hold blocks 0-1, so neither form matches).
    publish(endpoint, POD_B, service, payload=payload, model="h")
    hybrid = score(client, model="h", token_ids=prompt)
    assert hybrid["pods"] == [] and hybrid["prompt_blocks"] == 2
    assert score(client, model="h", block_hashes=published[0]) == hybrid
    as_binary = client.post("/score?model=h", content=binary(prompt), headers=OCTET)
    assert as_binary.json() == hybrid


def test_route_takes_block_hashes_and_binary(setup) -> None:
    client, endpoint, service = setup
    three_pods(endpoint, service)
    pods = [POD_A, POD_B]

    def route(**kwargs) -> dict:
        response = client.post("/route", **kwargs)
        assert response.status_code == 200, response.text
        answer = response.json()
        client.post(f"/route/{answer['route_id']}/done")
        return answer

    def shape(answer: dict) -> tuple:
        return (
            answer["pod"],
            answer["prompt_tokens"],
            [(c["pod"], c["matched_blocks"]) for c in answer["candidates"]],
        )

    by_tokens = route(json={"model": "m", "token_ids": TOKENS, "pods": pods})
    by_hashes = route(json={"model": "m", "block_hashes": KEYS, "pods": pods})
    by_binary = route(
        content=binary(TOKENS), headers=OCTET, params={"model": "m", "pods": pods, "max_tokens": 8}
    )
    assert by_tokens["pod"] == POD_A and by_tokens["prompt_tokens"] == 1024
    assert shape(by_hashes) == shape(by_tokens) == shape(by_binary)
    refused = client.post("/route?model=m&role=nope", content=binary(TOKENS), headers=OCTET)
    assert refused.status_code == 400 and "role" in refused.json()["detail"]


@pytest.mark.parametrize(
    ("body", "code", "detail"),
    [
        ({"block_hashes": KEYS, "token_ids": TOKENS}, "invalid_request", "exactly one of"),
        ({}, "invalid_request", "token_ids, prompt, messages, block_hashes"),
        ({"block_hashes": []}, "invalid_request", "block_hashes is empty"),
        ({"block_hashes": [1, -1]}, "invalid_request", "block_hashes[1]: -1 is not a uint64"),
        ({"block_hashes": [2**64]}, "invalid_request", "is not a uint64"),
        ({"block_hashes": ["xyz"]}, "invalid_request", "$.block_hashes[0]"),
        ({"block_hashes": ["0x"]}, "invalid_request", "matching regex"),
        ({"block_hashes": ["f" * 65]}, "invalid_request", "matching regex"),
        ({"block_hashes": [" ff"]}, "invalid_request", "matching regex"),
        ({"block_hashes": [1.5]}, "invalid_request", "Expected `int | str`"),
        ({"block_hashes": [1], "lora_name": "x"}, "invalid_request", "do not apply"),
        ({"block_hashes": [1], "cache_salt": "s"}, "invalid_request", "do not apply"),
        (
            {"block_hashes": list(range(MAX_TOKENS // 16 + 1))},
            "invalid_request",
            "more than the limit of 4096 tokens",
        ),
        ({"block_hashes": [1], "pods": ["127.0.0.9"] * 5}, "too_large", "--max-pods"),
    ],
)
def test_bad_block_hashes_are_400s(setup, body, code, detail) -> None:
    client, endpoint, service = setup
    three_pods(endpoint, service)
    for path in ("/score", "/route"):
        response = client.post(path, json={"model": "m", **body})
        assert response.status_code in (400, 413), (path, response.text)
        assert response.json()["error"] == code, (path, response.text)
        assert detail in response.json()["detail"], (path, response.text)


def test_block_hashes_need_a_known_model_keyed_by_engine_hashes(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = Service(from_flags(zmq_bind=[endpoint], model="t", key_mode="tokens"))
    with TestClient(create_app(service)) as client:
        refused = client.post("/score", json={"model": "t", "block_hashes": [1]})
        assert refused.status_code == 400
        assert "send token_ids" in refused.json()["detail"]
        unknown = client.post("/score", json={"model": "nope", "block_hashes": [1]})
        assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_model"


def test_sglang_published_ids_are_block_hashes_of_their_model(tmp_path: Path) -> None:
    """SGLang 0.5.23's own payloads (tests/fixtures/sglang), published into a model
    configured with SGLang pods: its signed ids name the blocks, /score and /route."""
    fixtures = Path(__file__).parent / "fixtures" / "sglang"
    lines = (fixtures / "sglang_0_5_23_payloads.txt").read_text().split()
    truth = json.loads((fixtures / "sglang_0_5_23_truth.json").read_text())
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": {"s": {"block_size": 4, "engines": ["sglang"]}}}))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = Service(from_flags(zmq_bind=[endpoint], model_config=str(config)))
    pod = "127.0.0.41:8000"
    payloads = [bytes.fromhex(lines[i + 1]) for i in range(0, len(lines), 2) if lines[i] == pod]
    with TestClient(create_app(service)) as client:
        with EnginePublisher(from_source(endpoint, "127.0.0.41"), topic=f"kv@{pod}@s") as pub:
            assert pub.wait_for_subscribers(1, 5.0)
            for payload in payloads:  # one engine: seqs 0, 1, 2
                pub.publish_payload(payload)
            applied = wait_until(
                lambda: any(
                    s.pod == pod and s.last_seq == len(payloads) - 1
                    for s in service.subscriber.streams()
                ),
                10.0,
            )
            assert applied
        chat_ids = truth["chat_ids"]
        assert any(h < 0 for h in chat_ids)
        scored = client.post("/score", json={"model": "s", "block_hashes": chat_ids}).json()
        assert scored["prompt_tokens"] == 24
        assert [(p["pod"], p["matched_blocks"]) for p in scored["pods"]] == [(pod, 5)]
        chat = truth["prompts"]["chat"]
        by_tokens = client.post("/score", json={"model": "s", "token_ids": chat})
        assert by_tokens.json()["pods"] == scored["pods"]
        unknown = client.post("/score", json={"model": "s", "block_hashes": [-5, 7]}).json()
        assert all(p["matched_blocks"] == 0 for p in unknown["pods"])
        below = client.post("/score", json={"model": "s", "block_hashes": [-(2**63) - 1]})
        assert below.status_code == 400 and "is not a uint64" in below.json()["detail"]
        routed = client.post("/route", json={"model": "s", "block_hashes": chat_ids})
        assert routed.status_code == 200 and routed.json()["pod"] == pod, routed.text


@pytest.mark.parametrize(
    ("query", "body", "status", "code", "detail"),
    [
        ("?model=m", b"\x01\x00\x00", 400, "invalid_request", "not a whole number"),
        ("?model=m", b"", 400, "invalid_request", "the prompt is empty"),
        ("", binary([1]), 400, "invalid_request", "needs the query parameter model"),
        ("?model=m&token_ids=1", binary([1]), 400, "invalid_request", "'token_ids' is not"),
        ("?model=m&model=n", binary([1]), 400, "invalid_request", "more than once"),
        ("?model=m&pods=", binary([1]), 400, "invalid_request", "at least one pod"),
        ("?model=m", binary(list(range(MAX_TOKENS + 1))), 400, "invalid_request", "limit"),
        ("?model=nope", binary([1]), 404, "unknown_model", "'nope'"),
    ],
)
def test_bad_binary_bodies(setup, query, body, status, code, detail) -> None:
    client, endpoint, service = setup
    three_pods(endpoint, service)
    response = client.post("/score" + query, content=body, headers=OCTET)
    assert response.status_code == status, response.text
    assert response.json()["error"] == code and detail in response.json()["detail"]


def test_size_limit_and_media_types(setup) -> None:
    client, _, service = setup
    limit = service.settings.http.max_body_bytes
    big = client.post("/score?model=m", content=b"\0" * (limit + 4), headers=OCTET)
    assert big.status_code == 413 and big.json()["error"] == "too_large"
    for path in ("/score", "/route"):
        other = client.post(path, content=b"x", headers={"content-type": "text/plain"})
        assert other.status_code == 415 and other.json()["error"] == "unsupported_media_type"
        assert "application/octet-stream" in other.json()["detail"]


def test_openapi_documents_the_forms(setup) -> None:
    client, _, _ = setup
    schema = client.get("/openapi.json").json()
    for path in ("/score", "/route"):
        operation = schema["paths"][path]["post"]
        content = operation["requestBody"]["content"]
        assert content["application/octet-stream"]["schema"]["format"] == "binary"
        params = {p["name"]: p for p in operation["parameters"]}
        assert {"model", "pods", "lora_name", "cache_salt"} <= set(params)
        assert params["pods"]["schema"]["type"] == "array"
    assert {"request_id", "max_tokens", "role"} <= {
        p["name"] for p in schema["paths"]["/route"]["post"]["parameters"]
    }
    hashes = schema["components"]["schemas"]["ScoreRequest"]["properties"]["block_hashes"]
    forms = hashes["anyOf"][0]["items"]["anyOf"]
    # vLLM's uint64s and SGLang's signed int64 ids
    assert forms[0] == {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}
    assert forms[1]["type"] == "string" and "pattern" in forms[1]
    assert "415" in schema["paths"]["/score"]["post"]["responses"]


def test_client_sends_block_hashes() -> None:
    """kvindex.api.client over loopback HTTP to a uvicorn serving the app."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = Service(from_flags(zmq_bind=[endpoint]))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, 10.0)
        three_pods(endpoint, service)
        once = Retries(attempts=1)
        with Client(f"http://127.0.0.1:{port}", retries=once) as api:
            answer = api.score(model="m", block_hashes=[f"{k:x}" for k in KEYS[:20]])
            assert [(p.pod, p.matched_blocks) for p in answer.pods] == [(POD_A, 20), (POD_B, 10)]
            routed = api.route(model="m", block_hashes=KEYS, pods=[POD_B, POD_C])
            assert routed.pod == POD_B and routed.prompt_tokens == 1024
            with pytest.raises(ApiError) as refused:
                api.score(model="m", block_hashes=[-1])
            assert refused.value.status == 400 and "uint64" in refused.value.detail
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)

"""The HTTP contract: /score answers and refusals, pod endpoints, probes, metrics, docs.

The app runs in-process (ASGI) over a fully composed Service whose subscriber is bound
to a real loopback ZMQ port; pods are real EnginePublishers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

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
from kvindex.indexer.keys import BlockHasher, HashConfig

TOKENS = list(range(1, 16 * 64 + 1))
KEYS = BlockHasher(HashConfig()).keys(TOKENS)
POD_A, POD_B, POD_C = "127.0.0.1:8000", "127.0.0.2:8000", "127.0.0.3:8000"


def make_tokenizer(directory: Path) -> None:
    """A tiny word-level tokenizer with a chat template, written the way HF ships them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<s>", "hello", "world", "you", "are", "helpful", "user:", "assistant:", "\n"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    template = (
        "{{ bos_token }} {% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    )
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[TestClient, str, Service]]:
    make_tokenizer(tmp_path / "tok")
    model_config = tmp_path / "models.json"
    model_config.write_text(
        json.dumps({"models": {"m": {"tokenizer": str(tmp_path / "tok"), "loras": {"ad": "/a"}}}})
    )
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    settings = from_flags(
        zmq_bind=[endpoint],
        model_config=str(model_config),
        admin_token="s3cret",
        max_prompt_tokens=4096,
    )
    service = Service(settings)
    with TestClient(create_app(service)) as client:
        yield client, endpoint, service


def publish(
    endpoint: str, pod: str, n_blocks: int, service: Service, medium: str | None = None
) -> None:
    # Sent from the pod's own host: bind mode checks the sender's address.
    source = from_source(endpoint, pod.split(":")[0])
    with EnginePublisher(source, topic=f"kv@{pod}@m", bind=False) as pub:
        assert pub.wait_for_subscribers(1, 5.0)
        pub.publish(
            [BlockStored(KEYS[:n_blocks], None, TOKENS[: n_blocks * 16], 16, medium=medium)]
        )
        delivered = wait_until(
            lambda: any(s.pod == pod and s.delivered for s in service.subscriber.streams()), 5.0
        )
        assert delivered


def test_score_ranks_pods_and_lists_unmatched_candidates(setup) -> None:
    client, endpoint, service = setup
    publish(endpoint, POD_A, 64, service)
    publish(endpoint, POD_B, 10, service, medium="CPU")
    answer = client.post("/score", json={"model": "m", "token_ids": TOKENS}).json()
    assert answer["block_size"] == 16 and answer["prompt_tokens"] == 1024
    assert answer["prompt_blocks"] == 64
    assert [(p["pod"], p["matched_blocks"]) for p in answer["pods"]] == [(POD_A, 64), (POD_B, 10)]
    assert answer["pods"][1]["cpu_blocks"] == 10 and answer["pods"][1]["score"] == 8.0
    assert answer["pods"][0]["matched_tokens"] == 1024

    only = client.post(
        "/score", json={"model": "m", "token_ids": TOKENS, "pods": ["127.0.0.2", POD_C]}
    ).json()
    assert [(p["pod"], p["matched_blocks"]) for p in only["pods"]] == [(POD_B, 10), (POD_C, 0)]


def test_prompt_and_messages_use_the_models_tokenizer(setup) -> None:
    client, endpoint, service = setup
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(
        str(Path(service.settings.model_config).parent / "tok" / "tokenizer.json")
    )
    text = " ".join(["hello world you are helpful"] * 8)
    ids = tokenizer.encode(text).ids
    keys = BlockHasher(HashConfig()).keys(ids)
    with EnginePublisher(endpoint, topic=f"kv@{POD_A}@m", bind=False) as pub:
        assert pub.wait_for_subscribers(1, 5.0)
        pub.publish([BlockStored(keys, None, ids[: len(keys) * 16], 16)])
        assert wait_until(lambda: any(s.delivered for s in service.subscriber.streams()), 5.0)
    by_prompt = client.post("/score", json={"model": "m", "prompt": text}).json()
    assert by_prompt["prompt_tokens"] == 40 and by_prompt["pods"][0]["matched_blocks"] == 2

    messages = [{"role": "user", "content": "hello world"}]
    by_chat = client.post("/score", json={"model": "m", "messages": messages}).json()
    # "<s> user: hello world " rendered by the template, encoded without special tokens
    assert tokenizer.encode("<s> user: hello world ", add_special_tokens=False).ids == [1, 7, 2, 3]
    assert by_chat["prompt_tokens"] == 4


@pytest.mark.parametrize(
    ("body", "status", "code", "needle"),
    [
        ("{not json", 400, "invalid_json", "JSON"),
        ({"model": "m"}, 400, "invalid_request", "exactly one of"),
        (
            {"model": "m", "token_ids": [1], "prompt": "x"},
            400,
            "invalid_request",
            "token_ids, prompt",
        ),
        ({"model": "m", "tokens": [1]}, 400, "invalid_request", "tokens"),
        ({"model": "m", "token_ids": [-1]}, 400, "invalid_request", ">= 0"),
        ({"model": "m", "token_ids": "abc"}, 400, "invalid_request", "array"),
        ({"model": "m", "token_ids": []}, 400, "invalid_request", "empty"),
        ({"model": "m", "token_ids": [1] * 5000}, 400, "invalid_request", "--max-prompt-tokens"),
        ({"model": "", "token_ids": [1]}, 400, "invalid_request", "length"),
        ({"model": "nope", "token_ids": [1]}, 404, "unknown_model", "nope"),
        ({"model": "m", "token_ids": [1], "pods": []}, 400, "invalid_request", "at least one"),
        ({"model": "m", "token_ids": [1], "pods": ["not a pod!"]}, 400, "invalid_request", "pod"),
        ({"model": "m", "token_ids": [1] * 32, "lora_name": "zz"}, 400, "invalid_request", "loras"),
        ({"model": "m", "messages": [{"content": "x"}]}, 400, "invalid_request", "role"),
        ({"model": "m", "prompt": "x" * 4_000_001}, 400, "invalid_request", "--max-prompt-chars"),
    ],
)
def test_bad_requests_get_clear_4xx(setup, body, status, code, needle) -> None:
    client, _, _ = setup
    content = body if isinstance(body, str) else json.dumps(body)
    response = client.post("/score", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    answer = response.json()
    assert answer["error"] == code
    assert needle in answer["detail"]


def test_missing_tokenizer_names_the_model_and_the_setting(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text("[models.plain]\nblock_size = 16\n")  # configured, no tokenizer
    service = Service(from_flags(model_config=str(config)))
    with TestClient(create_app(service, manage_lifecycle=False)) as client:
        response = client.post("/score", json={"model": "plain", "prompt": "hello"})
    assert response.status_code == 503
    detail = response.json()["detail"]
    assert "'plain'" in detail and "tokenizer" in detail and "--model-config" in detail


def test_bad_requests_are_counted(setup) -> None:
    client, _, _ = setup
    client.post("/score", json={"model": "m"})
    metrics = client.get("/metrics").text
    assert 'kvindex_score_requests_total{outcome="invalid_request"} 1.0' in metrics


def test_pod_endpoints_and_purge(setup) -> None:
    client, endpoint, service = setup
    publish(endpoint, POD_A, 8, service)
    pods = client.get("/index/pods").json()["pods"]
    assert [p["pod"] for p in pods] == [POD_A]
    report = client.get("/index/pods/127.0.0.1:8000").json()
    assert report["blocks"] == {"gpu": 8, "cpu": 0, "storage": 0}
    assert report["models"] == ["m"] and report["stream_state"] == "live"
    assert report["hash_check"][POD_A]["state"] == "ok"
    assert report["last_seq"] == {POD_A: 0}
    assert client.get("/index/pods/127.0.0.9:8000").status_code == 404
    blocks = client.get(f"/index/pods/{POD_A}/blocks", params={"model": "m"}).json()
    assert blocks == {
        "pod": POD_A,
        "model": "m",
        "tier": None,
        "blocks": {POD_A: sorted(KEYS[:8])},
        "truncated": False,
    }
    cpu = client.get(
        f"/index/pods/{POD_A}/blocks", params={"model": "m", "tier": "cpu", "limit": 2}
    )
    assert cpu.json()["blocks"] == {POD_A: []}
    assert (
        client.get(f"/index/pods/{POD_A}/blocks", params={"model": "m", "tier": "x"}).status_code
        == 400
    )

    assert client.delete(f"/index/pods/{POD_A}").status_code == 401
    bad = client.delete(f"/index/pods/{POD_A}", headers={"authorization": "Bearer nope"})
    assert bad.status_code == 401
    ok = client.delete(f"/index/pods/{POD_A}", headers={"authorization": "Bearer s3cret"})
    assert ok.json() == {"pod": POD_A, "members": [POD_A], "entries_removed": 8}
    answer = client.post("/score", json={"model": "m", "token_ids": TOKENS}).json()
    assert answer["pods"] == []


def test_probes_metrics_and_docs(setup) -> None:
    client, endpoint, service = setup
    publish(endpoint, POD_A, 8, service)
    client.post("/score", json={"model": "m", "token_ids": TOKENS})
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ready"}
    metrics = client.get("/metrics").text
    for line in [
        'kvindex_events_total{type="BlockStored"} 1.0',
        'kvindex_index_blocks{tier="gpu"} 8.0',
        "kvindex_pods 1.0",
        'kvindex_score_prompt_blocks_total{model="m"} 64.0',
        'kvindex_score_matched_blocks_total{model="m"} 8.0',
        'kvindex_pod_stream_state{pod="127.0.0.1:8000",state="live"} 1.0',
        "kvindex_event_lag_seconds_count 1.0",
        "kvindex_score_seconds_count 1.0",
    ]:
        assert line in metrics, line
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/score"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ScoreRequest"}
    assert "token_ids" in spec["components"]["schemas"]["ScoreRequest"]["properties"]
    assert client.get("/docs").status_code == 200


def test_readyz_reports_a_stopped_subscriber() -> None:
    service = Service(from_flags())
    with TestClient(create_app(service, manage_lifecycle=False)) as client:
        response = client.get("/readyz")
    assert response.status_code == 503
    assert "subscriber" in response.json()["problems"][0]


def test_stream_queue_flag_and_environment() -> None:
    from kvindex.api.serve.cli import _settings_from, build_parser
    from kvindex.api.serve.settings_derived import ConfigError
    from kvindex.events.ingest.config import SubscriberConfig

    parser = build_parser()
    args = parser.parse_args(["serve", "--stream-queue", "100"])
    assert _settings_from(args, {"KVINDEX_STREAM_QUEUE": "7"}).events.stream_queue == 100
    args = parser.parse_args(["serve"])
    assert _settings_from(args, {"KVINDEX_STREAM_QUEUE": "7"}).events.stream_queue == 7
    assert _settings_from(args, {}).events.stream_queue == SubscriberConfig().queue_capacity
    with pytest.raises(ConfigError, match="stream_queue"):
        _settings_from(args, {"KVINDEX_STREAM_QUEUE": "0"})

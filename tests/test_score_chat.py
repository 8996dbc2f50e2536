"""/score with chat messages: the request's chat fields render the prompt as vLLM does, so a
pod that cached the conversation's blocks is found; bad chat fields get clear 400s.

The pod's blocks are computed from transformers' own rendering of the conversation (the
reference vLLM 0.33 calls), published over real ZMQ, and scored through the HTTP API.
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
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig
from tests.chat_models import model_directory
from tests.support.reference import transformers

POD = "127.0.0.1:8000"
CONVERSATION = [
    {"role": "system", "content": "You answer questions about the weather & climate <briefly>."},
    {"role": "user", "content": "Wie wird das Wetter morgen in Zürich? " * 6},
    {"role": "assistant", "content": "Sonnig, 21 °C."},
    {"role": "user", "content": "Und übermorgen?"},
]
TOOL = {
    "type": "function",
    "function": {
        "name": "forecast",
        "description": "Forecast <days> ahead",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}},
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return model_directory("gpt-oss", tmp_path_factory.mktemp("models"))


@pytest.fixture
def setup(model_dir: Path, tmp_path: Path) -> Iterator[tuple[TestClient, str, Service]]:
    models = tmp_path / "models.json"
    models.write_text(json.dumps({"models": {"oss": {"tokenizer": str(model_dir)}}}))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = Service(from_flags(zmq_bind=[endpoint], model_config=str(models)))
    with TestClient(create_app(service)) as client:
        yield client, endpoint, service


def reference_ids(model_dir: Path, **chat: object) -> list[int]:
    tokenizer = transformers().AutoTokenizer.from_pretrained(str(model_dir))
    tools = chat.pop("tools", None)
    kwargs = chat.pop("chat_template_kwargs", None) or {}
    return tokenizer.apply_chat_template(
        CONVERSATION,
        tools=tools,
        add_generation_prompt=chat.pop("add_generation_prompt", True),
        tokenize=True,
        return_dict=False,
        **kwargs,
    )


def publish(endpoint: str, service: Service, ids: list[int]) -> int:
    keys = BlockHasher(HashConfig()).keys(ids)
    with EnginePublisher(endpoint, topic=f"kv@{POD}@oss", bind=False) as pub:
        assert pub.wait_for_subscribers(1, 5.0)
        pub.publish([BlockStored(keys, None, ids[: len(keys) * 16], 16)])
        assert wait_until(lambda: any(s.delivered for s in service.subscriber.streams()), 5.0)
    return len(keys)


def test_a_pod_that_cached_the_rendered_conversation_is_found(setup, model_dir) -> None:
    client, endpoint, service = setup
    chat = {"chat_template_kwargs": {"reasoning_effort": "high"}, "tools": [TOOL]}
    ids = reference_ids(model_dir, **json.loads(json.dumps(chat)))
    blocks = publish(endpoint, service, ids)
    assert blocks >= 2

    answer = client.post("/score", json={"model": "oss", "messages": CONVERSATION, **chat})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["prompt_tokens"] == len(ids)
    assert body["pods"][0]["pod"] == POD and body["pods"][0]["matched_blocks"] == blocks

    # The same messages rendered without the request's chat fields are another prompt:
    # the system block differs, so the cached blocks do not match from the start.
    plain = client.post("/score", json={"model": "oss", "messages": CONVERSATION}).json()
    assert plain["prompt_tokens"] != len(ids)
    assert all(p["matched_blocks"] < blocks for p in plain["pods"])


def test_add_generation_prompt_defaults_to_true_like_vllm(setup, model_dir) -> None:
    client, _, _ = setup
    with_prompt = client.post("/score", json={"model": "oss", "messages": CONVERSATION}).json()
    without = client.post(
        "/score",
        json={"model": "oss", "messages": CONVERSATION, "add_generation_prompt": False},
    ).json()
    assert with_prompt["prompt_tokens"] == len(reference_ids(model_dir))
    assert without["prompt_tokens"] == len(reference_ids(model_dir, add_generation_prompt=False))
    assert without["prompt_tokens"] < with_prompt["prompt_tokens"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"prompt": "hi", "tools": [TOOL]}, "apply to messages only"),
        ({"token_ids": [1, 2], "add_generation_prompt": False}, "apply to messages only"),
        ({"messages": CONVERSATION, "chat_template_kwargs": {"tokenize": True}}, "tokenize"),
        ({"messages": CONVERSATION, "tools": [{"type": "function"}]}, "function"),
        (
            {"messages": CONVERSATION, "continue_final_message": True},
            "add_generation_prompt",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "image_url",
        ),
        ({"messages": CONVERSATION, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ],
)
def test_bad_chat_fields_get_a_clear_400(setup, extra, needle) -> None:
    client, _, _ = setup
    answer = client.post("/score", json={"model": "oss", **extra})
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["error"] == "invalid_request" and needle in body["detail"]

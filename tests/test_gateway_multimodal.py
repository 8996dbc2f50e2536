"""Chats kvindex cannot tokenize, through ``kvindex serve --gateway`` and the real ``openai``
client: multimodal content (an image, audio) and a content part of a type kvindex does
not know are served by a pod chosen by load, with the client's body untouched and the
reason in ``x-kvindex-route-reason``; ``/route`` answers such messages with a load-only
decision instead of refusing them; ``/score``, which cannot score them, says what to do.
"""

from __future__ import annotations

import json
import os
import sys

import httpx
import pytest

from kvindex.api.client import ApiError
from kvindex.api.testing import ServeProcess
from tests import test_gateway
from tests.support.lazy import LazyModule

openai = LazyModule("openai", reason="the gateway tests need the test extra (openai)")

pytestmark = pytest.mark.slow

cluster = test_gateway.cluster  # a kvindex serve --gateway and three fake pods
MODEL, SYSTEM, metric = test_gateway.MODEL, test_gateway.SYSTEM, test_gateway.metric

# A 1x1 PNG: a data: URL, so nothing is fetched from a network.
PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
    "z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
IMAGE = {"type": "image_url", "image_url": {"url": PNG}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}}
VIDEO = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAIGZ0eXA="}}


def with_part(part: dict) -> list[dict]:
    """A conversation whose last user message carries ``part`` after its text."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]},
    ]


def test_a_chat_with_an_image_is_served_with_its_body_untouched(cluster) -> None:
    client = cluster.openai()
    text_only = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=text_only, max_tokens=2
    )
    holder = first.headers["x-kvindex-pod"]
    cluster.wait_indexed(holder, cluster.pod(holder).prompts[-1])
    decided = 'kvindex_route_decisions_total{reason="fallback_multimodal"}'
    before = metric(cluster.server.url, decided)

    answer = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=with_part(IMAGE), max_tokens=3
    )
    assert answer.status_code == 200
    assert answer.headers["x-kvindex-route-reason"] == "fallback_multimodal"
    assert answer.parse().choices[0].message.content == "w0 w1 w2 "
    endpoint, received, _ = cluster.pod(answer.headers["x-kvindex-pod"]).received[-1]
    assert endpoint == "chat" and json.loads(received)["messages"] == with_part(IMAGE)
    assert metric(cluster.server.url, decided) == before + 1

    # Byte for byte, whatever the client wrote.
    body = json.dumps({"model": MODEL, "messages": with_part(IMAGE), "max_tokens": 1}).encode()
    raw = httpx.post(f"{cluster.server.url}/v1/chat/completions", content=body, timeout=30)
    assert raw.status_code == 200, raw.text
    assert cluster.pod(raw.headers["x-kvindex-pod"]).received[-1][1] == body

    # Text-only turns still route by their prefix.
    follow_up = [
        *text_only,
        {"role": "assistant", "content": "w0 w1 "},
        {"role": "user", "content": "And?"},
    ]
    second = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=follow_up, max_tokens=2
    )
    assert (second.headers["x-kvindex-pod"], second.headers["x-kvindex-route-reason"]) == (
        holder,
        "prefix",
    )
    cluster.wait_released()


def test_audio_and_unknown_parts_are_served_through_a_separate_gateway(cluster) -> None:
    """Over HTTP to the index (``kvindex gateway --index URL``): the gateway sends /route
    the messages with the media cut out, and /route decides by load."""
    command = [
        sys.executable,
        "-m",
        "kvindex.api.serve.cli",
        "gateway",
        "--index",
        cluster.server.url,
    ]
    with ServeProcess(
        "--model-config", str(cluster.config), command=command, env={**os.environ}
    ) as gateway:
        gateway.wait_ready(30.0, path="/health")
        client = cluster.openai(gateway.url)
        for part, reason in [
            (AUDIO, "fallback_multimodal"),
            ({"type": "x-sketch", "x-sketch": {"strokes": 3}}, "fallback_untokenizable"),
        ]:
            answer = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=with_part(part), max_tokens=2
            )
            assert answer.headers["x-kvindex-route-reason"] == reason
            received = cluster.pod(answer.headers["x-kvindex-pod"]).received[-1][1]
            assert json.loads(received)["messages"] == with_part(part)
        cluster.wait_released()


def test_route_decides_on_load_for_messages_it_cannot_tokenize(cluster) -> None:
    # Larger than --max-prompt-chars (4,000,000) as text: an image, not a long prompt.
    large = {"type": "image_url", "image_url": {"url": PNG + "A" * 4_000_000}}
    for part, reason in [
        (IMAGE, "fallback_multimodal"),
        (large, "fallback_multimodal"),
        (AUDIO, "fallback_multimodal"),
        (VIDEO, "fallback_multimodal"),
        ({"type": "x-sketch"}, "fallback_untokenizable"),
    ]:
        decision = cluster.index.route(model=MODEL, messages=with_part(part), request_id="mm")
        assert decision.reason == reason
        assert decision.pod in {p.pod for p in cluster.pods}
        assert any(part["type"] in w for w in decision.warnings), decision.warnings
        assert cluster.index.done("mm") is not None
    # /score cannot score them: a 400 that says where such a request goes.
    with pytest.raises(ApiError) as refused:
        cluster.index.score(model=MODEL, messages=with_part(IMAGE))
    assert refused.value.status == 400
    assert "image_url" in refused.value.detail and "/route" in refused.value.detail

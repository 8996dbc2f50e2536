"""``kvindex serve --gateway`` and its models' tokenizers, through a running process.

The gateway has only text: without the model's tokenizer every request it routes falls
back to load alone and is answered as usual. That must be loud: one startup warning
naming the setting, ``/readyz`` failing with the reason, and each answer's decision in
its ``x-kvindex-route-reason`` header and in ``kvindex_gateway_route_decisions_total``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvindex.api.testing import ServeProcess, free_port
from tests.chat_models import model_directory
from tests.fake_vllm import FakeVllmPod
from tests.support.lazy import installed

pytestmark = pytest.mark.skipif(
    not installed("openai"), reason="the fake vLLM pod needs the test extra"
)

MODEL = "acme/gateway-oss"
WARNING = "no usable tokenizer for 'acme/gateway-oss'"


@pytest.fixture
def pod_tokenizer(tmp_path: Path) -> Path:
    return model_directory("gpt-oss", tmp_path)


@pytest.fixture
def pod(pod_tokenizer: Path) -> Iterator[FakeVllmPod]:
    """A vLLM pod kvindex knows by --pod-role; its events go nowhere (not needed here)."""
    pod = FakeVllmPod(MODEL, pod_tokenizer, f"tcp://127.0.0.1:{free_port()}")
    try:
        yield pod
    finally:
        pod.close()


def serve_gateway(config: Path, pod: FakeVllmPod, hub: Path) -> ServeProcess:
    return ServeProcess(
        "--gateway", "--zmq-bind", f"tcp://127.0.0.1:{free_port()}",
        "--model-config", str(config), "--pod-role", f"{pod.pod}=both",
        # an empty Hugging Face cache: no tokenizer comes from this machine's own
        env={**os.environ, "HF_HOME": str(hub), "HF_HUB_CACHE": str(hub / "hub")},
    )  # fmt: skip


def complete(server: ServeProcess) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Route me by my prefix, please.", "max_tokens": 2}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


def decisions(server: ServeProcess) -> dict[str, float]:
    page = httpx.get(f"{server.url}/metrics", timeout=5).text
    prefix = 'kvindex_gateway_route_decisions_total{reason="'
    out = {}
    for line in page.splitlines():
        if line.startswith(prefix):
            reason, _, value = line[len(prefix) :].partition('"} ')
            out[reason] = float(value)
    return out


def test_a_gateway_without_its_models_tokenizer_warns_and_is_not_ready(
    tmp_path: Path, pod: FakeVllmPod
) -> None:
    config = tmp_path / "kvindex.json"
    config.write_text(json.dumps({"models": {MODEL: {"block_size": 16}}}))  # no tokenizer
    with serve_gateway(config, pod, tmp_path / "hf") as server:
        server.wait_ready(30.0, path="/healthz")
        ready = httpx.get(f"{server.url}/readyz", timeout=5)
        assert ready.status_code == 503
        (problem,) = [p for p in ready.json()["problems"] if "tokenizer" in p]
        assert "fallback_tokenizer_unavailable" in problem
        assert "`tokenizer: <dir with tokenizer.json>`" in problem, problem
        warnings = [line for line in server.log_tail(50_000).splitlines() if WARNING in line]
        assert len(warnings) == 1, server.log_tail()
        assert "WARNING" in warnings[0] and "--model-config" in warnings[0]

        # Served all the same (the pod would serve it), and the fallback is on the answer.
        answer = complete(server)
        assert answer.headers["x-kvindex-pod"] == pod.pod
        assert answer.headers["x-kvindex-route-reason"] == "fallback_tokenizer_unavailable"
        assert decisions(server) == {"fallback_tokenizer_unavailable": 1.0}


def test_a_gateway_with_its_models_tokenizer_is_ready_and_routes_by_cache(
    tmp_path: Path, pod: FakeVllmPod, pod_tokenizer: Path
) -> None:
    config = tmp_path / "kvindex.json"
    config.write_text(json.dumps({"models": {MODEL: {"tokenizer": str(pod_tokenizer)}}}))
    with serve_gateway(config, pod, tmp_path / "hf") as server:
        server.wait_ready(30.0)  # /readyz: 200
        assert WARNING not in server.log_tail(50_000)
        reasons = []
        for _ in range(2):
            answer = complete(server)
            assert answer.headers["x-kvindex-pod"] == pod.pod
            reasons.append(answer.headers["x-kvindex-route-reason"])
        assert not any(reason.startswith("fallback") for reason in reasons), reasons
        counted = decisions(server)
        assert counted == {r: float(reasons.count(r)) for r in set(reasons)}

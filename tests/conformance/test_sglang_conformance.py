"""Conformance: kvindex against SGLang 0.5.23's own event classes and publisher.

``kvindex serve`` runs as a real process with one model served by two SGLang pods and
one vLLM pod (a mixed cluster: ``engines: [vllm, sglang]``, keyed by token content).
The SGLang pods are SGLang's own ``ZmqEventPublisher`` publishing SGLang's own
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (``sglang_driver.py``, under
the interpreter of ``sglang_env.sh``'s venv) over loopback into kvindex's bound socket,
with replay served on each pod's address; the vLLM pod is kvindex's vLLM 0.33 publisher.
``/score`` by token ids must equal what each pod holds (the driver's truth).

Run: ``bash tests/conformance/sglang_env.sh`` once (makes ``.venv-sglang``), then
``.venv/bin/python -m pytest tests/conformance/test_sglang_conformance.py``. Without an
SGLang interpreter the test skips, except in CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from tests.support.sglang import require_sglang_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

DRIVER = Path(__file__).with_name("sglang_driver.py")
MODEL = "conformance/mixed"
POD_A, POD_B, VLLM_POD = "127.0.0.41:8000", "127.0.0.42:8000", "127.0.0.45:8000"
PAGE = 4
REQUESTS = 20


def pod_state(client: httpx.Client, pod: str) -> dict | None:
    response = client.get(f"/index/pods/{pod}")
    return response.json() if response.status_code == 200 else None


def caught_up(client: httpx.Client, pod: str, published: int) -> bool:
    report = pod_state(client, pod) or {}
    return any(
        s.get("state") == "live" and s.get("last_seq") == published - 1
        for s in report.get("streams") or []
    )


def score(client: httpx.Client, tokens: list[int], **extra: object) -> dict[str, int]:
    response = client.post("/score", json={"model": MODEL, "token_ids": tokens, **extra})
    response.raise_for_status()
    return {p["pod"]: p["matched_blocks"] for p in response.json()["pods"] if p["matched_blocks"]}


def test_sglang_publisher_and_a_vllm_pod_score_exactly_in_one_model(tmp_path: Path) -> None:
    python = require_sglang_python()
    bind_port, replay_port = free_port(), free_port()
    config = tmp_path / "models.json"
    config.write_text(
        json.dumps({"models": {MODEL: {"block_size": PAGE, "engines": ["vllm", "sglang"]}}})
    )
    server = ServeProcess(
        "--zmq-bind", f"tcp://127.0.0.1:{bind_port}",
        "--bind-allow", "127.0.0.0/8",
        "--replay-port", str(replay_port),
        "--model-config", str(config),
        # a serving worker beside the primary: what only the primary knows (the map from
        # SGLang's ids to the blocks they name) must reach answers the worker takes
        "--processes", "2",
        log_path=tmp_path / "kvindex.log",
    )  # fmt: skip
    driver = None
    vllm = None
    client = httpx.Client(base_url=server.url, timeout=10.0)
    try:
        server.wait_ready(60.0)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        with open(tmp_path / "driver.log", "wb") as log:
            driver = subprocess.Popen(
                [python, str(DRIVER), "--publish", f"tcp://127.0.0.1:{bind_port}", MODEL,
                 str(replay_port)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
            )  # fmt: skip
        assert driver.stdout is not None
        line = driver.stdout.readline()
        assert line, (tmp_path / "driver.log").read_text()[-3000:]
        answer = json.loads(line)
        truth, published = answer["truth"], answer["published"]

        # The vLLM pod of the same model holds the chat prompt's first 3 pages, under
        # vLLM's own (uint64) hashes: token-content keys make the two engines agree.
        chat = truth["prompts"]["chat"]
        vllm = EnginePublisher(
            f"tcp://127.0.0.1:{bind_port}", topic=f"kv@{VLLM_POD}@{MODEL}", vllm_version="0.33"
        )
        assert vllm.wait_for_subscribers(1, timeout_s=10.0)
        vllm.publish([BlockStored([2**64 - 3, 2**63 + 5, 11], None, chat[: 3 * PAGE], PAGE)])

        # SGLang's PUB socket drops what it sends before kvindex's subscription reaches
        # it, which can be every batch of a pod on a loaded machine: then one more
        # (empty) batch per pod, whose seq shows kvindex the gap to replay.
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if all(pod_state(client, pod) is not None for pod in published):
                break
            time.sleep(0.05)
        else:
            assert driver.stdin is not None
            driver.stdin.write("again\n")
            driver.stdin.flush()
            assert json.loads(driver.stdout.readline()) == {"again": True}
            published = {pod: count + 1 for pod, count in published.items()}

        for pod, count in [*published.items(), (VLLM_POD, 1)]:
            eventually(
                lambda pod=pod, count=count: caught_up(client, pod, count),
                f"{pod} to apply its {count} batches ({pod_state(client, pod)})\n"
                f"{server.log_tail(2000)}",
                timeout_s=30.0,
            )
        assert score(client, chat) == {POD_A: len(truth[POD_A]["gpu"]), VLLM_POD: 3}
        other = truth["prompts"]["other"]
        assert score(client, other) == {POD_B: len(truth[POD_B]["gpu"])}
        salted = truth["prompts"]["salted"]
        assert score(client, salted, cache_salt=truth["salt"]) == {POD_A: 2}
        assert score(client, salted) == {}
        # SGLang's published ids (signed) name the blocks wherever they are cached: on
        # the vLLM pod too, whose own hashes differ
        body = {"model": MODEL, "block_hashes": truth["chat_ids"]}
        for _ in range(REQUESTS):  # each on its own connection: both processes answer
            response = httpx.post(f"{server.url}/score", json=body, timeout=10.0)
            response.raise_for_status()
            matched = {p["pod"]: p["matched_blocks"] for p in response.json()["pods"]}
            assert {p: n for p, n in matched.items() if n} == {POD_A: 5, VLLM_POD: 3}
        assert any(h < 0 for h in truth["chat_ids"])
    finally:
        client.close()
        if vllm is not None:
            vllm.close()
        if driver is not None:
            if driver.stdin is not None:
                driver.stdin.close()
            try:
                driver.wait(timeout=15)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait(timeout=5)
        server.stop()

"""An image chat's next turn goes back to the pod that computed its session, end to end.

vLLM 0.33's own engine code (the conformance driver: a real ``KVCacheManager`` and
``ZmqEventPublisher``) computes an image chat's first turn under a client session, so its
``BlockStored`` events carry the session id; a real ``kvindex serve --gateway`` ingests
them over ZMQ on loopback. Two stand-in pods (:mod:`tests.fake_vllm`) serve the OpenAI
API and vLLM's /metrics under the same pod ids; their own events go nowhere, so the
index holds what vLLM published. kvindex cannot score an image chat (it cannot compute
vLLM's multimodal identifiers), so without a session id the turn goes by load, to the
idle pod; with ``X-Session-ID`` it goes to the session's pod (reason ``session``).
The same with SGLang 0.5.23's own publisher (``sglang_driver.py``), whose stores carry
the session ids of its workload.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvindex.api.client import ApiError, Client
from kvindex.api.testing import ServeProcess, eventually, free_port
from tests.chat_models import model_directory
from tests.conformance.harness import DriverProcess, Kvindex
from tests.support.lazy import LazyModule
from tests.support.sglang import require_sglang_python
from tests.support.vllm import vllm_python

openai = LazyModule("openai", reason="the gateway tests need the test extra (openai)")
from tests.fake_vllm import FakeVllmPod  # noqa: E402  (imports transformers)

pytestmark = pytest.mark.slow

MODEL = "acme/session-oss"
HOSTS = ("127.0.0.61", "127.0.0.62")  # the session's pod, the idle one
PNG = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
    "z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
IMAGE_CHAT = [
    {"role": "system", "content": "You describe pictures."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "And this one?"},
            {"type": "image_url", "image_url": {"url": PNG}},
        ],
    },
]


def metric(url: str, line: str) -> float:
    for sample in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if sample.startswith(line + " "):
            return float(sample.rsplit(" ", 1)[1])
    return 0.0


# One process, and a primary with a serving worker (--processes 2), whose relay carries
# the gateway's requests and /route to the primary, which ingests and decides.
def wait_scraped(client: Client, pods: list[str], busier: str) -> None:
    """Until /route has scraped every pod and sees ``busier`` at KV usage 0.5. The probe
    names a model kvindex does not know: no prompt keys, so no session home left behind."""

    def scraped() -> bool:
        probe = client.route(model="probe/unknown", token_ids=[7] * 16, request_id="probe")
        client.done("probe")
        rows = {c.pod: c for c in probe.candidates}
        return rows.keys() == set(pods) and rows[busier].kv_usage == 0.5

    eventually(scraped, f"every pod scraped, {busier} busier")


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "with-worker"])
def cluster(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[dict[str, Any]]:
    python = vllm_python()
    if python is None or not os.path.exists(python):
        message = f"no vLLM interpreter at {python} (set KVTEST_VLLM_PYTHON)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    tmp = tmp_path_factory.mktemp("session")
    tokenizer = model_directory("gpt-oss", tmp)
    config = tmp / "kvindex.json"
    model = {"tokenizer": str(tokenizer), "block_size": 16, "hash_algo": "sha256"}
    config.write_text(json.dumps({"models": {MODEL: model}}))
    bind_port, replay_port = free_port(), free_port()
    driver = DriverProcess(python, tmp / "driver.log")
    server = None
    pods: list[FakeVllmPod] = []
    try:
        ready = driver.answer(timeout_s=300)  # importing vLLM (torch) is most of it
        assert ready.get("vllm") == "0.33.0", ready
        server = ServeProcess(
            "--gateway", "--zmq-bind", f"tcp://127.0.0.1:{bind_port}",
            "--bind-allow", "127.0.0.0/8", "--replay-port", str(replay_port),
            "--model-config", str(config), "--load-interval", "1", "--load-timeout", "1",
            "--processes", request.param, log_path=tmp / "kvindex.log", env={**os.environ},
        )  # fmt: skip
        server.wait_ready(60.0)
        # The stand-ins' own events go to an endpoint nobody binds: vLLM's are the index's.
        nowhere = f"tcp://127.0.0.1:{free_port()}"
        pods = [FakeVllmPod(MODEL, tokenizer, nowhere, host=host) for host in HOSTS]
        engines = [
            {
                "pod": pod.pod,
                "endpoint": f"tcp://127.0.0.1:{bind_port}",
                "replay_endpoint": f"tcp://{host}:{replay_port}",
                "topic": f"kv@{pod.pod}@{MODEL}",
                "host_ip": host,
            }
            for pod, host in zip(pods, HOSTS, strict=True)
        ]
        driver.call("start_pods", pods=engines)
        session_pod, idle_pod = pods
        published = driver.call(
            "run",
            timeout_s=240,
            workloads=[
                {"pod": session_pod.pod, "workload": "image_chat_session"},
                {"pod": idle_pod.pod, "workload": "chat"},
            ],
        )["published"]
        index = Kvindex(server.url)
        for pod in pods:
            eventually(
                lambda pod=pod: index.caught_up(pod.pod, published[pod.pod]),
                f"{pod.pod} to apply its {published[pod.pod]} batches\n{server.log_tail(2000)}",
                timeout_s=60.0,
            )
        index.close()
        # Busier: a load-only decision takes the other pod. (A prompt kvindex cannot read
        # has no length to queue, so KV usage is the load term that tells pods apart.)
        session_pod.kv_usage = 0.5
        client = Client(server.url, timeout=10.0)

        wait_scraped(client, [p.pod for p in pods], busier=session_pod.pod)
        yield {
            "server": server,
            "client": client,
            "session_pod": session_pod,
            "idle_pod": idle_pod,
            "session": f"image-chat@{session_pod.pod}",
        }
        client.close()
    finally:
        driver.close()
        for pod in pods:
            pod.close()
        if server is not None:
            server.stop()


def _chat(cluster: dict[str, Any], headers: dict[str, str], **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": IMAGE_CHAT, "max_tokens": 2, **extra}
    answer = httpx.post(
        f"{cluster['server'].url}/v1/chat/completions",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json", **headers},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    return answer


def test_an_image_chats_next_turn_goes_to_its_sessions_pod(cluster: dict[str, Any]) -> None:
    url, session = cluster["server"].url, cluster["session"]
    session_pod, idle_pod = cluster["session_pod"], cluster["idle_pod"]
    counted = 'kvindex_route_decisions_total{reason="session"}'
    before = metric(url, counted)

    answer = _chat(cluster, {"X-Session-ID": session})
    assert answer.headers["x-kvindex-route-reason"] == "session"
    assert answer.headers["x-kvindex-pod"] == session_pod.pod
    # The pod gets the client's request unchanged: its body and the session header.
    _, received, headers = session_pod.received[-1]
    assert json.loads(received)["messages"] == IMAGE_CHAT
    assert headers["x-session-id"] == session
    assert metric(url, counted) == before + 1

    # vLLM's other places for it: the body's session_id, then vllm_xargs.session_id.
    for extra in ({"session_id": session}, {"vllm_xargs": {"session_id": session}}):
        answer = _chat(cluster, {}, **extra)
        assert answer.headers["x-kvindex-route-reason"] == "session"
        assert answer.headers["x-kvindex-pod"] == session_pod.pod

    # Without a session id (or with one kvindex has not seen): by load, as before.
    for headers in ({}, {"X-Session-ID": "a-session-nobody-stored"}):
        answer = _chat(cluster, headers)
        assert answer.headers["x-kvindex-route-reason"] == "fallback_multimodal"
        assert answer.headers["x-kvindex-pod"] == idle_pod.pod


def test_a_prompt_the_index_can_score_is_decided_by_its_cost(cluster: dict[str, Any]) -> None:
    """The session id decides only where the prompt cannot be scored: a scored prompt
    is routed by its prefix and load, whatever session it names
    (tests/test_routing.py holds the cases where a prefix elsewhere wins)."""
    client, session = cluster["client"], cluster["session"]
    decision = client.route(
        model=MODEL, token_ids=list(range(100, 164)), request_id="text", session_id=session
    )
    client.done("text")
    assert decision.reason == "load"


@pytest.mark.parametrize(
    ("session_id", "expected"),
    [
        ("s" * 257, "length <= 256"),
        (123, "Expected `str | null`"),
        ("", "length >= 1"),
    ],
)
def test_bad_session_ids_are_refused_with_a_clear_400(
    cluster: dict[str, Any], session_id: Any, expected: str
) -> None:
    body = {"model": MODEL, "token_ids": [1, 2, 3], "session_id": session_id}
    answer = httpx.post(f"{cluster['server'].url}/route", json=body, timeout=10)
    assert answer.status_code == 400
    detail = answer.json()["detail"]
    assert expected in detail and "session_id" in detail, detail


def test_the_client_refuses_a_bad_session_id_too(cluster: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as refused:
        cluster["client"].route(model=MODEL, token_ids=[1, 2, 3], session_id="x" * 300)
    assert refused.value.status == 400


SGLANG_DRIVER = Path(__file__).parent / "conformance" / "sglang_driver.py"
SGLANG_HOSTS = ("127.0.0.63", "127.0.0.64")


def test_an_sglang_pods_session_takes_its_image_chat_back(tmp_path: Path) -> None:
    """SGLang 0.5.23's own publisher: pod A stored for sessions s1 and s2, pod B for s3,
    then cleared its cache, then stored for s4 (``sglang_driver.py``'s workload). SGLang
    reads a session id from the body's ``session_id`` only."""
    python = require_sglang_python()
    tokenizer = model_directory("gpt-oss", tmp_path)
    config = tmp_path / "kvindex.json"
    model = {"tokenizer": str(tokenizer), "block_size": 4, "engines": ["sglang"]}
    config.write_text(json.dumps({"models": {MODEL: model}}))
    bind_port, replay_port = free_port(), free_port()
    server = ServeProcess(
        "--gateway", "--zmq-bind", f"tcp://127.0.0.1:{bind_port}",
        "--bind-allow", "127.0.0.0/8", "--replay-port", str(replay_port),
        "--model-config", str(config), "--load-interval", "1", "--load-timeout", "1",
        log_path=tmp_path / "kvindex.log", env={**os.environ},
    )  # fmt: skip
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    pods: list[FakeVllmPod] = []
    driver = None
    try:
        server.wait_ready(60.0)
        pods = [FakeVllmPod(MODEL, tokenizer, nowhere, host=host) for host in SGLANG_HOSTS]
        pod_a, pod_b = pods
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        with open(tmp_path / "driver.log", "wb") as log:
            driver = subprocess.Popen(
                [python, str(SGLANG_DRIVER), "--publish", f"tcp://127.0.0.1:{bind_port}",
                 MODEL, str(replay_port), f"{pod_a.pod},{pod_b.pod}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
            )  # fmt: skip
        assert driver.stdout is not None and driver.stdin is not None
        line = driver.stdout.readline()
        assert line, (tmp_path / "driver.log").read_text()[-3000:]
        published = json.loads(line)["published"]
        index = Kvindex(server.url)
        try:
            # SGLang's PUB socket drops what it sends before kvindex's subscription
            # reaches it: then one more (empty) batch per pod, whose seq shows the gap.
            eventually(lambda: all(index.pod_report(p) for p in published), "pods heard", 10)
        except AssertionError:
            driver.stdin.write("again\n")
            driver.stdin.flush()
            assert json.loads(driver.stdout.readline()) == {"again": True}
            published = {pod: count + 1 for pod, count in published.items()}
        for pod, count in published.items():
            eventually(
                lambda pod=pod, count=count: index.caught_up(pod, count),
                f"{pod} to apply its {count} batches\n{server.log_tail(2000)}",
                timeout_s=30.0,
            )
        index.close()
        pod_a.kv_usage = 0.5  # busier: a load-only decision takes pod B
        client = Client(server.url, timeout=10.0)

        wait_scraped(client, [p.pod for p in pods], busier=pod_a.pod)
        cluster = {"server": server}
        for session, pod, reason in [
            ("s1", pod_a, "session"),
            ("s2", pod_a, "session"),  # a salted prompt's session: still pod A's
            ("s4", pod_b, "session"),
            ("s3", pod_b, "fallback_multimodal"),  # its pod cleared its cache since
        ]:
            answer = _chat(cluster, {}, session_id=session)
            assert answer.headers["x-kvindex-route-reason"] == reason, session
            assert answer.headers["x-kvindex-pod"] == pod.pod, session
        client.close()
    finally:
        if driver is not None:
            if driver.stdin is not None:
                driver.stdin.close()
            driver.wait(timeout=30)
        for pod in pods:
            pod.close()
        server.stop()

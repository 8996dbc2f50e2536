"""The gateway under P/D disaggregation, end to end: ``kvindex serve --gateway`` with a
prefill pod and a decode pod (``--pod-role``), the real ``openai`` client, and fake vLLM
pods that record what they received (:mod:`tests.fake_vllm`).

``kv-transfer`` (in-process gateway): the prefill pod gets a one-token, unstreamed
request asking it to keep the KV for a remote decode; the decode pod gets the client's
request plus the prefill pod's ``kv_transfer_params``. ``sidecar`` (``kvindex gateway
--gateway-pd-mode sidecar``): the decode pod gets the request unchanged with
``x-prefiller-host-port``, and the prefill pod nothing.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator

import httpx
import pytest

from kvindex.api.client import Client
from kvindex.api.testing import ServeProcess, eventually, free_port
from tests.chat_models import model_directory
from tests.support.lazy import LazyModule
from tests.test_gateway import DOCUMENT, MODEL

openai = LazyModule("openai", reason="the gateway tests need the test extra (openai)")
from tests.fake_vllm import FakeVllmPod  # noqa: E402  (imports transformers)

pytestmark = pytest.mark.slow


class PdCluster:
    def __init__(self, server: ServeProcess, prefill: FakeVllmPod, decode: FakeVllmPod) -> None:
        self.server, self.prefill, self.decode = server, prefill, decode
        self.index = Client(server.url, timeout=5.0)

    def openai(self, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{url or self.server.url}/v1", api_key="none", max_retries=0, timeout=30
        )

    def open_routes(self) -> dict[str, int]:
        """kvindex's in-flight count per pod, read from a probe route (released)."""
        # a model kvindex does not know: no prompt keys, so no session home left behind
        probe = self.index.route(model="probe/unknown", token_ids=[7] * 16, request_id="probe")
        self.index.done("probe")
        return {c.pod: c.in_flight for c in probe.candidates if c.in_flight}

    def metric(self, line: str, url: str | None = None) -> float:
        """The value of the sample ``line`` (name and labels) on /metrics, 0 if absent."""
        page = httpx.get(f"{url or self.server.url}/metrics", timeout=5).text
        for sample in page.splitlines():
            if sample.startswith(line + " "):
                return float(sample.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    tmp = tmp_path_factory.mktemp("gateway-pd")
    tokenizer = model_directory("gpt-oss", tmp)
    config = tmp / "kvindex.json"
    config.write_text(json.dumps({"models": {MODEL: {"tokenizer": str(tokenizer)}}}))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # The pods first: their ports go into --pod-role (their publishers connect when the
    # index binds).
    prefill = FakeVllmPod(MODEL, tokenizer, endpoint)
    decode = FakeVllmPod(MODEL, tokenizer, endpoint)
    server = ServeProcess(
        "--gateway", "--zmq-bind", endpoint, "--model-config", str(config),
        "--pod-role", f"{prefill.pod}=prefill", "--pod-role", f"{decode.pod}=decode",
        "--pd-threshold", "16", "--load-interval", "0.5", "--route-ttl", "120",
        env={**os.environ},
    )  # fmt: skip
    try:
        server.wait_ready(30.0)
        for i, pod in enumerate((prefill, decode)):
            assert pod.publisher.wait_for_subscribers(1, 10.0)
            pod.compute(pod.tokens_of("completion", {"prompt": f"warm up pod {i} " * 4}))
        cluster = PdCluster(server, prefill, decode)
        eventually(
            lambda: {p.pod for p in cluster.index.pods()} == {prefill.pod, decode.pod},
            "pods known",
        )

        def scraped() -> bool:
            probe = cluster.index.route(model=MODEL, token_ids=[7] * 64, request_id="p")
            cluster.index.done("p")
            return all(c.load == "known" for c in probe.candidates)

        eventually(scraped, "pods scraped")
        yield cluster
    finally:
        prefill.close()
        decode.close()
        server.stop()


def test_kv_transfer_prefills_on_the_prefill_pod_then_decodes_with_its_params(cluster) -> None:
    prompt = "Prefill me remotely. " + DOCUMENT
    seen_p, seen_d = len(cluster.prefill.received), len(cluster.decode.received)
    stream = cluster.openai().completions.with_raw_response.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": 2},
    )
    assert stream.headers["x-kvindex-pod"] == cluster.decode.pod
    assert stream.headers["x-kvindex-prefill-pod"] == cluster.prefill.pod
    chunks = list(stream.parse())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "w0 w1 w2 w3 w4 "

    # The prefill leg: one token, not streamed, no stream options or minimum, keep the KV.
    [(_, raw_p, headers_p)] = cluster.prefill.received[seen_p:]
    leg = json.loads(raw_p)
    assert leg["prompt"] == prompt and leg["max_tokens"] == 1 and leg["stream"] is False
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert leg["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    # The prefill pod computed the prompt (its blocks went to the index as events).
    assert cluster.prefill.prompts[-1] == cluster.prefill.tokens_of("completion", leg)

    # The decode leg: the client's request as sent, plus the prefill pod's answer.
    [(_, raw_d, headers_d)] = cluster.decode.received[seen_d:]
    decoded = json.loads(raw_d)
    params = decoded.pop("kv_transfer_params")
    assert decoded == {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 2,
    }
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == cluster.prefill.engine_id
    assert f"{params['remote_host']}:{params['remote_port']}" == cluster.prefill.pod
    assert params["remote_block_ids"] and "x-prefiller-host-port" not in headers_d
    # One request id for both legs, so the two engines' logs and KV transfer match up.
    assert headers_p["x-request-id"] == headers_d["x-request-id"]
    assert cluster.metric('kvindex_gateway_prefill_total{outcome="remote"}') >= 1
    # The route is released on both pods once the answer ends (the prefill pod's share
    # too, not left to --route-ttl).
    eventually(lambda: cluster.open_routes() == {}, "both pods' shares released", 5.0)


def test_chat_prefill_caps_max_completion_tokens(cluster) -> None:
    seen_p = len(cluster.prefill.received)
    messages = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Hi"}]
    answer = cluster.openai().chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=3
    )
    assert answer.choices[0].message.content == "w0 w1 w2 "
    [(endpoint, raw_p, _)] = cluster.prefill.received[seen_p:]
    leg = json.loads(raw_p)
    assert endpoint == "chat" and leg["messages"] == messages
    assert (leg["max_tokens"], leg["max_completion_tokens"]) == (1, 1)
    decoded = json.loads(cluster.decode.received[-1][1])
    assert decoded["max_completion_tokens"] == 3 and "max_tokens" not in decoded


def test_a_prefill_pod_without_kv_transfer_leaves_the_prefill_to_the_decode_pod(cluster) -> None:
    failed = cluster.metric('kvindex_gateway_prefill_total{outcome="failed"}')
    cluster.prefill.kv_transfer = False  # as a vLLM started without --kv-transfer-config
    try:
        prompt = "No connector on the prefill pod. " + DOCUMENT
        answer = cluster.openai().completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    finally:
        cluster.prefill.kv_transfer = True
    assert answer.choices[0].text == "w0 w1 "
    # The decode pod got the client's body unchanged, and computed the whole prompt.
    assert json.loads(cluster.decode.received[-1][1]) == {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 2,
    }
    assert cluster.metric('kvindex_gateway_prefill_total{outcome="failed"}') == failed + 1
    assert cluster.metric('kvindex_gateway_upstream_errors_total{kind="prefill"}') >= 1


def test_sidecar_mode_names_the_prefill_pod_to_the_decode_pods_sidecar(cluster) -> None:
    command = [
        sys.executable,
        "-m",
        "kvindex.api.serve.cli",
        "gateway",
        "--index",
        cluster.server.url,
    ]
    with ServeProcess(
        "--gateway-pd-mode", "sidecar", command=command, env={**os.environ}
    ) as gateway:
        gateway.wait_ready(30.0, path="/health")
        seen_p = len(cluster.prefill.received)
        prompt = "Through the sidecar. " + DOCUMENT
        answer = cluster.openai(gateway.url).completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=3
        )
        assert answer.parse().choices[0].text == "w0 w1 w2 "
        assert answer.headers["x-kvindex-prefill-pod"] == cluster.prefill.pod
        _, raw_d, headers_d = cluster.decode.received[-1]
        assert headers_d["x-prefiller-host-port"] == cluster.prefill.pod
        assert json.loads(raw_d) == {"model": MODEL, "prompt": prompt, "max_tokens": 3}
        assert cluster.prefill.received[seen_p:] == []  # the sidecar's job, not the gateway's
        line = 'kvindex_gateway_prefill_total{outcome="sidecar"}'
        assert cluster.metric(line, gateway.url) == 1
        assert cluster.metric('kvindex_gateway_requests_total{outcome="ok"}', gateway.url) == 1


def test_a_decode_pod_that_never_got_the_request_is_replaced_without_a_second_prefill(
    tmp_path,
) -> None:
    """The prefill leg succeeded, then the chosen decode pod refused the connection: the
    request never reached it, so the prefill pod still holds the KV for whoever reads it
    first. The retry goes to another decode pod with the same kv_transfer_params, and
    the prefill pod is not asked again."""
    tokenizer = model_directory("gpt-oss", tmp_path)
    config = tmp_path / "kvindex.json"
    config.write_text(json.dumps({"models": {MODEL: {"tokenizer": str(tokenizer)}}}))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    prefill = FakeVllmPod(MODEL, tokenizer, endpoint)
    doomed = FakeVllmPod(MODEL, tokenizer, endpoint)  # idle: the decode pod chosen
    spare = FakeVllmPod(MODEL, tokenizer, endpoint)
    spare.waiting = 8  # queued on its /metrics: chosen only once the idle one fails
    pods = (prefill, doomed, spare)
    server = ServeProcess(
        "--gateway", "--zmq-bind", endpoint, "--model-config", str(config),
        "--pod-role", f"{prefill.pod}=prefill", "--pod-role", f"{doomed.pod}=decode",
        "--pod-role", f"{spare.pod}=decode", "--pd-threshold", "16",
        # A pod's last good scrape stays its load for 3 intervals: the doomed pod is
        # still the decode choice right after it went away.
        "--load-interval", "2", "--load-timeout", "1", "--route-ttl", "120",
        env={**os.environ},
    )  # fmt: skip
    try:
        server.wait_ready(30.0)
        index = Client(server.url, timeout=5.0)

        def doomed_decodes() -> bool:
            probe = index.route(model=MODEL, token_ids=[7] * 64, request_id="p")
            index.done("p")
            scraped = all(c.load == "known" for c in probe.candidates)
            return scraped and probe.decode_pod == doomed.pod

        eventually(doomed_decodes, "the idle decode pod chosen, every pod scraped")
        doomed.stop_http()
        prompt = "Prefill once, decode elsewhere. " + DOCUMENT
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30
        )
        answer = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=3
        )
        assert answer.headers.get("x-kvindex-failed-pods") == doomed.pod, answer.headers
        assert answer.headers["x-kvindex-pod"] == spare.pod
        assert answer.headers["x-kvindex-prefill-pod"] == prefill.pod
        assert answer.parse().choices[0].text == "w0 w1 w2 "
        [(_, raw_p, headers_p)] = prefill.received  # one prefill leg, not two
        assert json.loads(raw_p)["kv_transfer_params"]["do_remote_decode"] is True
        [(_, raw_d, headers_d)] = spare.received
        params = json.loads(raw_d)["kv_transfer_params"]
        assert params["remote_engine_id"] == prefill.engine_id
        assert f"{params['remote_host']}:{params['remote_port']}" == prefill.pod
        assert headers_p["x-request-id"] == headers_d["x-request-id"]
    finally:
        for pod in pods:
            pod.close()
        server.stop()

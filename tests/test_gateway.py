"""The gateway end to end, driven by the real ``openai`` client: ``kvindex serve --gateway``
(and ``kvindex gateway --index URL``) as child processes, in front of fake vLLM pods on
loopback that serve the OpenAI API and vLLM's /metrics and publish real KV events over
ZMQ for what they compute (:mod:`tests.fake_vllm`)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvindex.api.client import ApiError, Client
from kvindex.api.testing import ServeProcess, eventually, free_port
from tests.chat_models import model_directory
from tests.support.lazy import LazyModule

openai = LazyModule("openai", reason="the gateway tests need the test extra (openai)")
from tests.fake_vllm import FakeVllmPod  # noqa: E402  (imports transformers)

pytestmark = pytest.mark.slow

MODEL = "acme/gateway-oss"
# Long enough for many blocks with the fixtures' small vocabulary.
DOCUMENT = " ".join(f"Section {i}: the KV cache of a prompt is reused when" for i in range(30))
SYSTEM = "You are terse. " + DOCUMENT


class Cluster:
    def __init__(self, server: ServeProcess, pods: list[FakeVllmPod], endpoint: str) -> None:
        self.server, self.pods, self.endpoint = server, pods, endpoint
        self.index = Client(server.url, timeout=5.0)

    def openai(self, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{url or self.server.url}/v1", api_key="none", max_retries=0, timeout=30
        )

    def pod(self, pod_id: str) -> FakeVllmPod:
        return next(p for p in self.pods if p.pod == pod_id)

    def open_routes(self, prefills: bool = False) -> dict[str, int]:
        """kvindex's in-flight count per pod (or, with ``prefills``, its prefill tokens
        queued), read from a probe route (released)."""
        # a model kvindex does not know: no prompt keys, so no session home left behind
        probe = self.index.route(model="probe/unknown", token_ids=[7] * 16, request_id="probe")
        self.index.done("probe")
        if prefills:
            return {c.pod: c.queued_tokens for c in probe.candidates if c.queued_tokens}
        return {c.pod: c.in_flight for c in probe.candidates if c.in_flight}

    def wait_released(self) -> None:
        """Every route released (the gateway releases after the last byte is sent, so
        the client may see the answer a moment before)."""
        eventually(lambda: self.open_routes() == {}, "every route released", 5.0)

    def wait_indexed(self, pod: str, tokens: list[int]) -> None:
        blocks = len(tokens) // 16

        def held() -> bool:
            score = self.index.score(model=MODEL, token_ids=tokens, pods=[pod])
            return score.pods[0].matched_blocks == blocks

        eventually(held, f"{pod} holding {blocks} blocks in the index")


# Every test runs against one process, and against a primary with a serving worker
# (--processes 2), whose relay carries the gateway's requests, streams and disconnects.
@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "with-worker"])
def cluster(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("gateway")
    tokenizer = model_directory("gpt-oss", tmp)
    config = tmp / "kvindex.json"
    config.write_text(json.dumps({"models": {MODEL: {"tokenizer": str(tokenizer)}}}))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = ServeProcess(
        "--gateway", "--zmq-bind", endpoint, "--model-config", str(config),
        # A pod's last good scrape stays its load for 3 intervals: long enough that the
        # dead-pod test's pod is still preferred when it has just gone away.
        "--load-interval", "2", "--load-timeout", "1", "--route-ttl", "120",
        "--processes", request.param,
        env={**os.environ},
    )  # fmt: skip
    pods: list[FakeVllmPod] = []
    try:
        server.wait_ready(30.0)
        for i in range(3):
            pod = FakeVllmPod(MODEL, tokenizer, endpoint)
            pods.append(pod)
            assert pod.publisher.wait_for_subscribers(1, 10.0)
            pod.compute(pod.tokens_of("completion", {"prompt": f"warm up pod {i} " * 4}))
        cluster = Cluster(server, pods, endpoint)
        eventually(
            lambda: {p.pod for p in cluster.index.pods()} == {p.pod for p in pods}, "pods known"
        )
        probe = lambda: cluster.index.route(model=MODEL, token_ids=[7] * 16, request_id="p")  # noqa: E731
        eventually(lambda: all(c.load == "known" for c in probe().candidates), "pods scraped")
        cluster.index.done("p")
        cluster.config = config  # type: ignore[attr-defined]
        yield cluster
    finally:
        for pod in pods:
            pod.close()
        server.stop()


def test_the_second_request_with_a_prefix_goes_to_the_pod_that_holds_it(cluster) -> None:
    client = cluster.openai()
    first = client.completions.with_raw_response.create(
        model=MODEL, prompt=DOCUMENT + " Question one?", max_tokens=4
    )
    holder = first.headers["x-kvindex-pod"]
    assert first.parse().choices[0].text == "w0 w1 w2 w3 "
    assert cluster.pod(holder).received[-1][0] == "completion"
    cluster.wait_indexed(holder, cluster.pod(holder).prompts[-1])
    second = client.completions.with_raw_response.create(
        model=MODEL, prompt=DOCUMENT + " Question two?", max_tokens=4
    )
    assert second.headers["x-kvindex-pod"] == holder
    assert second.headers["x-kvindex-route-reason"] == "prefix"
    # The pod's own cache confirms it: most of the prompt was a hit there.
    usage = second.parse().usage
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens // 2
    cluster.wait_released()


def test_chat_turns_stay_on_the_pod_that_holds_the_conversation(cluster) -> None:
    client = cluster.openai()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=3
    )
    holder = first.headers["x-kvindex-pod"]
    answer = first.parse().choices[0].message.content
    cluster.wait_indexed(holder, cluster.pod(holder).prompts[-1])
    follow_up = [
        *messages,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Name a prime."},
    ]
    second = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=follow_up, max_tokens=3
    )
    assert (second.headers["x-kvindex-pod"], second.headers["x-kvindex-route-reason"]) == (
        holder,
        "prefix",
    )
    assert second.parse().usage.prompt_tokens_details.cached_tokens > 0
    cluster.wait_released()


def test_streamed_chunks_arrive_unchanged_and_one_by_one(cluster) -> None:
    client = cluster.openai()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count: 1, 2, 3"}],
        max_tokens=6,
        stream=True,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "w0 w1 w2 w3 w4 w5 "
    # Byte for byte: what the pod sent is what a raw client receives.
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{cluster.server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        pod = cluster.pod(r.headers["x-kvindex-pod"])
        received = [bytes(part) for part in r.iter_raw()]
    first = json.loads(received[0].split(b"\n")[0].removeprefix(b"data: "))
    sent = pod.sent_chunks[first["id"]]
    assert b"".join(received) == b"".join(sent)
    assert len(received) > 1  # relayed as they came, not gathered into one body
    cluster.wait_released()


def test_a_client_that_leaves_mid_stream_stops_the_pod_and_releases_the_route(cluster) -> None:
    body = {"model": MODEL, "prompt": "A long answer please", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{cluster.server.url}/v1/completions", json=body, timeout=30) as r:
        pod = cluster.pod(r.headers["x-kvindex-pod"])
        aborted = pod.aborted
        parts = r.iter_raw()
        next(parts), next(parts)
        assert cluster.open_routes() == {pod.pod: 1}
        # The answer began: its prefill is no longer counted as queued on the pod.
        assert cluster.open_routes(prefills=True) == {}
    eventually(lambda: pod.aborted == aborted + 1, "the pod seeing the client leave")
    cluster.wait_released()


def test_a_dead_pod_is_skipped_before_any_byte(cluster) -> None:
    doomed = FakeVllmPod(MODEL, Path(cluster.pod(cluster.pods[0].pod).tokenizer.name_or_path),
                         cluster.endpoint)  # fmt: skip
    try:
        assert doomed.publisher.wait_for_subscribers(1, 10.0)
        prompt = "Only the doomed pod computed this. " + DOCUMENT
        tokens = doomed.tokens_of("completion", {"prompt": prompt})
        doomed.compute(tokens)
        cluster.wait_indexed(doomed.pod, tokens)

        def scraped() -> bool:
            # Asked about the doomed pod alone: a route is also a speculative entry on
            # the pod it names, which must not make another pod hold this prompt.
            try:
                route = cluster.index.route(
                    model=MODEL, token_ids=tokens, request_id="d", pods=[doomed.pod]
                )
            except ApiError as exc:  # /route reads the known pods at most every 0.5 s
                if exc.code == "no_pods":
                    return False
                raise
            cluster.index.done("d")
            return route.candidates[0].load == "known"

        eventually(scraped, "the doomed pod scraped")

        def in_route_view() -> bool:
            # A request that names no pods chooses among the known pods, which /route
            # re-reads at most every 0.5 s (api/http/route_view.py); asked with an unrelated
            # prompt so that no speculative entry lands on this one.
            route = cluster.index.route(model=MODEL, token_ids=[7] * 16, request_id="v")
            cluster.index.done("v")
            return doomed.pod in {c.pod for c in route.candidates}

        eventually(in_route_view, "the route view to include the doomed pod")
        doomed.stop_http()
        answer = cluster.openai().completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=2
        )
        assert answer.headers.get("x-kvindex-failed-pods") == doomed.pod, answer.headers
        assert answer.headers["x-kvindex-pod"] in {p.pod for p in cluster.pods}
        assert answer.parse().choices[0].text == "w0 w1 "
        cluster.wait_released()
    finally:
        doomed.close()

    def written_off() -> bool:
        route = cluster.index.route(
            model=MODEL, token_ids=[7] * 16, request_id="w", pods=[doomed.pod]
        )
        cluster.index.done("w")
        return route.candidates[0].load != "known"

    # kvindex keeps the dead pod (its stream stays); until its scrape is seen failing, its
    # last load reads idle and a load-only pick in a later test could still land on it.
    eventually(written_off, "the dead pod's load no longer read as known")


def test_a_pod_page_with_an_impossible_figure_does_not_fail_the_gateway(cluster) -> None:
    """Issue 26, item 2: ``vllm:num_requests_running 1e30`` on one pod's page made every
    gateway request a 500 (the route loop's OverflowError) while that pod was a
    candidate. Now the page is that pod's scrape error: its load is unknown, and the
    gateway answers."""
    broken = cluster.pods[0]

    def load_of_broken() -> str:
        probe = cluster.index.route(model="probe/unknown", token_ids=[7] * 16, request_id="bp")
        cluster.index.done("bp")
        return next(c.load for c in probe.candidates if c.pod == broken.pod)

    broken.running = 10**30
    try:
        eventually(lambda: load_of_broken() != "known", "the broken page refused")
        answer = cluster.openai().completions.with_raw_response.create(
            model=MODEL, prompt="An ordinary request. " * 4, max_tokens=2
        )
        assert answer.http_response.status_code == 200
        assert answer.parse().choices[0].text == "w0 w1 "
        cluster.wait_released()
    finally:
        broken.running = 0
    eventually(lambda: load_of_broken() == "known", "the mended page scraped")


def test_models_health_and_refusals_in_openai_shape(cluster) -> None:
    client = cluster.openai()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{cluster.server.url}/health", timeout=5).status_code == 200
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=[], max_tokens=2)
    assert "prompt is an empty list" in str(refused.value)


def metric(url: str, line: str) -> float:
    """The value of the sample ``line`` (name and labels) on /metrics, 0 if absent."""
    for sample in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if sample.startswith(line + " "):
            return float(sample.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_outcomes_retries_upstream_errors_and_added_time(cluster) -> None:
    """What the tests above did, as /metrics counts it (they ran first, in this module)."""
    url = cluster.server.url

    def outcome(name: str) -> float:
        return metric(url, f'kvindex_gateway_requests_total{{outcome="{name}"}}')

    ok = outcome("ok")
    assert ok >= 7  # every answered request above
    assert outcome("invalid_request") >= 1  # the empty prompt list
    assert outcome("client_left") >= 1  # the client that left mid-stream
    assert metric(url, "kvindex_gateway_retries_total") >= 1  # the dead pod skipped
    assert metric(url, 'kvindex_gateway_upstream_errors_total{kind="connect"}') >= 1
    # One more request moves exactly the counters it should.
    count = metric(url, "kvindex_gateway_added_seconds_count")
    cluster.openai().completions.create(model=MODEL, prompt="count me", max_tokens=1)
    eventually(lambda: outcome("ok") == ok + 1, "the request counted when its relay ended")
    assert metric(url, "kvindex_gateway_added_seconds_count") == count + 1
    assert metric(url, "kvindex_gateway_added_seconds_sum") > 0
    with pytest.raises(openai.BadRequestError):
        cluster.openai().completions.create(model=MODEL, prompt=[], max_tokens=1)
    assert outcome("ok") == ok + 1
    cluster.wait_released()


def test_a_separate_gateway_routes_over_http(cluster) -> None:
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
        prompt = "Remote gateway. " + DOCUMENT
        first = client.completions.with_raw_response.create(model=MODEL, prompt=prompt)
        holder = first.headers["x-kvindex-pod"]
        cluster.wait_indexed(holder, cluster.pod(holder).prompts[-1])
        stream = client.completions.create(
            model=MODEL, prompt=prompt + " again", max_tokens=3, stream=True
        )
        assert "".join(c.choices[0].text for c in stream) == "w0 w1 w2 "
        assert cluster.pod(holder).received[-1][1].startswith(b"{")
        assert json.loads(cluster.pod(holder).received[-1][1])["prompt"] == prompt + " again"
        cluster.wait_released()
        # Alone, the gateway serves its own /metrics.
        assert metric(gateway.url, 'kvindex_gateway_requests_total{outcome="ok"}') == 2
        # It reports the first token over HTTP too: mid-answer, no prefill is queued.
        body = {"model": MODEL, "prompt": "Remote, long", "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=30) as r:
            parts = r.iter_raw()
            next(parts), next(parts)
            eventually(lambda: cluster.open_routes(prefills=True) == {}, "the first token reported")
            assert sum(cluster.open_routes().values()) == 1
        cluster.wait_released()


DOCS = Path(__file__).resolve().parents[1] / "docs"


def readme_snippet(page: str, after: str) -> str:
    """The first python block after ``after`` in ``docs/<page>``."""
    section = (DOCS / page).read_text(encoding="utf-8").split(after, 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize(
    ("page", "after"), [("quickstart.md", "## Python client"), ("gateway.md", "# The gateway")]
)
def test_the_readme_examples_run(cluster, capsys, page: str, after: str) -> None:
    """The docs' client and gateway examples, as written, but for this test's kvindex
    URL and model."""
    code = readme_snippet(page, after).replace("http://127.0.0.1:8080", cluster.server.url)
    exec(compile(code.replace("Qwen/Qwen3-8B", MODEL), page, "exec"), {})
    pod, printed = capsys.readouterr().out.split(" ", 1)
    assert pod in {p.pod for p in cluster.pods}
    assert printed.split()[-1].startswith("w")  # the fake pod's made-up answer
    cluster.wait_released()


def test_a_static_pod_that_never_published_is_served_through_the_gateway(tmp_path: Path) -> None:
    """Bind mode, no discovery: the gateway names no pods, so it can only use pods
    kvindex knows. A pod named by ``--pod-role`` is known from the start: before its
    first event, its first request goes to it (before: 503, no pods known)."""
    tokenizer = model_directory("gpt-oss", tmp_path)
    config = tmp_path / "kvindex.json"
    config.write_text(json.dumps({"models": {MODEL: {"tokenizer": str(tokenizer)}}}))
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pod = FakeVllmPod(MODEL, tokenizer, endpoint)  # publishes only once it computes
    try:
        with ServeProcess(
            "--gateway", "--zmq-bind", endpoint, "--model-config", str(config),
            "--pod-role", f"{pod.pod}=both", env={**os.environ},
        ) as server:  # fmt: skip
            server.wait_ready(30.0)
            assert pod.prompts == []  # nothing published: kvindex never heard from it
            client = openai.OpenAI(
                base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=30
            )
            answer = client.completions.with_raw_response.create(
                model=MODEL, prompt="Hello, static pod.", max_tokens=2
            )
            assert answer.headers["x-kvindex-pod"] == pod.pod
            assert answer.parse().choices[0].text == "w0 w1 "
    finally:
        pod.close()

"""What the gateway adds to a non-streaming request, besides tokenization.

Target (issue 11): ``kvindex serve --gateway`` adds at most 1 ms p50 to a non-streaming
``/v1/completions`` request, compared with sending it straight to the pod.

Set-up, all on loopback: two minimal OpenAI-style pods, each its own process (a fixed
JSON completion, and a vLLM-style /metrics page for the load scraper); a real
``kvindex serve --gateway`` whose index holds the prompt's blocks on pod A (published
over ZMQ), so every request is a real decision: block keys hashed, the index looked up
for both pods, the cost model run, the route entered and released. The prompt is sent
as token ids (``--prompt-tokens``, default 1,024), which vLLM accepts and which leaves
tokenization out of the figure, as the target says; the tokenizer's own cost depends on
the model's tokenizer and is not the gateway's.

One client sends requests one at a time over a keep-alive connection, alternating
rounds straight to pod A and through the gateway, so drift on a busy machine hits both
arms alike. The figure is the difference of the two p50s. ``--remote`` also measures
``kvindex gateway --index URL`` (routing over HTTP: one more loopback round trip), for
information. Prints the figures and PASS or FAIL.

    python bench/bench_gateway.py [--rounds 20] [--per-round 100] [--prompt-tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

import httpx

from kvindex.api.testing import ServeProcess, free_port

MODEL = "bench/gateway-model"
BLOCK = 16
TARGET_MS = 1.0

_METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.1\n'
)

_COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


def _pod(port: int) -> None:
    """A pod as small as an ASGI app gets: the fixed answer, and /metrics."""
    import uvicorn

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        more = True
        while more:  # read the whole body, as a real server does
            message = await receive()
            more = message.get("more_body", False)
        if scope["path"] == "/metrics":
            body, kind = _METRICS.encode(), b"text/plain; version=0.0.4"
        else:
            body, kind = _COMPLETION, b"application/json"
        headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _wait_up(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} did not come up")


def _publish(endpoint: str, pod: str, prompt: list[int]) -> None:
    from kvindex.events.publisher import EnginePublisher
    from kvindex.events.wire import BlockStored
    from kvindex.indexer.keys import BlockHasher, HashConfig

    keys = BlockHasher(HashConfig(block_size=BLOCK)).keys(prompt)
    with EnginePublisher(endpoint, topic=f"kv@{pod}@{MODEL}", bind=False) as pub:
        if not pub.wait_for_subscribers(1, 10.0):
            raise SystemExit("publisher could not reach kvindex")
        pub.publish([BlockStored(keys, None, prompt[: len(keys) * BLOCK], BLOCK)])
        time.sleep(0.5)  # let it drain before the socket closes


def _measure(
    client: httpx.Client, urls: dict[str, str], body: bytes, rounds: int, per_round: int
) -> tuple[dict[str, list[float]], dict[str, str]]:
    times: dict[str, list[float]] = {name: [] for name in urls}
    pods: dict[str, str] = {}
    headers = {"content-type": "application/json"}
    for _ in range(rounds):
        for name, url in urls.items():
            for _ in range(per_round):
                start = time.perf_counter()
                answer = client.post(url, content=body, headers=headers)
                elapsed = time.perf_counter() - start
                if answer.status_code != 200:
                    raise SystemExit(f"{name}: HTTP {answer.status_code}: {answer.text[:300]}")
                times[name].append(elapsed)
                pods[name] = answer.headers.get("x-kvindex-pod", "-")
    return times, pods


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--remote", action="store_true", help="also kvindex gateway --index")
    args = parser.parse_args()

    ports = [free_port(), free_port()]
    pod_ids = [f"127.0.0.1:{p}" for p in ports]
    pods = [multiprocessing.Process(target=_pod, args=(p,), daemon=True) for p in ports]
    for process in pods:
        process.start()
    bind = f"tcp://127.0.0.1:{free_port()}"
    server = ServeProcess(
        "--gateway", "--zmq-bind", bind, "--model", MODEL, "--log-level", "warning",
        "--load-interval", "0.5", env={**os.environ},
    )  # fmt: skip
    remote: ServeProcess | None = None
    try:
        for pod in pod_ids:
            _wait_up(f"http://{pod}/metrics")
        server.wait_ready(30.0)
        prompt = list(range(1000, 1000 + args.prompt_tokens))
        _publish(bind, pod_ids[0], prompt)
        # Both pods known to the index (pod B by a block of its own) and scraped.
        _publish(bind, pod_ids[1], list(range(50, 50 + BLOCK)))
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
        urls = {
            "direct": f"http://{pod_ids[0]}/v1/completions",
            "gateway": f"{server.url}/v1/completions",
        }
        if args.remote:
            command = [sys.executable, "-m", "kvindex.api.cli", "gateway", "--index", server.url]
            remote = ServeProcess("--log-level", "warning", command=command, env={**os.environ})
            remote.wait_ready(30.0, path="/health")
            urls["remote gateway"] = f"{remote.url}/v1/completions"
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            deadline = time.monotonic() + 20
            while True:  # until the index holds the prompt and the load is scraped
                answer = client.post(urls["gateway"], content=body)
                if answer.headers.get("x-kvindex-route-reason") == "prefix":
                    break
                if time.monotonic() > deadline:
                    raise SystemExit(f"gateway never routed by prefix: {answer.headers}")
                time.sleep(0.1)
            _measure(client, urls, body, 2, 50)  # warm-up
            times, routed = _measure(client, urls, body, args.rounds, args.per_round)
    finally:
        if remote is not None:
            remote.stop()
        server.stop()
        for process in pods:
            process.terminate()
            process.join(5)

    count = args.rounds * args.per_round
    print(
        f"non-streaming /v1/completions, {args.prompt_tokens}-token prompt as token ids, "
        f"{count} requests per arm, one client, keep-alive"
    )
    for name, values in times.items():
        print(
            f"  {name:15} p50 {_pct(values, 0.5):6.3f} ms  p99 {_pct(values, 0.99):6.3f} ms  "
            f"mean {statistics.fmean(values) * 1000:6.3f} ms  (pod {routed[name]})"
        )
    direct = _pct(times["direct"], 0.5)
    added = _pct(times["gateway"], 0.5) - direct
    verdict = "PASS" if added <= TARGET_MS else "FAIL"
    print(f"gateway adds {added:.3f} ms p50 (target <= {TARGET_MS} ms): {verdict}")
    if "remote gateway" in times:
        extra = _pct(times["remote gateway"], 0.5) - direct
        print(f"kvindex gateway --index (routing over HTTP) adds {extra:.3f} ms p50 (information)")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())

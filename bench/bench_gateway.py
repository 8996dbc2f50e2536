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

Arms, each one client sending requests one at a time over a keep-alive connection:

* ``direct``: straight to pod A.
* ``gateway``: through ``kvindex serve --gateway`` (this checkout).
* ``hop``: the same gateway code with a fixed decision (always pod A: no index, no
  ``/route``), so the gateway's own part (reading, relaying, its HTTP client and
  server) shows apart from ``/route``'s decision. ``--no-hop`` leaves it out.
* ``baseline``: ``--baseline REF`` also runs ``kvindex serve --gateway`` from git ref
  REF (e.g. ``main``), extracted to a temporary directory with its compiled extension
  built, to compare two versions in one run.
* ``remote gateway``: ``--remote`` also measures ``kvindex gateway --index URL``
  (routing over HTTP: one more loopback round trip), for information.

The arms run in rounds, in ABBA order (forward, then reversed), so drift on a busy
machine hits every arm alike. Figures: each arm's p50 and what it adds to ``direct``'s,
and each server's CPU time per request (all its threads, from
``/proc/PID/task/*/schedstat``, less its idle rate measured while the other arms ran),
which does not depend on how busy the machine is. Prints the figures and PASS or FAIL.

    python bench/bench_gateway.py [--rounds 20] [--per-round 100] [--prompt-tokens 1024]
                                  [--baseline main] [--no-hop] [--remote]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvindex.api.testing import ServeProcess, free_port

MODEL = "bench/gateway-model"
BLOCK = 16
TARGET_MS = 1.0
REPO = Path(__file__).resolve().parents[1]
_PACKAGES = ("api", "events", "indexer", "scoring")

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
    """A pod as small as an ASGI app gets: the fixed answer, and /metrics. Like vLLM's
    server (uvicorn, a Starlette JSONResponse) it writes the head and the body apart."""
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


def _serve_hop(argv: list[str]) -> int:
    """The gateway's code with a fixed decision: always ``--pod``, no index behind it.
    ``python bench/bench_gateway.py --serve-hop --pod HOST:PORT --listen HOST:PORT``."""
    import asyncio  # noqa: F401  (uvicorn's loop)

    from prometheus_client import CollectorRegistry

    from kvindex.api.gateway.app import Gateway
    from kvindex.api.gateway.asgi import GatewayApp
    from kvindex.api.gateway.routes import RouteSource
    from kvindex.api.http.schemas import RouteRequest, RouteResponse
    from kvindex.api.http.server import bind, serve
    from kvindex.api.serve.settings import Settings
    from kvindex.scoring.prompt.tokenize import TokenizerRegistry

    parser = argparse.ArgumentParser()
    parser.add_argument("--serve-hop", action="store_true")
    parser.add_argument("--pod", required=True)
    parser.add_argument("--listen", required=True)
    args = parser.parse_args(argv)

    class FixedRoutes:
        async def route(self, request: RouteRequest) -> RouteResponse:
            tokens = len(request.token_ids or ())
            return RouteResponse(
                route_id=request.request_id or "hop",
                pod=args.pod,
                reason="fixed",
                model=request.model,
                block_size=BLOCK,
                prompt_tokens=tokens,
                prompt_blocks=tokens // BLOCK,
                candidates=[],
            )

        def first_token(self, route_id: str) -> None:  # RouteSource since 2026-12-02
            return None

        def done(self, route_id: str) -> None:
            return None

        async def done_async(self, route_id: str) -> None:  # a --baseline before 2026-12-02
            return None

        async def pods(self) -> list[str]:
            return [args.pod]

        async def healthy(self) -> bool:
            return True

        async def aclose(self) -> None:
            return None

    if inspect.iscoroutinefunction(RouteSource.done):
        FixedRoutes.done = FixedRoutes.done_async  # type: ignore[method-assign]
    settings = Settings()
    registry = CollectorRegistry(auto_describe=True)
    gateway = Gateway(FixedRoutes(), TokenizerRegistry({}), settings.gateway, registry)
    host, _, port = args.listen.rpartition(":")
    serve(
        GatewayApp(gateway, settings),
        bind(host, int(port)),
        header_timeout_s=settings.http.header_timeout,
        keep_alive_timeout_s=settings.http.keep_alive_timeout,
        drain_timeout_s=settings.http.drain_timeout,
    )
    return 0


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
    from kvindex.events.wire.publisher import EnginePublisher
    from kvindex.events.wire.vllm import BlockStored
    from kvindex.indexer.keys import BlockHasher, HashConfig

    keys = BlockHasher(HashConfig(block_size=BLOCK)).keys(prompt)
    with EnginePublisher(endpoint, topic=f"kv@{pod}@{MODEL}", bind=False) as pub:
        if not pub.wait_for_subscribers(1, 10.0):
            raise SystemExit("publisher could not reach kvindex")
        pub.publish([BlockStored(keys, None, prompt[: len(keys) * BLOCK], BLOCK)])
        time.sleep(0.5)  # let it drain before the socket closes


@contextmanager
def _checkout(ref: str) -> Iterator[Path]:
    """Git ref ``ref`` of this repository as an importable ``kvindex`` (a directory for
    PYTHONPATH), its compiled extension built in place."""
    with tempfile.TemporaryDirectory(prefix="kvindex-baseline-") as tmp:
        src, pkg = Path(tmp, "src"), Path(tmp, "pkg", "kvindex")
        src.mkdir()
        pkg.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=src,
            check=True,
            capture_output=True,
        )
        for name in _PACKAGES:
            (pkg / name).symlink_to(src / name)
        yield pkg.parent


def _cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` so far, in ns (schedstat: time on a CPU)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that ended
            total += int((task / "schedstat").read_text().split()[0])
    return total


def _metric_sum_count(client: httpx.Client, url: str, name: str) -> tuple[float, float]:
    found = {"sum": 0.0, "count": 0.0}
    for line in client.get(f"{url}/metrics").text.splitlines():
        for kind in found:
            if line.startswith(f"{name}_{kind} "):
                found[kind] = float(line.rsplit(" ", 1)[1])
    return found["sum"], found["count"]


@dataclass
class Arm:
    name: str
    url: str
    pid: int | None  # the server whose CPU this arm costs; None: straight to the pod
    also: int | None = None  # a server the arm's requests also use (the remote's index)
    times: list[float] = field(default_factory=list)
    pod: str = "-"
    busy_s: float = 0.0  # wall time of this arm's rounds
    # per server pid: its CPU ns during this arm's rounds
    cpu_ns: dict[int, int] = field(default_factory=dict)


def _measure(
    client: httpx.Client, arms: list[Arm], body: bytes, rounds: int, per_round: int
) -> None:
    headers = {"content-type": "application/json"}
    pids = [a.pid for a in arms if a.pid is not None]  # every server (an also is one too)
    for r in range(rounds):
        for arm in arms if r % 2 == 0 else arms[::-1]:  # ABBA
            before = {pid: _cpu_ns(pid) for pid in pids}
            began = time.perf_counter()
            for _ in range(per_round):
                start = time.perf_counter()
                answer = client.post(arm.url, content=body, headers=headers)
                elapsed = time.perf_counter() - start
                if answer.status_code != 200:
                    raise SystemExit(f"{arm.name}: HTTP {answer.status_code}: {answer.text[:300]}")
                arm.times.append(elapsed)
            arm.busy_s += time.perf_counter() - began
            arm.pod = answer.headers.get("x-kvindex-pod", "-")
            for pid in pids:
                arm.cpu_ns[pid] = arm.cpu_ns.get(pid, 0) + _cpu_ns(pid) - before[pid]


def _cpu_per_request_us(arm: Arm, arms: list[Arm], pid: int | None = None) -> float | None:
    """Server ``pid``'s CPU (the arm's own by default) per request of ``arm``, less what
    it spends idle (scrapes, events), measured while arms that do not use it ran."""
    pid = arm.pid if pid is None else pid
    if pid is None:
        return None
    idle = [a for a in arms if pid not in (a.pid, a.also)]
    idle_s = sum(a.busy_s for a in idle)
    idle_rate = sum(a.cpu_ns.get(pid, 0) for a in idle) / idle_s if idle_s else 0.0
    spent = arm.cpu_ns.get(pid, 0) - idle_rate * arm.busy_s
    return spent / len(arm.times) / 1000


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> int:
    if sys.argv[1:2] == ["--serve-hop"]:
        return _serve_hop(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--baseline", metavar="REF", help="also this git ref's gateway")
    parser.add_argument("--no-hop", action="store_true", help="leave the fixed-decision arm out")
    parser.add_argument("--remote", action="store_true", help="also kvindex gateway --index")
    args = parser.parse_args()

    load_before = os.getloadavg()
    ports = [free_port(), free_port()]
    pod_ids = [f"127.0.0.1:{p}" for p in ports]
    pods = [multiprocessing.Process(target=_pod, args=(p,), daemon=True) for p in ports]
    for process in pods:
        process.start()
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    with ExitStack() as stack:
        stack.callback(lambda: [(p.terminate(), p.join(5)) for p in pods])

        def kvindex_serve(env: dict[str, str]) -> tuple[ServeProcess, str]:
            bind = f"tcp://127.0.0.1:{free_port()}"
            server = ServeProcess(
                "--gateway", "--zmq-bind", bind, "--model", MODEL, "--log-level", "warning",
                "--load-interval", "0.5", env=env,
            )  # fmt: skip
            stack.callback(server.stop)
            return server, bind

        server, bind = kvindex_serve({**os.environ})
        arms = [Arm("direct", f"http://{pod_ids[0]}/v1/completions", None)]
        arms.append(Arm("gateway", f"{server.url}/v1/completions", server.process.pid))
        started = [(server, bind)]
        if args.baseline:
            where = stack.enter_context(_checkout(args.baseline))
            env = {**os.environ, "PYTHONPATH": str(where)}
            base, base_bind = kvindex_serve(env)
            arms.append(Arm(f"baseline {args.baseline}", f"{base.url}/v1/completions",
                            base.process.pid))  # fmt: skip
            started.append((base, base_bind))
        for pod in pod_ids:
            _wait_up(f"http://{pod}/metrics")
        if not args.no_hop:
            hops = [("hop", {**os.environ})]
            if args.baseline:
                hops.append((f"baseline {args.baseline} hop", env))
            for name, hop_env in hops:
                command = [sys.executable, str(Path(__file__).resolve()), "--serve-hop",
                           "--pod", pod_ids[0]]  # fmt: skip
                hop = ServeProcess(command=command, env=hop_env)
                stack.callback(hop.stop)
                hop.wait_ready(30.0, path="/health")
                arms.append(Arm(name, f"{hop.url}/v1/completions", hop.process.pid))
        for one, endpoint in started:
            one.wait_ready(30.0)
            _publish(endpoint, pod_ids[0], prompt)
            # Both pods known to the index (pod B by a block of its own) and scraped.
            _publish(endpoint, pod_ids[1], list(range(50, 50 + BLOCK)))
        if args.remote:
            command = [
                sys.executable,
                "-m",
                "kvindex.api.serve.cli",
                "gateway",
                "--index",
                server.url,
            ]
            remote = ServeProcess("--log-level", "warning", command=command, env={**os.environ})
            stack.callback(remote.stop)
            remote.wait_ready(30.0, path="/health")
            arms.append(Arm("remote gateway", f"{remote.url}/v1/completions",
                            remote.process.pid, also=server.process.pid))  # fmt: skip
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            for arm in arms:
                if arm.name == "direct" or arm.name.endswith("hop"):
                    continue
                deadline = time.monotonic() + 20
                while True:  # until the index holds the prompt and the load is scraped
                    answer = client.post(arm.url, content=body)
                    if answer.headers.get("x-kvindex-route-reason") == "prefix":
                        break
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{arm.name} never routed by prefix: {answer.headers}")
                    time.sleep(0.1)
            _measure(client, arms, body, 2, 50)  # warm-up
            for arm in arms:
                arm.times.clear()
                arm.busy_s, arm.cpu_ns = 0.0, {}
            route_before = _metric_sum_count(client, server.url, "kvindex_gateway_route_seconds")
            _measure(client, arms, body, args.rounds, args.per_round)
            route_after = _metric_sum_count(client, server.url, "kvindex_gateway_route_seconds")
    load_after = os.getloadavg()

    count = args.rounds * args.per_round
    print(
        f"non-streaming /v1/completions, {args.prompt_tokens}-token prompt as token ids, "
        f"{count} requests per arm in ABBA rounds of {args.per_round}, one client, keep-alive; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    direct = _pct(arms[0].times, 0.5)
    for arm in arms:
        p50 = _pct(arm.times, 0.5)
        added = "" if arm.pid is None else f"  adds {p50 - direct:+6.3f} ms"
        cpu = _cpu_per_request_us(arm, arms)
        cost = "" if cpu is None else f"  server CPU {cpu:6.1f} µs/request"
        if arm.also is not None:
            cost += f" (+ {_cpu_per_request_us(arm, arms, arm.also):.1f} in the index)"
        print(
            f"  {arm.name:15} p50 {p50:6.3f} ms  p99 {_pct(arm.times, 0.99):6.3f} ms  "
            f"mean {statistics.fmean(arm.times) * 1000:6.3f} ms{added}{cost}  (pod {arm.pod})"
        )
    by_name = {arm.name: arm for arm in arms}
    routed = route_after[1] - route_before[1]
    if routed > 0:
        mean_us = (route_after[0] - route_before[0]) / routed * 1e6
        print(f"  gateway: /route's decision in-process, mean {mean_us:.1f} µs (wall, "
              "kvindex_gateway_route_seconds)")  # fmt: skip
    if "hop" in by_name:
        hop_added = _pct(by_name["hop"].times, 0.5) - direct
        print(f"  the gateway's own part (hop, fixed decision) adds {hop_added:.3f} ms p50")
    pairs = {"gateway": f"baseline {args.baseline}", "hop": f"baseline {args.baseline} hop"}
    for ours, theirs in pairs.items():
        base = by_name.get(theirs)
        if base is None or ours not in by_name:
            continue
        gw, gw_cpu = by_name[ours], _cpu_per_request_us(by_name[ours], arms) or 0.0
        base_cpu = _cpu_per_request_us(base, arms) or 0.0
        print(
            f"  {ours} against {args.baseline}: p50 {_pct(gw.times, 0.5):.3f} vs "
            f"{_pct(base.times, 0.5):.3f} ms, CPU {gw_cpu:.1f} vs {base_cpu:.1f} µs/request "
            f"({(gw_cpu - base_cpu) / base_cpu * 100 if base_cpu else 0.0:+.1f}%)"
        )
    added = _pct(by_name["gateway"].times, 0.5) - direct
    verdict = "PASS" if added <= TARGET_MS else "FAIL"
    print(f"gateway adds {added:.3f} ms p50 (target <= {TARGET_MS} ms): {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())

"""Soak: ``kvindex serve`` under engine churn and /score and /route load, then an
exactness check.

Simulated pods (real EnginePublishers, each on its own loopback address with a replay
endpoint) publish to kvindex's bound socket: prefix stores, removals and evictions past
a per-pod capacity, AllBlocksCleared, engine restarts (seq back to 0) and partitions
(a run of batches buffered for replay but never sent, so kvindex sees a gap and replays
it). Client threads call /score, and /route then /route/{id}/done, meanwhile; each pod
serves a vLLM-style /metrics page (its KV usage from the blocks it holds) on its own
address, so /route's load scraping runs too. Every ``--report-every`` seconds one line:
the server's RSS, /score and /route p50/p99 over the interval, operations, and kvindex's
own gap/replay/missed/restart counters. At the end every pod's index entries are compared
with what the pod holds (the ground truth kept here): the index must be exact.

Bounded (``--seconds``) and loopback only. Figures: bench/README.md, "Soak".

    python bench/soak.py --seconds 600
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import http.server
import json
import os
import random
import re
import sys
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import httpx

from kvindex.api.testing import ServeProcess, free_port
from kvindex.events.wire.endpoints import from_source
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig

MODEL = "soak/model"
BLOCK = 16
HASHER = BlockHasher(HashConfig())


@dataclass
class Prompt:
    tokens: list[int]
    keys: list[int]


def make_prompts(rng: random.Random, count: int, blocks: int, shared: int) -> list[Prompt]:
    """``count`` prompts of ``blocks`` blocks; groups of them share a ``shared``-block
    prefix (a system prompt), as chat traffic does."""
    systems = [[rng.randrange(1, 150_000) for _ in range(shared * BLOCK)] for _ in range(8)]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(1, 150_000) for _ in range((blocks - shared) * BLOCK)]
        tokens = systems[i % len(systems)] + tail
        prompts.append(Prompt(tokens, HASHER.keys(tokens)))
    return prompts


@dataclass
class SoakPod:
    """One engine: its publisher and the blocks it holds (the ground truth)."""

    pod: str
    publisher: EnginePublisher
    capacity: int
    held: OrderedDict[int, None] = field(default_factory=OrderedDict)
    partition_left: int = 0  # batches still to drop

    def publish(self, events: list, ops: Counter) -> None:
        send = self.partition_left == 0
        if not send:
            self.partition_left -= 1
            ops["dropped_batches"] += 1
        self.publisher.publish(events, send=send)

    def store(self, prompt: Prompt, upto: int, ops: Counter) -> None:
        """Store the first run of blocks of the prompt's prefix that the pod lacks (vLLM
        never stores a block it holds), evicting the least recently used past capacity."""
        keys = prompt.keys[:upto]
        start = next((i for i, k in enumerate(keys) if k not in self.held), None)
        if start is None:
            for k in keys:
                self.held.move_to_end(k)
            return
        end = next((i for i in range(start, len(keys)) if keys[i] in self.held), len(keys))
        new = keys[start:end]
        events: list = []
        overflow = len(self.held) + len(new) - self.capacity
        if overflow > 0:
            evicted = [self.held.popitem(last=False)[0] for _ in range(overflow)]
            events.append(BlockRemoved(evicted))
            ops["blocks_evicted"] += len(evicted)
        parent = keys[start - 1] if start else None
        events.append(BlockStored(new, parent, prompt.tokens[start * BLOCK : end * BLOCK], BLOCK))
        for k in new:
            self.held[k] = None
        self.publish(events, ops)
        ops["blocks_stored"] += len(new)

    def remove(self, rng: random.Random, ops: Counter) -> None:
        if not self.held:
            return
        victims = rng.sample(list(self.held), min(len(self.held), rng.randint(1, 8)))
        for k in victims:
            del self.held[k]
        self.publish([BlockRemoved(victims)], ops)
        ops["blocks_removed"] += len(victims)

    def clear(self, ops: Counter) -> None:
        self.held.clear()
        self.publish([AllBlocksCleared()], ops)
        ops["clears"] += 1

    def restart(self, ops: Counter) -> None:
        self.partition_left = 0
        self.publisher.restart()
        self.held.clear()
        ops["restarts"] += 1


class Latencies:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: list[float] = []
        self.errors = 0
        self.statuses: Counter = Counter()  # failed calls by HTTP status (0: no answer)

    def add(self, seconds: float) -> None:
        with self._lock:
            self._samples.append(seconds)

    def take(self) -> list[float]:
        with self._lock:
            samples, self._samples = self._samples, []
        return samples


def client_loop(
    port: int,
    prompts: list[Prompt],
    stop: threading.Event,
    lat: Latencies,
    seed: int,
    path: str = "/score",
) -> None:
    """Call ``path`` with random prompts until ``stop``; a /route is released with
    /route/{id}/done at once (its latency is not counted), as a gateway does when the
    response ends."""
    rng = random.Random(seed)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"content-type": "application/json"}
    while not stop.is_set():
        prompt = rng.choice(prompts)
        body = json.dumps({"model": MODEL, "token_ids": prompt.tokens})
        started = time.perf_counter()
        try:
            conn.request("POST", path, body, headers)
            response = conn.getresponse()
            answer = response.read()
            elapsed = time.perf_counter() - started
            if response.status != 200:
                lat.errors += 1
                lat.statuses[response.status] += 1
            elif path == "/route":
                route_id = json.loads(answer)["route_id"]
                conn.request("POST", f"/route/{route_id}/done", b"", headers)
                done = conn.getresponse()
                done.read()
                if done.status != 200:
                    lat.errors += 1
                    lat.statuses[done.status] += 1
        except (OSError, http.client.HTTPException, ValueError, KeyError):
            lat.errors += 1
            lat.statuses[0] += 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            continue
        lat.add(elapsed)
    conn.close()


def wait_until_routable(url: str, pods: int, timeout_s: float = 30.0) -> None:
    """Until a /route (released at once) has ``pods`` candidates."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=5.0) as client:
        while time.monotonic() < deadline:
            answer = client.post("/route", json={"model": MODEL, "token_ids": [1] * 16})
            if answer.status_code == 200:
                client.post(f"/route/{answer.json()['route_id']}/done")
                if len(answer.json()["candidates"]) == pods:
                    return
            time.sleep(0.05)
    raise RuntimeError(f"/route did not know the {pods} pods within {timeout_s:g} s")


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    """A pod's vLLM /metrics page: the three gauges /route scrapes."""

    pod: SoakPod | None = None  # set once the pod exists

    def do_GET(self) -> None:
        if self.pod is None:
            self.send_error(503)
            return
        # vLLM counts cached blocks no request uses as free, so a full prefix cache is
        # not a full KV cache: the usage shown is half the cache's fill, below the
        # admission limit (--max-kv-usage 0.95), and still varies for the cost model.
        usage = 0.5 * len(self.pod.held) / self.pod.capacity
        labels = f'{{model_name="{MODEL}",engine="0"}}'
        page = (
            f"vllm:num_requests_running{labels} 0.0\n"
            f"vllm:num_requests_waiting{labels} 0.0\n"
            f"vllm:kv_cache_usage_perc{labels} {usage}\n"
        ).encode()
        # kvindex may give up on a scrape (--load-timeout) on a loaded machine: the
        # closed connection is a slow pod, as meant, not an error of the soak.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

    def log_message(self, *args: object) -> None:
        pass


def serve_metrics(host: str) -> http.server.ThreadingHTTPServer:
    """A pod's /metrics on its own address and a free port, in a thread: the pod id is
    ``host:port`` (kvindex scrapes ``http://<pod id>/metrics``). Free ports, not 8000, so
    that two soaks (or a soak and the test suite) never collide."""
    handler = type("Handler", (_MetricsHandler,), {})
    server = http.server.ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


_COUNTERS = {
    "gaps": r"^kvindex_seq_gaps_total (\S+)",
    "replays_ok": r'^kvindex_replays_total\{result="ok"\} (\S+)',
    "replays_failed": r'^kvindex_replays_total\{result="failed"\} (\S+)',
    "missed": r"^kvindex_missed_batches_total (\S+)",
    "restarts_seen": r"^kvindex_pod_restarts_total (\S+)",
    "event_errors": r"^kvindex_event_errors_total\{[^}]*\} (\S+)",
    "pods_with_known_load": r"^kvindex_load_known\{[^}]*\} (\S+)",
}


def counters(url: str) -> dict[str, int]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for name, pattern in _COUNTERS.items():
        out[name] = int(sum(float(v) for v in re.findall(pattern, text, re.M)))
    return out


def percentile(samples: list[float], q: float) -> float:
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def drive(pods: list[SoakPod], prompts: list[Prompt], args, stop, ops: Counter) -> None:
    """The engines: one thread, round robin (publishers are single-threaded), paced."""
    rng = random.Random(args.seed)
    interval = 1.0 / args.rate
    next_at = time.monotonic()
    while not stop.is_set():
        pod = pods[rng.randrange(len(pods))]
        roll = rng.random()
        if roll < args.restart_p and pod.partition_left == 0:
            pod.restart(ops)
        elif roll < args.restart_p + args.partition_p and pod.partition_left == 0:
            pod.partition_left = rng.randint(1, args.max_partition)
            ops["partitions"] += 1
        elif roll < args.restart_p + args.partition_p + args.clear_p:
            pod.clear(ops)
        elif roll < 0.2:
            pod.remove(rng, ops)
        else:
            prompt = rng.choice(prompts)
            pod.store(prompt, rng.randint(1, len(prompt.keys)), ops)
        ops["batches"] += 1
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        elif delay < -1.0:
            next_at = time.monotonic()  # behind: don't burst to catch up


def settle(url: str, pods: list[SoakPod], ops: Counter, timeout_s: float) -> bool:
    """End partitions with one sent batch each, then wait until kvindex has applied
    every pod's last batch."""
    for pod in pods:
        pod.partition_left = 0
        pod.remove(random.Random(0), ops) if pod.held else pod.clear(ops)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = 0
        for pod in pods:
            report = httpx.get(f"{url}/index/pods/{pod.pod}", timeout=10).json()
            if report.get("last_seq", {}).get(pod.pod) == pod.publisher.next_seq - 1:
                done += 1
        if done == len(pods):
            return True
        time.sleep(0.2)
    return False


def exactness(url: str, pods: list[SoakPod]) -> tuple[int, list[str]]:
    problems = []
    for pod in pods:
        answer = httpx.get(
            f"{url}/index/pods/{pod.pod}/blocks",
            params={"model": MODEL, "limit": 1_000_000},
            timeout=30,
        )
        indexed = (
            set(answer.json().get("blocks", {}).get(pod.pod, [])) if answer.is_success else set()
        )
        truth = set(pod.held)
        if indexed != truth:
            problems.append(
                f"{pod.pod}: {len(truth - indexed)} held but not indexed, "
                f"{len(indexed - truth)} indexed but not held"
            )
    return len(pods) - len(problems), problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--report-every", type=float, default=30.0)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--clients", type=int, default=2, help="/score clients")
    parser.add_argument("--route-clients", type=int, default=1, help="/route clients")
    parser.add_argument("--rate", type=float, default=1000.0, help="engine batches per second")
    parser.add_argument("--capacity", type=int, default=4096, help="blocks per pod")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-blocks", type=int, default=64)
    parser.add_argument("--restart-p", type=float, default=0.0005)
    parser.add_argument("--partition-p", type=float, default=0.001)
    parser.add_argument("--max-partition", type=int, default=50)
    parser.add_argument("--clear-p", type=float, default=0.0005)
    parser.add_argument("--seed", type=int, default=14)
    args = parser.parse_args()

    prompts = make_prompts(random.Random(args.seed), args.prompts, args.prompt_blocks, 16)
    bind, replay = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}
    server = ServeProcess(
        "--zmq-bind", f"tcp://127.0.0.1:{bind}",
        "--replay-port", str(replay),
        "--model", MODEL,
        "--log-level", "warning",
        env=env,
    )  # fmt: skip
    pods: list[SoakPod] = []
    stop = threading.Event()
    threads: list[threading.Thread] = []
    ops: Counter = Counter()
    lat, route_lat = Latencies(), Latencies()
    metrics_servers: list[http.server.ThreadingHTTPServer] = []
    try:
        server.wait_ready(60.0)
        for i in range(args.pods):
            host = f"127.0.0.{10 + i}"
            metrics_servers.append(serve_metrics(host))
            pod_id = f"{host}:{metrics_servers[-1].server_address[1]}"
            # Sent from the pod's own address: bind mode checks the sender's host.
            publisher = EnginePublisher(
                from_source(f"tcp://127.0.0.1:{bind}", host),
                topic=f"kv@{pod_id}@{MODEL}",
                replay_endpoint=f"tcp://{host}:{replay}",
            )
            if not publisher.wait_for_subscribers(1, 10.0):
                raise RuntimeError(f"kvindex never subscribed to pod {host}")
            pods.append(SoakPod(pod_id, publisher, args.capacity))
            metrics_servers[-1].RequestHandlerClass.pod = pods[-1]  # type: ignore[attr-defined]
        driver = threading.Thread(target=drive, args=(pods, prompts, args, stop, ops))
        driver.start()
        threads.append(driver)
        # The clients start once /route knows every pod (it learns them from their first
        # events and re-reads the pod list at most every 0.5 s); before that a /route is
        # a 503 no_pods, which is a slow start, not an error of the soak.
        wait_until_routable(server.url, len(pods))
        clients: list[threading.Thread] = []
        for c in range(args.clients):
            clients.append(
                threading.Thread(
                    target=client_loop, args=(server.port, prompts, stop, lat, args.seed + c)
                )
            )
        for c in range(args.route_clients):
            clients.append(
                threading.Thread(
                    target=client_loop,
                    args=(server.port, prompts, stop, route_lat, args.seed + 100 + c, "/route"),
                )
            )
        for thread in clients:
            thread.start()
        threads += clients
        print(
            f"soak: {args.pods} pods, {args.clients} /score clients, "
            f"{args.route_clients} /route clients, {args.rate:g} batches/s, "
            f"{args.seconds:g} s; kvindex pid {server.process.pid}",
            flush=True,
        )
        print(
            f"{'t_s':>5} {'rss_mb':>7} {'score_p50_ms':>12} {'score_p99_ms':>12} {'scores':>7} "
            f"{'route_p50_ms':>12} {'route_p99_ms':>12} {'routes':>6} "
            f"{'batches':>8} {'blocks_st':>9} {'restarts':>8} {'partitions':>10} {'gaps':>5} "
            f"{'replays':>7} {'failed':>6} {'missed':>6}",
            flush=True,
        )
        started = time.monotonic()
        end = started + args.seconds
        while time.monotonic() < end:
            time.sleep(min(args.report_every, max(0.0, end - time.monotonic())))
            samples, routes = lat.take(), route_lat.take()
            seen = counters(server.url)
            print(
                f"{time.monotonic() - started:5.0f} {rss_mb(server.process.pid):7.1f} "
                f"{1000 * percentile(samples, 0.5):12.2f} {1000 * percentile(samples, 0.99):12.2f} "
                f"{len(samples):7d} {1000 * percentile(routes, 0.5):12.2f} "
                f"{1000 * percentile(routes, 0.99):12.2f} {len(routes):6d} "
                f"{ops['batches']:8d} {ops['blocks_stored']:9d} "
                f"{ops['restarts']:8d} {ops['partitions']:10d} {seen['gaps']:5d} "
                f"{seen['replays_ok']:7d} {seen['replays_failed']:6d} {seen['missed']:6d}",
                flush=True,
            )
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        settled = settle(server.url, pods, ops, 60.0)
        exact, problems = exactness(server.url, pods)
        seen = counters(server.url)
        print(f"operations: {dict(sorted(ops.items()))}")
        print(
            f"kvindex counters: {seen}; /score errors: {lat.errors} {dict(lat.statuses)}; "
            f"/route errors: {route_lat.errors} {dict(route_lat.statuses)}"
        )
        print(
            f"exactness: {exact}/{len(pods)} pods exact"
            + ("" if settled else " (not every pod's last batch was applied in 60 s)")
        )
        for problem in problems:
            print(f"  {problem}")
        failed = lat.errors or route_lat.errors
        return 0 if exact == len(pods) and settled and not failed else 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        for pod in pods:
            pod.publisher.close()
        for metrics_server in metrics_servers:
            metrics_server.shutdown()
            metrics_server.server_close()
        server.stop()
        print(f"server log: {server.log_path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

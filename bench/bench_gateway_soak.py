"""The gateway through faults (issue 27): many concurrent multi-turn conversations with
the real ``openai`` client through ``kvindex serve --gateway``, in front of pods on
loopback that publish real vLLM KV events for what they compute
(:mod:`tests.faulty_pod`), while one pod after another is killed, blackholed, frozen and
made to answer 500, and then kvindex itself restarts.

(``bench/soak.py`` soaks the index under engine churn through ``/score`` and
``/route``; this one soaks the gateway's path, with the faults a gateway meets.)

Phases, each ``--duration / 6`` seconds: ``healthy``; ``killed`` (a pod's port closed);
``blackholed`` (a pod's port drops connection attempts); ``frozen`` (a pod reads
requests and never answers); ``http_500`` (a pod answers every request 500); each with
another pod as the victim, healed at the phase's end; then ``restart`` (kvindex stopped
with SIGTERM and started again on the same port; the pods' ZMQ publishers reconnect).

Every request is a streamed ``/v1/completions`` of token ids (a conversation's history
plus a new turn), so the prefix kvindex routes by is the conversation's. A 5xx or a
connection error is retried once by the client (``max_retries=0``: the bench retries,
so it can see where the retry went). Per phase it prints:

- ``requests``: requests sent (retries included);
- ``bad_share``: of the phase's requests sent after the victim was seen failing (its
  first failure since the fault), the share that reached it (it answered, or the gateway tried
  it first: ``x-kvindex-failed-pods``);
- ``retry_same``: client retries after a 5xx that went to the pod that failed;
- ``gw_5xx``: 5xx answers the gateway made itself (no pod's answer), and ``conn_err``:
  requests the gateway did not answer (during kvindex's restart);
- ``added_p50_ms`` / ``added_p90_ms``: what the gateway adds to a request, its retries
  included, from its own histogram (``kvindex_gateway_added_seconds``, read before and
  after the phase; interpolated within buckets as Prometheus' ``histogram_quantile``);
- ``client_p50_ms``: the client's time for a request less the pod's own
  (``openai-processing-ms``): the gateway's part plus the client's own (the ``openai``
  client, the pods and this script share one Python process, so this is mostly theirs);
- ``follow_on_pod``: the share of follow-up turns served by the pod that served the
  conversation's previous turn.

    python bench/bench_gateway_soak.py [--duration 120] [--conversations 32] [--pods 4]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai

from kvindex.api.testing import ServeProcess, eventually, free_port
from tests.faulty_pod import FaultyPod

MODEL = "acme/soak"
PHASES = ["healthy", "killed", "blackholed", "frozen", "http_500", "restart"]
TURN_TOKENS = 48  # a user's new message
ANSWER_TOKENS = 24  # the assistant's answer, part of the next turn's history
PREAMBLE_TOKENS = 400  # each conversation's own opening (a system prompt, a document)
MAX_TURNS = 6


@dataclass(slots=True)
class Record:
    phase: str
    started: float
    status: int  # 0: no answer from the gateway
    pod: str | None
    failed: list[str]
    seconds: float
    pod_seconds: float | None
    follow_up: bool
    previous_pod: str | None
    retry_after_5xx_of: str | None  # the pod whose 5xx this request retries


@dataclass
class Soak:
    records: list[Record] = field(default_factory=list)
    phase: str = "healthy"
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)  # start, end
    # the gateway's added-time histogram at the phase's start and end
    added: dict[str, tuple[list[tuple[float, float]], list[tuple[float, float]]]] = field(
        default_factory=dict
    )
    stop: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, record: Record) -> None:
        with self.lock:
            self.records.append(record)


def send(client: openai.OpenAI, soak: Soak, tokens: list[int], **context: object) -> Record:
    phase, started = soak.phase, time.monotonic()
    status, headers = 0, httpx.Headers()
    try:
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=tokens, max_tokens=1, stream=True
        )
        status, headers = raw.status_code, raw.headers
        for _ in raw.parse():
            pass
    except openai.APIStatusError as exc:
        status, headers = exc.status_code, exc.response.headers
    except openai.APIConnectionError:
        pass
    pod_ms = headers.get("openai-processing-ms")
    record = Record(
        phase,
        started,
        status,
        headers.get("x-kvindex-pod"),
        [p for p in headers.get("x-kvindex-failed-pods", "").split(",") if p],
        time.monotonic() - started,
        None if pod_ms is None else float(pod_ms) / 1000,
        **context,  # type: ignore[arg-type]
    )
    soak.add(record)
    return record


def converse(url: str, soak: Soak, seed: int) -> None:
    """Conversations one after another until the soak stops."""
    rng = random.Random(seed)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    while not soak.stop:
        history = [rng.randrange(1, 50_000) for _ in range(PREAMBLE_TOKENS)]
        previous: str | None = None
        for turn in range(rng.randint(2, MAX_TURNS)):
            if soak.stop:
                return
            tokens = history + [rng.randrange(1, 50_000) for _ in range(TURN_TOKENS)]
            context = {"follow_up": turn > 0, "previous_pod": previous}
            record = send(client, soak, tokens, retry_after_5xx_of=None, **context)
            if record.status == 0 or record.status >= 500:  # the client's one retry
                time.sleep(0.05)
                failed_pod = record.pod if record.status >= 500 else None
                record = send(client, soak, tokens, retry_after_5xx_of=failed_pod, **context)
            if record.status == 200:
                previous = record.pod
                history = tokens + [rng.randrange(1, 50_000) for _ in range(ANSWER_TOKENS)]
            time.sleep(rng.uniform(0.0, 0.05))  # the user reads, then types


def start_kvindex(
    port: int, endpoint: str, args: argparse.Namespace, pods: list[FaultyPod]
) -> ServeProcess:
    """kvindex with the pods configured (as discovery would name them): after a restart
    it routes to them before they publish again, which they do only once routed to."""
    roles = [flag for pod in pods for flag in ("--pod-role", f"{pod.pod}=both")]
    server = ServeProcess(
        "--gateway", "--zmq-bind", endpoint, "--load-interval", "0.5", *roles,
        "--gateway-first-byte-timeout", str(args.first_byte_timeout),
        "--eject-base", str(args.eject_base),
        port=port,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")},
    )  # fmt: skip
    server.wait_ready(30.0)
    return server


def added_buckets(http: httpx.Client) -> list[tuple[float, float]]:
    """The gateway's ``kvindex_gateway_added_seconds`` buckets: (upper bound, count)."""
    buckets = []
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("kvindex_gateway_added_seconds_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    return buckets


def bucket_quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float):  # type: ignore[no-untyped-def]
    """The ``q`` quantile (0..1) of the observations between two readings, linear within
    its bucket (``histogram_quantile``); NaN without observations."""
    counts = [(bound, a - b) for (bound, a), (_, b) in zip(after, before, strict=True)]
    total = counts[-1][1] if counts else 0
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in counts:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return lower


def reaches(record: Record, pod: str) -> bool:
    return record.pod == pod or pod in record.failed


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def report(soak: Soak, victims: dict[str, str]) -> list[str]:
    lines = [
        f"{'phase':<11} {'requests':>8} {'bad_share':>9} {'retry_same':>10} {'gw_5xx':>6} "
        f"{'conn_err':>8} {'added_p50_ms':>12} {'added_p90_ms':>12} {'client_p50_ms':>13} "
        f"{'follow_on_pod':>13}"
    ]
    for phase in PHASES:
        rows = [r for r in soak.records if r.phase == phase]
        victim = victims.get(phase)
        share, retry_same = "-", "-"
        if victim is not None:
            # Its first failure may end a request sent just before the fault.
            start, end = soak.windows[phase]
            failures = [
                r.started + r.seconds
                for r in soak.records
                if (victim in r.failed or (r.pod == victim and r.status >= 500))
                and r.started + r.seconds >= start
            ]
            after = [r for r in rows if failures and min(failures) < r.started < end]
            reached = sum(reaches(r, victim) for r in after)
            share = f"{reached / len(after):.2%}" if after else "-"
            retries = [r for r in rows if r.retry_after_5xx_of is not None]
            if retries:
                same = sum(r.pod == r.retry_after_5xx_of for r in retries)
                retry_same = f"{same}/{len(retries)}"
        gateway_5xx = sum(r.status >= 500 and r.pod is None for r in rows)
        unanswered = sum(r.status == 0 for r in rows)
        client = [
            (r.seconds - r.pod_seconds) * 1000
            for r in rows
            if r.status == 200 and r.pod_seconds is not None
        ]
        before, after = soak.added.get(phase, ([], []))
        p50, p90 = (bucket_quantile(before, after, q) * 1000 for q in (0.5, 0.9))
        follow = [r for r in rows if r.follow_up and r.status == 200 and r.previous_pod]
        on_pod = sum(r.pod == r.previous_pod for r in follow)
        on_share = f"{on_pod / len(follow):.1%}" if follow else "-"
        lines.append(
            f"{phase:<11} {len(rows):>8} {share:>9} {retry_same:>10} {gateway_5xx:>6} "
            f"{unanswered:>8} {p50:>12.2f} {p90:>12.2f} {percentile(client, 50):>13.1f} "
            f"{on_share:>13}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds, all phases")
    parser.add_argument("--conversations", type=int, default=32, help="concurrent ones")
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--first-byte-timeout", type=float, default=2.0)
    parser.add_argument("--eject-base", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.pods < 2:
        parser.error("--pods must be at least 2 (one is faulty at a time)")
    endpoint, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    pods = [FaultyPod(MODEL, endpoint) for _ in range(args.pods)]
    server = start_kvindex(port, endpoint, args, pods)
    soak = Soak()
    workers: list[threading.Thread] = []
    victims: dict[str, str] = {}
    try:
        for i, pod in enumerate(pods):
            if not pod.publisher.wait_for_subscribers(1, 10.0):
                raise RuntimeError(f"pod {pod.pod}: kvindex never subscribed")
            pod.compute([7 + i] * 32)  # known to the index, with its model
        http = httpx.Client(base_url=server.url, timeout=10.0)

        def scraped() -> bool:
            answer = http.post("/route", json={"model": MODEL, "token_ids": [1] * 32})
            if answer.status_code != 200:
                return False
            http.post(f"/route/{answer.json()['route_id']}/done")
            rows = answer.json()["candidates"]
            return len(rows) == len(pods) and all(r["load"] == "known" for r in rows)

        eventually(scraped, "every pod known and scraped", 30.0)
        workers = [
            threading.Thread(target=converse, args=(server.url, soak, seed), daemon=True)
            for seed in range(args.conversations)
        ]
        for worker in workers:
            worker.start()
        each = args.duration / len(PHASES)
        for i, phase in enumerate(PHASES):
            soak.phase, started = phase, time.monotonic()
            first = added_buckets(http)
            if phase == "restart":
                server.stop()
                server = start_kvindex(port, endpoint, args, pods)
                first = added_buckets(http)  # a new process: its histogram starts at 0
                time.sleep(max(0.0, each - (time.monotonic() - started)))
            else:
                victim = None if phase == "healthy" else pods[i % len(pods)]
                if victim is not None:
                    victims[phase] = victim.pod
                    victim.set_mode(phase)
                time.sleep(each)
                if victim is not None:
                    victim.set_mode("ok")
            soak.windows[phase] = (started, time.monotonic())
            soak.added[phase] = (first, added_buckets(http))
    finally:
        soak.stop = True
        for worker in workers:
            worker.join(70.0)
        for pod in pods:
            pod.close()
        server.stop()
    print(
        f"{args.conversations} conversations, {args.pods} pods, {args.duration:g} s; "
        f"--gateway-first-byte-timeout {args.first_byte_timeout:g} "
        f"--eject-base {args.eject_base:g} (--eject-after 1)"
    )
    for line in report(soak, victims):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``/score`` or ``/route`` over HTTP from this tree and from another git ref, side by side
in one run, in ABBA rounds: the comparison a change to the serving path is judged by.

Both servers are real ``kvindex serve`` processes (the ref's from a ``git archive`` on
``PYTHONPATH``, its extension built in place), filled alike as in ``bench_score.py``
(8,192-token prompt, 64 pods holding 8..512-block prefixes, every pod's vLLM ``/metrics``
page served and scraped) and both idle except while measured. Each round measures one,
then the other (the order flips every round): one client for ``--seconds``/2, then
``--clients`` clients for ``--seconds``, with bench_score's load generator. Besides p50
and req/s it prints what moves much less with the machine's load: the server's CPU time
per request (all threads, from ``/proc/PID/task/*/schedstat``; that includes its load
scrapes, ~60-120 ms a second) and its event loop thread's, and the generator's own.

    python bench/bench_score_ab.py --baseline main [--path /route] [--form token_ids]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
from contextlib import ExitStack
from pathlib import Path

try:  # run as a script: bench/ is sys.path[0]
    from bench_gateway import _checkout
    from bench_score import BLOCK, MODEL, PROMPT_TOKENS, _fill, _hosts, _measure, _MetricsPages
except ModuleNotFoundError:
    from bench.bench_gateway import _checkout
    from bench.bench_score import (
        BLOCK,
        MODEL,
        PROMPT_TOKENS,
        _fill,
        _hosts,
        _measure,
        _MetricsPages,
    )

from kvindex.api.testing import ServeProcess, free_port
from kvindex.indexer.keys import BlockHasher, HashConfig


def _main_thread_ns(pid: int) -> int:
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0])


def _run(server: ServeProcess, bodies: list[bytes], clients: int, seconds: float, path: str):
    pid = server.process.pid
    loop = _main_thread_ns(pid)
    figures = _measure(server.port, bodies, clients, seconds=seconds, path=path, server_pid=pid)
    figures["loop_us"] = (_main_thread_ns(pid) - loop) / 1000 / max(1, figures["requests"])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="REF", required=True, help="the git ref to compare")
    parser.add_argument("--path", choices=("/score", "/route"), default="/score")
    parser.add_argument("--form", choices=("block_hashes", "token_ids"), default="block_hashes")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(11)  # bench_score.py's prompt
    prompt = [rng.randrange(1, 150_000) for _ in range(PROMPT_TOKENS)]
    request: dict = {"model": MODEL}
    if args.form == "block_hashes":
        request["block_hashes"] = BlockHasher(HashConfig(block_size=BLOCK)).keys(prompt)
    else:
        request["token_ids"] = prompt
    if args.path == "/route":
        request["request_id"] = "bench"  # routed again and again: one stays in flight
    bodies = [json.dumps(request).encode()]
    pages = _MetricsPages(_hosts())
    with ExitStack() as stack:
        stack.callback(pages.close)
        servers: dict[str, ServeProcess] = {}
        checkout = stack.enter_context(_checkout(args.baseline))
        for name, env in (
            ("this tree", dict(os.environ)),
            (args.baseline, {**os.environ, "PYTHONPATH": str(checkout)}),
        ):
            zmq = f"tcp://127.0.0.1:{free_port()}"
            server = stack.enter_context(
                ServeProcess("--zmq-bind", zmq, "--log-level", "warning", env=env)
            )
            server.wait_ready(60)
            _fill(zmq, server.url, prompt)
            _run(server, bodies, 1, 1.0, args.path)  # warm up
            servers[name] = server
        print(
            f"{args.path} by {args.form} over HTTP, this tree against {args.baseline}, "
            f"ABBA, {args.rounds} rounds"
        )
        results: dict[str, list[tuple[dict, dict]]] = {name: [] for name in servers}
        for r in range(args.rounds):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]
            for name in order:
                one = _run(servers[name], bodies, 1, args.seconds / 2, args.path)
                many = _run(servers[name], bodies, args.clients, args.seconds, args.path)
                results[name].append((one, many))
                print(
                    f"  {name:>12} round {r}, load {os.getloadavg()[0]:5.2f}: "
                    f"1 client p50 {one['p50_ms']:.3f} ms | {args.clients} clients "
                    f"{many['rps']:5.0f} req/s, p50 {many['p50_ms']:.2f} ms; CPU per request: "
                    f"server {many['server_us']:.0f} us (loop thread {many['loop_us']:.0f}), "
                    f"generator {many['generator_us']:.0f} us",
                    flush=True,
                )
    print("medians:")
    for name, runs in results.items():
        p50 = statistics.median(one["p50_ms"] for one, _ in runs)
        rps = statistics.median(many["rps"] for _, many in runs)
        cpu = statistics.median(many["server_us"] for _, many in runs)
        print(f"  {name:>12}: 1 client p50 {p50:.3f} ms, {rps:.0f} req/s, server {cpu:.0f} us/req")


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    main()

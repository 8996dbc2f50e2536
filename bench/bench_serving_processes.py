"""Serving queries from more than one process on 2 cores: ``kvindex serve --processes 2``
beside one process, beside Dynamo, and beside the upper bound it was built against.

Issue 13 asks for SO_REUSEPORT serving workers reading one shared-memory index written
by one ingest process, adopted if they win on 2 cores with the load generator on the
same machine. Four arms, each with all 16 clients from one generator process:

* ``kvindex, 1 process``: ``kvindex serve``;
* ``kvindex --processes 2``: the primary and one serving worker over the shared index
  (``api/serve/worker_pool.py``), the kernel spreading the 16 connections over both;
* ``2 replicas (bound)``: two complete ``kvindex serve`` replicas, each its own index
  from the same events, 8 clients each: what serving workers could win at most (a
  worker does a replica's work per query, plus reading a table another process writes);
  the queries run after the fill, so neither pays for ingest here;
* ``Dynamo``: Dynamo's indexer (its threads use both cores).

Set-up as ``compare_peers.py``'s query figures: 64 loopback publishers per server, pod i
holding the first 8·(i+1) blocks of an 8,192-token prompt, a pool of 256 query prompts
sharing a prefix of random length with it, the same load generator
(``bench_score.py``'s asyncio client). The arms run in rounds of ``--seconds``, in ABBA
order, twice; the medians are printed with each round's figure.

    python -m bench.bench_serving_processes [--seconds 4] [--dynamo-python PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import threading

import httpx
import zmq

from bench.bench_score import _figures, _run
from bench.compare_peers import dynamo_python, fill, query_prompts
from bench.peers.feed import Publishers
from bench.peers.servers import DynamoPeer, KvindexPeer, Peer

PODS = 64
PROMPT_TOKENS = 8192
CLIENTS = 16


def _load(servers: list[Peer], prompts: list[list[int]], by_hash: bool, seconds: float):
    """16 clients split evenly over ``servers`` (one: all 16), each share from its own
    generator process, all at once; the figures over every request."""
    runs: list[tuple[list[float], float, float] | None] = [None] * len(servers)

    def one(i: int, peer: Peer) -> None:
        bodies = [(peer.hash_body if by_hash else peer.body)(p) for p in prompts]
        path = peer.hash_path if by_hash else peer.path
        runs[i] = _run(peer.port, bodies, CLIENTS // len(servers), seconds, None, path)

    threads = [threading.Thread(target=one, args=pair) for pair in enumerate(servers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    latencies = [x for run in runs if run is not None for x in run[0]]
    return _figures(latencies, max(run[1] for run in runs if run is not None))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one round")
    parser.add_argument("--dynamo-python", help="a Python with ai-dynamo-runtime installed")
    args = parser.parse_args()
    python = dynamo_python(args.dynamo_python)
    rng = random.Random(1)
    prompt = [rng.randrange(150_000) for _ in range(PROMPT_TOKENS)]
    prompts = query_prompts(prompt, 256, seed=2)
    ctx = zmq.Context()
    names = ("one", "workers", "replica-a", "replica-b", "Dynamo")
    pubs = {name: Publishers(ctx, PODS) for name in names}
    peers: dict[str, Peer] = {}
    try:
        for name in names[:4]:
            flags = ["--processes", "2"] if name == "workers" else []
            peers[name] = KvindexPeer(pubs[name].endpoints, flags)
        peers["Dynamo"] = DynamoPeer(python, pubs["Dynamo"].endpoints, None)
        for name in names:
            peers[name].wait_ready(60)
            pubs[name].wait_subscribed(30)
            with httpx.Client() as client:
                fill(peers[name], pubs[name], prompt, PODS, client, 60)
        arms = {
            "kvindex, 1 process": [peers["one"]],
            "kvindex --processes 2": [peers["workers"]],
            "2 replicas (bound)": [peers["replica-a"], peers["replica-b"]],
            "Dynamo": [peers["Dynamo"]],
        }
        print(
            f"{CLIENTS} clients, {PROMPT_TOKENS}-token prompts, {PODS} pods, "
            f"rounds of {args.seconds:g} s in ABBA order"
        )
        for by_hash in (False, True):
            form = "by hash" if by_hash else "token_ids"
            rates: dict[str, list[float]] = {arm: [] for arm in arms}
            order = [*arms, *reversed(arms)]
            for arm in order + order:
                figures = _load(arms[arm], prompts, by_hash, args.seconds)
                rates[arm].append(figures["rps"])
                print(
                    f"  {form:9} {arm:22} {figures['rps']:8,.0f} req/s, "
                    f"p50 {figures['p50_ms']:.2f} ms",
                    flush=True,
                )
            dynamo = statistics.median(rates["Dynamo"])
            for arm, got in rates.items():
                median = statistics.median(got)
                print(
                    f"{form:9} {arm:22} median {median:8,.0f} req/s  "
                    f"({median / dynamo:.2f}x Dynamo's)"
                )
    finally:
        for peer in peers.values():
            peer.stop()
        for publishers in pubs.values():
            publishers.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    sys.exit(main())

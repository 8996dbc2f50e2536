"""kvindex beside NVIDIA Dynamo's standalone KV indexer, in one run, same events, same queries.

Both peers subscribe to N loopback ZMQ publishers sending vLLM 0.33 KV event batches
(kvindex's own encoder; real vLLM sha256 block hashes of random prompts, with token ids,
so kvindex keys by the engine's hashes and Dynamo by its own hashes of the same token
ids, and a ``token_ids`` query means the same to both). Each peer has its own publisher
sockets and is measured alone, the other idle, on the same bytes:

* ZMQ -> visible ingest, blocks/s, at 1 and 8 events per message, fresh keys (no payload
  sent twice): from the first send until the last event of every publisher answers a
  query (``/score`` / ``/query``, polled one at a time). A run lasts about a second, so
  one run is noisy on a shared machine (single runs on one quiet machine gave kvindex
  0.85-1.43x Dynamo's rate): each peer runs ``--rounds`` times (3) per size, fresh
  batches every round, the peers taking turns and swapping who goes first each round,
  and the figure is the median;
* memory per (block, pod): resident growth (PSS over the server's processes) over the
  second ingest run / its blocks (the first burst has set the transient high-water), and
  over both runs of the first
  round, each read once it settles after the run's events are visible
  (:func:`settled_rss`); left out with ``--presize`` (kvindex's table is allocated
  before the runs: its growth over them says nothing);
* an 8,192-token prompt over 64 pods (pod i holds its first 8·(i+1) blocks): answers of
  both compared pod for pod on a sample of prompts; 1 client p50/p99; 16 clients req/s.
  Query prompts share a prefix of varying length with the filled prompt and end in
  random tokens; a pool of them is cycled. The queries come from one load generator
  process on the same machine, the same for both peers (``--generator``: the minimal
  asyncio client of ``bench_score.py``, or wrk, which costs about half the CPU per
  request); each peer's CPU per request is printed beside it.

Prints each figure for both, the ratio, and PASS/FAIL against issue 13's target (each
figure >= 1.2x Dynamo's); then the floors (pyzmq receive, msgspec decode, SHA-256 alone).
Needs Dynamo's ``ai-dynamo-runtime`` in some Python (``--dynamo-python``; it pins
pydantic <= 2.13.5, so a venv of its own keeps kvindex's environment intact).

    python -m bench.compare_peers [--quick] [--only ingest] [--rounds 3] [--presize]
                               [--processes 2] [--dynamo-python .dynvenv/bin/python]

``--processes 2`` runs ``kvindex serve --processes 2`` (serving workers over the index in
shared memory); memory is read as the processes' proportional set sizes, so the shared
index counts once.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import time

import httpx
import zmq

from bench.bench_score import _measure
from bench.peers import floors, wrk
from bench.peers.feed import BLOCK, EVENT_TOKENS, Batches, Publishers, fresh_batches, prefix_fill
from bench.peers.servers import DynamoPeer, KvindexPeer, Peer, cpu_seconds, rss_bytes

TARGET = 1.2  # issue 13: every figure >= 1.2x Dynamo's
#: After an ingest run its RSS is read once it settles (either peer may give memory back
#: once a burst is applied): unchanged within SETTLE_TOLERANCE over SETTLE_S, at most
#: SETTLE_MAX_S after the run's events were visible. The same for both peers.
SETTLE_S = 1.0
SETTLE_TOLERANCE = 0.005
SETTLE_MAX_S = 10.0
#: Between visibility polls: each poll is a query the server answers during the run (its
#: CPU counts in the run's), so polling every 2 ms cost kvindex ~0.3 CPU-s of a 1 CPU-s
#: run; 10 ms bounds the error on a run of a second or more at 1%.
POLL_S = 0.01


def wait_visible(peer: Peer, client: httpx.Client, last: dict[int, list[int]], timeout_s: float):
    """Poll, one publisher at a time, until each one's last event answers a query."""
    deadline = time.monotonic() + timeout_s
    for pub, tokens in sorted(last.items()):
        while True:
            try:
                if peer.query(client, tokens).get(pub) == len(tokens):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{peer.name}: publisher {pub}'s events not visible in time")
            time.sleep(POLL_S)
    return time.perf_counter()


def settled_rss(pid: int) -> int:
    """The process tree's RSS once it no longer moves (see SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_MAX_S
    last = rss_bytes(pid)
    while time.monotonic() < deadline:
        time.sleep(SETTLE_S)
        now = rss_bytes(pid)
        if abs(now - last) <= SETTLE_TOLERANCE * last:
            return now
        last = now
    return last


def ingest(peer: Peer, pubs: Publishers, batches: Batches, client, timeout_s: float) -> dict:
    cpu0 = cpu_seconds(peer.process.pid)
    started = time.perf_counter()
    pubs.send(batches.payloads)
    done = wait_visible(peer, client, batches.last_tokens, timeout_s)
    return {
        "blocks_per_s": batches.blocks / (done - started),
        "cpu_s": cpu_seconds(peer.process.pid) - cpu0,
        "seconds": done - started,
        "blocks": batches.blocks,
    }


def fill(peer: Peer, pubs: Publishers, prompt: list[int], pods: int, client, timeout_s) -> None:
    pubs.send(prefix_fill(prompt, pods))
    want = {i: min(len(prompt), 8 * BLOCK * (i + 1)) for i in range(pods)}
    deadline = time.monotonic() + timeout_s
    while (got := _safe_query(peer, client, prompt)) != want:
        if time.monotonic() > deadline:
            raise SystemExit(f"{peer.name}: prefix fill not visible: {got}")
        time.sleep(0.02)


def _safe_query(peer: Peer, client, tokens: list[int]) -> dict[int, int] | None:
    try:
        return peer.query(client, tokens)
    except httpx.HTTPError:
        return None


def query_prompts(prompt: list[int], count: int, seed: int) -> list[list[int]]:
    """The filled prompt's first k blocks, then random tokens: each a different answer."""
    rng = random.Random(seed)
    out = [prompt]
    while len(out) < count:
        k = rng.randrange(0, len(prompt) // BLOCK)
        out.append(
            prompt[: k * BLOCK] + [rng.randrange(150_000) for _ in range(len(prompt) - k * BLOCK)]
        )
    return out


def verdict(ours: float, theirs: float, higher_better: bool) -> tuple[float, str]:
    ratio = ours / theirs if higher_better else theirs / ours
    return ratio, "PASS" if ratio >= TARGET else "FAIL"


def dynamo_python(given: str | None) -> str:
    if given:
        return given
    for candidate in (".dynvenv/bin/python", sys.executable):
        probe = [candidate, "-c", "import dynamo.indexer"]
        if os.path.exists(candidate) and subprocess.run(probe, capture_output=True).returncode == 0:
            return candidate
    raise SystemExit(
        "no Python with ai-dynamo-runtime: python3.11 -m venv .dynvenv && "
        ".dynvenv/bin/pip install ai-dynamo-runtime==1.6.1, or --dynamo-python"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=500_000, help="fresh blocks per ingest run")
    parser.add_argument(
        "--rounds", type=int, default=3, help="ingest runs per peer and size (median reported)"
    )
    parser.add_argument("--requests", type=int, default=1000, help="1-client requests")
    parser.add_argument("--seconds", type=float, default=10.0, help="16-client run length")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=256, help="distinct query prompts")
    parser.add_argument("--check", type=int, default=64, help="prompts whose answers are compared")
    parser.add_argument("--quick", action="store_true", help="8 pods, 2,048 tokens, small runs")
    parser.add_argument(
        "--only",
        choices=("ingest",),
        help="ingest: only the ingest and memory figures (no prefix fill, no queries)",
    )
    parser.add_argument(
        "--presize",
        action="store_true",
        help="kvindex serve --expected-blocks for every block the run sends: the index as a "
        "cluster at steady state has it (sized to the pods' blocks), not grown from empty "
        "(no memory figures then: the table is allocated before the runs)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="kvindex serve --processes: serving processes (Dynamo's indexer uses threads)",
    )
    parser.add_argument("--dynamo-python", help="a Python with ai-dynamo-runtime installed")
    parser.add_argument(
        "--dynamo-threads", type=int, help="dynamo.indexer --threads (default: its own)"
    )
    parser.add_argument(
        "--kvindex-flag", action="append", default=[], help="extra kvindex serve flag"
    )
    parser.add_argument(
        "--generator",
        choices=("python", "wrk"),
        default="python",
        help="the query load generator, the same for both peers: the minimal asyncio client "
        "(bench_score.py's) or wrk (apt install wrk; ~half its CPU per request)",
    )
    args = parser.parse_args()
    if args.generator == "wrk" and not wrk.available():
        raise SystemExit("--generator wrk: no wrk on PATH (Debian: apt-get install wrk)")
    if args.quick:
        args.pods, args.prompt_tokens, args.blocks = 8, 2048, 64_000
        args.requests, args.seconds, args.prompts, args.check = 200, 3.0, 64, 16
    python = dynamo_python(args.dynamo_python)
    if args.presize:
        sent = 2 * args.blocks * args.rounds + args.prompt_tokens // BLOCK
        args.kvindex_flag += ["--expected-blocks", str(sent)]
    if args.processes > 1:
        args.kvindex_flag += ["--processes", str(args.processes)]
    ctx = zmq.Context()
    pubs = {"kvindex": Publishers(ctx, args.pods), "Dynamo": Publishers(ctx, args.pods)}
    peers: list[Peer] = []
    try:
        peers.append(KvindexPeer(pubs["kvindex"].endpoints, args.kvindex_flag))
        peers.append(DynamoPeer(python, pubs["Dynamo"].endpoints, args.dynamo_threads))
        return run(args, pubs, peers)
    finally:
        for peer in peers:
            peer.stop()
        for p in pubs.values():
            p.close()
        ctx.term()


def run(args, pubs: dict[str, Publishers], peers: list[Peer]) -> int:
    """Each figure for kvindex then Dynamo, figure by figure: load from other work on a
    shared machine then hits both alike more than if one peer ran all its figures first."""
    rng = random.Random(1)
    prompt = [rng.randrange(150_000) for _ in range(args.prompt_tokens)]
    fresh = 2 * args.blocks * args.rounds
    print(f"encoding {fresh:,} fresh blocks, {args.pods} publishers ...", flush=True)
    # Every round its own fresh batches (no payload is sent twice); round 0's are the
    # ones the memory figures and the floors use.
    rounds = [
        {n: fresh_batches(args.blocks, n, args.pods, seed=n + 100 * r) for n in (1, 8)}
        for r in range(args.rounds)
    ]
    runs = rounds[0]
    prompts = query_prompts(prompt, args.prompts, seed=2)
    for peer in peers:
        peer.wait_ready(60)
        pubs[peer.name].wait_subscribed(30)
    results: dict[str, dict] = {peer.name: {} for peer in peers}
    answers: dict[str, list] = {}
    clients = {peer.name: httpx.Client() for peer in peers}
    rss0 = {peer.name: rss_bytes(peer.process.pid) for peer in peers}
    stored = sum(b.blocks for b in runs.values())
    rss: dict[tuple[str, int], int] = {}
    for r, batches_by_size in enumerate(rounds):
        # The peers take turns, and swap who goes first every round: a burst of load
        # from other work, or a machine warming up, falls on both alike.
        order = peers if r % 2 == 0 else peers[::-1]
        for n, batches in batches_by_size.items():
            for peer in order:
                got = ingest(peer, pubs[peer.name], batches, clients[peer.name], 300)
                if r == 0:  # memory: round 0's growth, each run read once it settles
                    rss[peer.name, n] = settled_rss(peer.process.pid)
                results[peer.name].setdefault(f"ingest{n}", []).append(got)
                print(
                    f"  {peer.name:8} ingest {n}/msg, round {r + 1}: "
                    f"{got['blocks_per_s']:,.0f} blocks/s, "
                    f"{got['cpu_s']:.2f} CPU-s in {got['seconds']:.2f} s",
                    flush=True,
                )
    for peer in peers:
        r = results[peer.name]
        # The second run's growth: the first burst already set each server's transient
        # high-water (queued messages, allocator arenas), so this is closer to the index.
        r["bytes_per_entry"] = (rss[peer.name, 8] - rss[peer.name, 1]) / runs[8].blocks
        r["bytes_per_entry_all"] = (rss[peer.name, 8] - rss0[peer.name]) / stored
        if args.only == "ingest":
            continue
        fill(peer, pubs[peer.name], prompt, args.pods, clients[peer.name], 60)
        answers[peer.name] = [peer.query(clients[peer.name], p) for p in prompts[: args.check]]
        answers[peer.name + "#"] = [
            peer.query(clients[peer.name], p, by_hash=True) for p in prompts[: args.check]
        ]
        clients[peer.name].close()
    forms = (("", False), ("#", True))
    if args.only == "ingest":
        return report(args, results, None, runs, prompt)
    for label, count, seconds in (("one", 1, None), ("many", args.clients, args.seconds)):
        for (mark, by_hash), peer in ((f, p) for f in forms for p in peers):
            make = peer.hash_body if by_hash else peer.body
            bodies = [make(p) for p in prompts]
            path = peer.hash_path if by_hash else peer.path
            r = query_load(args, peer, bodies, count, seconds, path)
            results[peer.name][label + mark] = r
            print(
                f"  {peer.name:8} {count:2} client(s){' by hash' if by_hash else ''}: "
                f"{r['rps']:,.0f} req/s, "
                f"p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms; CPU per request: "
                f"server {r['server_us']:.0f} µs, {args.generator} {r['generator_us']:.0f} µs",
                flush=True,
            )
    return report(args, results, answers, runs, prompt)


def query_load(args, peer: Peer, bodies: list[bytes], count: int, seconds, path: str) -> dict:
    """One query run with the chosen generator, and the server's CPU per request."""
    cpu = cpu_seconds(peer.process.pid)
    if args.generator == "wrk":
        r = wrk.measure(peer.port, bodies, count, seconds or max(2.0, args.seconds / 2), path)
    else:
        n = args.requests if count == 1 else None
        r = _measure(peer.port, bodies, count, seconds=seconds, count=n, path=path)
    r["server_us"] = 1e6 * (cpu_seconds(peer.process.pid) - cpu) / max(1, r["requests"])
    return r


def _wall(run: dict) -> float:
    return run["blocks_per_s"]


def _per_cpu(run: dict) -> float:
    return run["blocks"] / max(run["cpu_s"], 0.01)


def _median(runs: list[dict], figure) -> float:
    """A figure's median over the rounds (ingest runs are short: one run is noisy)."""
    return statistics.median(figure(run) for run in runs)


def rows(args, k: dict, d: dict) -> list[tuple[str, float, float, bool, str]]:
    """(figure, kvindex, Dynamo, higher is better, format) for every compared figure."""
    out = []
    for n in (1, 8):
        a, b = k[f"ingest{n}"], d[f"ingest{n}"]
        out.append((f"ingest {n} event(s)/msg, blocks/s", _median(a, _wall), _median(b, _wall)))
        out.append(("  same, blocks per server CPU-s", _median(a, _per_cpu), _median(b, _per_cpu)))
    table = [(name, ours, theirs, True, ",.0f") for name, ours, theirs in out]
    for mark, form in () if args.only == "ingest" else (("", "token_ids"), ("#", "by hash")):
        one, many = "one" + mark, "many" + mark
        rps = f"query {form}, {args.clients} clients, req/s"
        table += [
            (f"query {form}, 1 client p50, ms", k[one]["p50_ms"], d[one]["p50_ms"], False, ".3f"),
            (f"query {form}, 1 client p99, ms", k[one]["p99_ms"], d[one]["p99_ms"], False, ".3f"),
            (rps, k[many]["rps"], d[many]["rps"], True, ",.0f"),
            (
                "  same, server CPU µs per request",
                k[many]["server_us"], d[many]["server_us"], False, ".0f",
            ),
        ]  # fmt: skip
    if args.presize:  # kvindex's table was allocated up front: RSS growth says nothing
        return table
    for name, key in (
        ("memory per (block, pod), 2nd run, B", "bytes_per_entry"),
        ("  same, both runs (incl. 1st burst)", "bytes_per_entry_all"),
    ):
        table.append((name, k[key], d[key], False, ".1f"))
    return table


def report(args, results, answers, runs, prompt) -> int:
    if answers is None:  # --only ingest: no queries were asked
        same = same_hash = True
    else:
        same = answers["kvindex"] == answers["Dynamo"]
        same_hash = answers["kvindex#"] == answers["Dynamo#"] == answers["kvindex"]
    print(
        f"\n{args.prompt_tokens}-token prompt, {args.pods} pods, "
        f"{args.blocks:,} fresh blocks per ingest run, median of {args.rounds} rounds"
        + (", kvindex presized" if args.presize else ", kvindex's index grown from empty")
        + (f", kvindex --processes {args.processes}" if args.processes > 1 else "")
        + ("" if answers is None else f", queries by {args.generator}")
    )
    print(f"{'figure':40} {'kvindex':>12} {'Dynamo':>12} {'ratio':>7}  target >= {TARGET}x")
    failed = not (same and same_hash)
    for name, ours, theirs, higher, fmt in rows(args, results["kvindex"], results["Dynamo"]):
        ratio, mark = verdict(ours, theirs, higher)
        failed |= mark == "FAIL"
        print(f"{name:40} {ours:>12{fmt}} {theirs:>12{fmt}} {ratio:>6.2f}x  {mark}")
    if answers is not None:
        mark, mark_hash = ("PASS" if ok else "FAIL" for ok in (same, same_hash))
        print(f"answers identical on {len(answers['kvindex'])} prompts: {mark}")
        print(f"answers by hash identical (and equal to token_ids'): {mark_hash}")
    if not same:
        pairs = zip(answers["kvindex"], answers["Dynamo"], strict=True)
        first = next((a, b) for a, b in pairs if a != b)
        print("  first difference (kvindex, Dynamo):", first)
    p1 = [p for _, p in runs[1].payloads]
    p8 = [p for _, p in runs[8].payloads]
    print("floors (one step alone, this machine):")
    for name, rate in (
        ("pyzmq receive, 1 event/msg", floors.zmq_receive(p1, runs[1].blocks)),
        ("msgspec decode, 1 event/msg", floors.msgspec_decode(p1, runs[1].blocks)),
        ("msgspec decode, 8 events/msg", floors.msgspec_decode(p8, runs[8].blocks)),
    ):
        print(f"  {name:30} {rate:>12,.0f} blocks/s")
    sha = floors.sha256_prompt(prompt)
    print(f"  SHA-256 of the prompt's {len(prompt) // BLOCK} blocks: {sha:,.0f} µs")
    load = os.getloadavg()[0]
    print(
        f"  ({EVENT_TOKENS // BLOCK}-block events; load average {load:.1f}, {os.cpu_count()} cores)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    sys.exit(main())

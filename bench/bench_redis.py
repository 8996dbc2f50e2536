"""Benchmark of the Redis backend (indexer/redis/backend.py): figures, and issue 13's target.

    python bench/bench_redis.py                  # a private redis-server on a free port
    python bench/bench_redis.py --quick          # small sizes, a few seconds
    python bench/bench_redis.py --redis-url redis://127.0.0.1:6379/0   # an existing server
    python bench/bench_redis.py --target-only    # only issue 13's /score figure, PASS/FAIL

The figures, each with the workload it was measured on:

* ingest throughput in blocks/s: 32-block BlockStored changes through
  ``RedisBackend.apply``, 64 changes of one pod per call (what the subscriber's applier
  hands the sink for one stream's turn), then the same blocks removed;
* Redis memory per (block, pod) entry: ``used_memory`` from ``INFO memory`` before and
  after, divided by the entries added, for two sharing profiles;
* lookup in-process for a 512-block chain (an 8,192-token prompt) across 64 pods: the
  backend's reads (one MULTI/EXEC of HMGETs, the walk in the client), compiled
  (indexer/redis/_redis_lookup.c), with hiredis and numpy, and without hiredis, against
  redis-py pipelines of one HGET per block; per lookup the latency, the
  client's CPU, Redis's busy time (``INFO commandstats``) and Redis's CPU (``INFO cpu``);
* how to keep lookups off the event loop (issue 13, ``bench/bench_redis_offload.py``):
  16 concurrent callers on one asyncio loop, the CPU of the hop to a thread and back
  (api/http/offload.py's IndexWork against a ThreadPoolExecutor), and the lookup run inline
  or through either;
* ``/score`` over HTTP and issue 13's Redis target (``bench/bench_redis_http.py``):
  requests/s with 16 clients and p50 with one, ``token_ids`` and ``block_hashes``
  bodies, from a load generator in its own process, with PASS/FAIL (the exit status is
  1 on FAIL), and what one request costs kvindex and Redis. ``--target-only`` runs
  just this.

The private server runs with ``--save '' --appendonly no`` so disk I/O does not enter
the figures; a deployment with AOF (``deploy/overlays/redis``) adds its fsync cost to
ingest only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np
import redis

try:  # run as a script: bench/ is sys.path[0]
    from bench_redis_http import (
        bench_http,
        bench_target,
        load_average,
        percentiles,
        redis_busy_us,
        redis_cpu_s,
    )
    from bench_redis_offload import bench_off_loop
except ModuleNotFoundError:  # imported as bench.bench_redis
    from bench.bench_redis_http import (
        bench_http,
        bench_target,
        load_average,
        percentiles,
        redis_busy_us,
        redis_cpu_s,
    )
    from bench.bench_redis_offload import bench_off_loop

from kvindex.api.testing import free_port
from kvindex.indexer.backend import Change, MemberMatch, Op, Tier
from kvindex.indexer.keys import BlockHasher, HashConfig
from kvindex.indexer.redis.backend import RedisBackend, pack_keys
from kvindex.indexer.redis.connection import RedisConnection, RedisOptions

MODEL = "bench/model"
EVENT_BLOCKS = 32  # blocks per BlockStored (one scheduler step of a busy pod)
EVENTS_PER_CALL = 64  # the applier's batches_per_turn: one stream's turn is one apply
PROMPT_TOKENS = 8192
BLOCK_SIZE = 16


def member_ids(n: int) -> list[str]:
    return [f"127.10.{i // 200}.{i % 200 + 1}:8000" for i in range(n)]  # loopback only


def random_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


# -- ingest and memory ------------------------------------------------------------------------


def events(member: str, keys: np.ndarray, op: Op = Op.STORE) -> list[Change]:
    """One member's 32-block events, keys as lists of Python ints (as the decoder makes)."""
    return [
        Change(op, member, MODEL, Tier.GPU, keys[i : i + EVENT_BLOCKS].tolist())
        for i in range(0, keys.size, EVENT_BLOCKS)
    ]


def apply_in_turns(backend: RedisBackend, per_member: list[list[Change]]) -> float:
    """Apply every member's changes, one stream's turn (64 events) per call, round
    robin over members as the applier does; return the seconds taken."""
    calls = []
    for changes in per_member:
        calls.append(
            [changes[i : i + EVENTS_PER_CALL] for i in range(0, len(changes), EVENTS_PER_CALL)]
        )
    t0 = time.perf_counter()
    for turn in range(max(len(c) for c in calls)):
        for member_calls in calls:
            if turn < len(member_calls):
                backend.apply(member_calls[turn])
    return time.perf_counter() - t0


def bench_ingest(args: argparse.Namespace, backend: RedisBackend, client: redis.Redis) -> None:
    rng = np.random.default_rng(1)
    members = member_ids(args.members)
    per_member_keys = [random_keys(rng, args.blocks_per_member) for _ in members]
    total = sum(k.size for k in per_member_keys)
    stores = [events(m, k) for m, k in zip(members, per_member_keys, strict=True)]
    removes = [events(m, k, Op.REMOVE) for m, k in zip(members, per_member_keys, strict=True)]
    print(
        f"ingest: {total:,} blocks, {len(members)} pods, {EVENT_BLOCKS}-block events, "
        f"{EVENTS_PER_CALL} events ({EVENTS_PER_CALL * EVENT_BLOCKS} blocks) per apply call; "
        f"unique random keys (keys as lists of ints, packing included)"
    )
    before = used_memory(client)
    seconds = apply_in_turns(backend, stores)
    after = used_memory(client)
    print(f"  store   {total / seconds:>12,.0f} blocks/s   ({seconds:.2f} s)")
    print(
        f"  memory  {(after - before) / total:>12.1f} bytes per (block, pod) entry, "
        f"profile 'unique' (every block held by one pod; {total:,} entries)"
    )
    seconds = apply_in_turns(backend, removes)
    print(f"  remove  {total / seconds:>12,.0f} blocks/s   ({seconds:.2f} s)")
    left = backend.stats()
    print(f"  after removing everything: {left.keys} keys, {left.members} members")


def bench_memory_shared(
    args: argparse.Namespace, backend: RedisBackend, client: redis.Redis
) -> None:
    """A pool of shared prefixes (system prompts, documents) held by every pod, plus
    each pod's own blocks: the common shape of a serving cluster's caches."""
    rng = np.random.default_rng(3)
    members = member_ids(args.members)
    shared = random_keys(rng, args.blocks_per_member // 4)
    own = [random_keys(rng, args.blocks_per_member - shared.size) for _ in members]
    before = used_memory(client)
    apply_in_turns(
        backend, [events(m, shared) + events(m, k) for m, k in zip(members, own, strict=True)]
    )
    after = used_memory(client)
    entries = sum(k.size + shared.size for k in own)
    distinct = shared.size + sum(k.size for k in own)
    print(
        f"  memory  {(after - before) / entries:>12.1f} bytes per (block, pod) entry, profile "
        f"'shared' (a quarter of each pod's blocks held by all {len(members)} pods; "
        f"{entries:,} entries, {distinct:,} distinct blocks, "
        f"{(after - before) / distinct:.1f} bytes per distinct block)"
    )
    for member in members:
        backend.clear_member(member)


# -- lookups ------------------------------------------------------------------------------------


def prefix_lengths(rng: np.random.Generator, members: int, chain: int) -> list[int]:
    """How much of the looked-up chain each pod holds (as in bench/bench_index.py): a few
    hold it all, some a long shared prefix, most only the system prompt, some nothing."""
    shares = [(0.06, chain, chain), (0.14, chain // 2, chain - 1), (0.35, chain // 8, chain // 2)]
    shares += [(0.30, 4, chain // 8), (0.15, 0, 0)]
    out: list[int] = []
    for share, low, high in shares:
        out += [int(rng.integers(low, high + 1)) for _ in range(round(share * members))]
    out += [0] * (members - len(out))
    return out[:members]


class PipelineLookup:
    """The alternative to the Lua script: read each block's bitmap with HGET in a
    pipeline and walk the chain in Python. ``chunk`` blocks per round trip, stopping
    when no pod is left (``chunk=None``: the whole chain in one round trip)."""

    def __init__(self, backend: RedisBackend, model: str) -> None:
        self.client = backend.connection.client()
        self.keys = backend.keys.model(model)
        self.buckets = int(self.client.hget(self.keys.meta, "buckets"))
        names = self.client.hgetall(self.keys.names)
        self.names = {int(k): v.decode() for k, v in names.items()}

    def lookup(self, keys: Sequence[int], chunk: int | None) -> list[MemberMatch]:
        packed = pack_keys(keys)
        fields = [packed[i : i + 8] for i in range(0, len(packed), 8)]
        step = chunk or len(fields)
        alive: int | None = None
        ends: dict[int, int] = {}
        done = False
        for start in range(0, len(fields), step):
            pipe = self.client.pipeline(transaction=False)
            part = fields[start : start + step]
            for f in part:
                pipe.hget(self.keys.bucket(int.from_bytes(f[6:8], "big") % self.buckets), f)
            for offset, value in enumerate(pipe.execute()):
                held = int.from_bytes(value, "little") if value else 0
                now = held if alive is None else alive & held
                position = start + offset
                if alive is not None and now != alive:
                    gone = alive & ~now
                    while gone:
                        low = gone & -gone
                        ends[low.bit_length() - 1] = position
                        gone ^= low
                alive = now
                if not alive:
                    done = True
                    break
            if done:
                break
        if alive:
            while alive:
                low = alive & -alive
                ends[low.bit_length() - 1] = len(fields)
                alive ^= low
        out = [MemberMatch(self.names[m], n, (n, 0, 0)) for m, n in ends.items() if n]
        out.sort(key=lambda m: (-m.matched_blocks, m.member))
        return out


def populate_prompt(args: argparse.Namespace, backend: RedisBackend) -> list[int]:
    """Store prefixes of the 8,192-token prompt's real block keys for 64 pods, over a
    background of other blocks; return the prompt's tokens."""
    rng = np.random.default_rng(4)
    members = member_ids(64)
    tokens = [int(t) for t in rng.integers(0, 150_000, PROMPT_TOKENS)]
    chain = BlockHasher(HashConfig()).keys(tokens)
    background = random_keys(rng, args.background)
    apply_in_turns(
        backend,
        [events(m, part) for m, part in zip(members, np.array_split(background, 64), strict=True)],
    )
    lengths = prefix_lengths(rng, 64, len(chain))
    for member, n in zip(members, lengths, strict=True):
        if n:
            backend.apply(
                [
                    Change(Op.STORE, member, MODEL, Tier.GPU, chain[i : min(i + EVENT_BLOCKS, n)])
                    for i in range(0, n, EVENT_BLOCKS)
                ]
            )
    holders = sum(1 for n in lengths if n)
    stats = backend.stats()
    print(
        f"lookup: chain of {len(chain)} blocks (an {PROMPT_TOKENS}-token prompt), 64 pods; "
        f"{holders} hold a prefix of it (lengths min/median/max {min(lengths)}/"
        f"{int(statistics.median(lengths))}/{max(lengths)}); index: {stats.keys:,} keys"
    )
    return tokens


def bench_lookup(
    args: argparse.Namespace, backend: RedisBackend, url: str, tokens: list[int]
) -> None:
    chain = BlockHasher(HashConfig()).keys(tokens)
    pure = RedisBackend(
        RedisConnection(RedisOptions.from_url(url), use_hiredis=False), backend.prefix
    )
    numpy_path = RedisBackend(
        RedisConnection(RedisOptions.from_url(url), compiled=False), backend.prefix
    )
    pipeline = PipelineLookup(backend, MODEL)
    answer = backend.lookup(MODEL, chain)
    assert pipeline.lookup(chain, None) == answer, "the HGET pipeline disagrees"
    assert pure.lookup(MODEL, chain) == answer, "the pure-Python reply reader disagrees"
    assert numpy_path.lookup(MODEL, chain) == answer, "the numpy path disagrees"
    print(f"  answer: {len(answer)} pods, best {answer[0].matched_blocks} blocks")
    candidates = [m.member for m in answer[::8]]
    walk = "compiled" if backend.connection.compiled else "numpy"
    cases: list[tuple[str, Callable[[], object]]] = [
        (f"backend ({walk}: MULTI of HMGETs, walk here)", lambda: backend.lookup(MODEL, chain)),
        (
            f"backend, {len(candidates)} candidate pods",
            lambda: backend.lookup(MODEL, chain, candidates),
        ),
        ("backend, 16-block chain", lambda: backend.lookup(MODEL, chain[:16])),
        ("backend presence (hybrid models)", lambda: backend.presence(MODEL, chain)),
        ("backend, hiredis + numpy walk", lambda: numpy_path.lookup(MODEL, chain)),
        ("backend without hiredis", lambda: pure.lookup(MODEL, chain)),
        ("pipeline, HGET per block, 1 trip", lambda: pipeline.lookup(chain, None)),
        ("pipeline, 64 per trip, early exit", lambda: pipeline.lookup(chain, 64)),
    ]
    client = backend.connection.client()
    print(
        f"  {'':<38} {'':<48} client CPU  Redis busy   Redis CPU  (per lookup; "
        f"load average {load_average()})"
    )
    for name, call in cases:
        for _ in range(50):
            call()
        client.config_resetstat()
        cpu0, own0 = redis_cpu_s(client), time.process_time()
        samples = []
        for _ in range(args.lookups):
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
        own = (time.process_time() - own0) / args.lookups * 1e6
        redis_cpu = (redis_cpu_s(client) - cpu0) / args.lookups * 1e3
        busy = redis_busy_us(client) / args.lookups / 1e3
        print(
            f"  {name:<38} {percentiles(samples)}  {own:6.0f} µs  {busy:6.3f} ms  "
            f"{redis_cpu:6.3f} ms"
        )
    pure.close()
    numpy_path.close()


# -- main ---------------------------------------------------------------------------------------


def start_private_redis() -> tuple[subprocess.Popen[bytes], str, str]:
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not installed: pass --redis-url")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="kvindex-bench-redis-")
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return process, f"redis://127.0.0.1:{port}/0", workdir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", help="an existing server (default: start a private one)")
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--members", type=int, default=64)
    parser.add_argument("--blocks-per-member", type=int, default=16384)
    parser.add_argument("--background", type=int, default=262_144)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--skip-http", action="store_true")
    parser.add_argument("--seconds", type=float, default=10.0, help="16-client run length")
    parser.add_argument(
        "--target-only", action="store_true", help="only issue 13's /score figure (PASS/FAIL)"
    )
    parser.add_argument("--buckets", type=int, help="buckets per model (URL option buckets=)")
    args = parser.parse_args()
    if args.quick:
        args.blocks_per_member, args.background = 1024, 16384
        args.lookups = args.requests = 200
        args.seconds = 3.0

    private = None
    url = args.redis_url
    if url is None:
        private, url, workdir = start_private_redis()
    if args.buckets:
        url += ("&" if "?" in url else "?") + f"buckets={args.buckets}"
    prefix = f"kvbench-{os.getpid()}"
    try:
        backend = RedisBackend(RedisConnection(RedisOptions.from_url(url)), prefix)
        plain = RedisOptions.from_url(url).url  # without kvindex's own options
        client = redis.Redis.from_url(plain)
        info = client.info("server")
        print(
            f"Redis {info['redis_version']} at {url}"
            f"{' (private, no persistence)' if private else ''}; "
            f"{os.cpu_count()} CPUs; prefix {prefix}\n"
        )
        if not args.target_only:
            bench_ingest(args, backend, client)
            bench_memory_shared(args, backend, client)
            print()
        tokens = populate_prompt(args, backend)
        if not args.target_only:
            bench_lookup(args, backend, url, tokens)
            print()
            bench_off_loop(backend, BlockHasher(HashConfig()).keys(tokens), args.lookups)
            print()
            if not args.skip_http:
                bench_http(args, url, prefix, tokens)
                print()
        passed = bench_target(args, url, prefix, tokens)
    finally:
        if private is not None:
            private.terminate()
            private.wait(timeout=10)
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            client = redis.Redis.from_url(RedisOptions.from_url(url).url)
            for key in client.scan_iter(match=f"{prefix}*", count=1000):
                client.delete(key)  # bench cleanup only
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()

"""Benchmark of the in-memory block index (indexer/memory/backend.py). Prints figures; asserts
nothing.

    python bench/bench_index.py            # full sizes (about a minute)
    python bench/bench_index.py --quick    # small sizes, a few seconds

Three figures, each with the workload it was measured on:

* lookup latency of one chain across many members, as /score calls it (keys as a list
  of Python ints, which is what hashing produces; also as a uint64 array), alone and
  beside a thread applying batches back to back (re-stored keys, then fresh keys), with
  the blocks/s that writer reached meanwhile;
* store/remove throughput in blocks/s, both as the ingest applier hands batches (many
  32-block events of several members in one ``apply`` call) and one event per call;
* resident memory per (block, member) entry under a stated sharing profile, measured
  with tracemalloc (numpy reports its buffers to it) and as the RSS delta.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import statistics
import threading
import time
import tracemalloc
from collections.abc import Callable, Sequence

import numpy as np

from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.shared_index import SharedIndexReader, SharedIndexWriter

MODEL = "bench-model"
TIERED = "bench-model-tiered"
EVENT_BLOCKS = 32  # blocks per BlockStored/BlockRemoved event (vLLM: one scheduler step)


def member_ids(n: int) -> list[str]:
    return [f"127.10.{i // 200}.{i % 200 + 1}:8000" for i in range(n)]


def random_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    """Uniform uint64 block hashes (half of them >= 2**63, as in vLLM)."""
    return rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)


def percentile(sorted_ns: Sequence[int], q: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1000


def events(member: str, keys: np.ndarray, op: Op = Op.STORE) -> list[Change]:
    """The changes one member's 32-block events produce (keys as lists of ints)."""
    return [
        Change(op, member, MODEL, Tier.GPU, keys[i : i + EVENT_BLOCKS].tolist())
        for i in range(0, keys.size, EVENT_BLOCKS)
    ]


def interleave(per_member: list[list[Change]]) -> list[Change]:
    """Round-robin across members, as deliveries from many pods arrive."""
    out: list[Change] = []
    for i in range(max(len(p) for p in per_member)):
        out.extend(p[i] for p in per_member if i < len(p))
    return out


# -- lookup -----------------------------------------------------------------------------------


def prefix_lengths(rng: np.random.Generator, members: int, chain: int) -> list[int]:
    """How much of the looked-up chain each member holds: a few hold it all (the pod
    that served this conversation and its replicas), some a long shared document
    prefix, most only the system prompt, and some nothing."""
    shares = [(0.06, chain, chain), (0.14, chain // 2, chain - 1), (0.35, chain // 8, chain // 2)]
    shares += [(0.30, 4, chain // 8), (0.15, 0, 0)]
    out: list[int] = []
    for share, low, high in shares:
        out += [int(rng.integers(low, high + 1)) for _ in range(round(share * members))]
    out += [0] * (members - len(out))
    return out[:members]


def bench_lookup(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(1)
    members = member_ids(args.members)
    backend = MemoryBackend()
    chain = random_keys(rng, args.chain)
    lengths = prefix_lengths(rng, args.members, args.chain)
    background = random_keys(rng, args.background)
    per_member = np.array_split(background, args.members)
    for member, own in zip(members, per_member, strict=True):
        backend.apply([Change(Op.STORE, member, MODEL, Tier.GPU, own)])
    # The looked-up chain is stored last, into the full table: the blocks of the latest
    # prompts are the ones looked up, and the last keys in sit furthest from home.
    for i, (member, n) in enumerate(zip(members, lengths, strict=True)):
        backend.apply([Change(Op.STORE, member, MODEL, Tier.GPU, chain[:n])])
        # Same prefixes in a second model where every 4th member offloaded the second
        # half of its prefix to CPU memory: answers then count blocks per tier.
        gpu_part = n // 2 if i % 4 == 0 else n
        backend.apply(
            [
                Change(Op.STORE, member, TIERED, Tier.GPU, chain[:gpu_part]),
                Change(Op.STORE, member, TIERED, Tier.CPU, chain[gpu_part:n]),
            ]
        )
    stats = backend.stats()
    holders = sum(1 for n in lengths if n)
    print(
        f"lookup: chain of {args.chain} blocks, {args.members} members; "
        f"{holders} hold a prefix of it (lengths min/median/max "
        f"{min(lengths)}/{int(statistics.median(lengths))}/{max(lengths)}); "
        f"index: {stats.keys:,} keys, {sum(stats.blocks.values()):,} entries, "
        f"{stats.extra['table_slots']:,} slots"
    )
    chain_list = chain.tolist()
    candidates = members[::8]
    found = backend.lookup(MODEL, chain_list)
    print(f"  answer: {len(found)} members, best {found[0].matched_blocks} blocks")
    cases: list[tuple[str, Callable[[], object]]] = [
        ("keys as list[int]", lambda: backend.lookup(MODEL, chain_list)),
        ("keys as uint64 array", lambda: backend.lookup(MODEL, chain)),
        (
            f"list, {len(candidates)} candidates",
            lambda: backend.lookup(MODEL, chain_list, candidates),
        ),
        ("list, 16-block chain", lambda: backend.lookup(MODEL, chain_list[:16])),
        ("list, GPU + CPU tiers", lambda: backend.lookup(TIERED, chain_list)),
    ]
    lines = latencies([call for _, call in cases], args.lookups)
    for (name, _), line in zip(cases, lines, strict=True):
        print(f"  {name:<30} {line}")

    # The same lookups while another thread applies batches back to back, as the ingest
    # applier does under load: the store/remove churn of a fixed key set, then fresh keys
    # (every batch new blocks, the batch stored eight batches ago removed, so the table
    # keeps its size and sees dead slots and rebuilds, as under real eviction).
    churn = [random_keys(rng, EVENT_BLOCKS * 128) for _ in range(8)]

    def churning(i: int) -> list[Change]:
        op = Op.STORE if (i // len(churn)) % 2 == 0 else Op.REMOVE
        return events(members[i % len(members)], churn[i % len(churn)], op)

    recent: list[tuple[str, np.ndarray]] = []

    def fresh(i: int) -> list[Change]:
        member = members[i % len(members)]
        keys = random_keys(rng, EVENT_BLOCKS * 128)
        recent.append((member, keys))
        out = events(member, keys)
        if len(recent) > 8:
            old_member, old_keys = recent.pop(0)
            out += events(old_member, old_keys, Op.REMOVE)
        return out

    for name, batch in (("during writes", churning), ("during fresh-key ingest", fresh)):
        line, applied = lookups_beside_writer(cases[0][1], backend.apply, batch, args)
        print(f"  {'list, ' + name:<30} {line}   (writer: {applied / 1e6:.2f} M blocks/s)")

    # A serving worker's lookup (kvindex serve --processes): the same walk over the
    # tables in shared memory, with the structure's generation read before and after.
    # Read here from this process (the walk is the same from another); beside the writer
    # it also shares this process's GIL, which a worker does not.
    writer = SharedIndexWriter(backend)
    try:
        reader = SharedIndexReader(writer.directory)
        assert reader.lookup(MODEL, chain_list) == backend.lookup(MODEL, chain_list)
        (line,) = latencies([lambda: reader.lookup(MODEL, chain_list)], args.lookups)
        print(f"  {'list, shared-memory reader':<30} {line}")
        line, applied = lookups_beside_writer(
            lambda: reader.lookup(MODEL, chain_list), backend.apply, fresh, args
        )
        rate = f"{applied / 1e6:.2f} M blocks/s"
        print(f"  {'  same, during fresh-key ingest':<30} {line}   (writer: {rate}, same GIL)")
    finally:
        writer.close()


def lookups_beside_writer(
    call: Callable[[], object],
    apply: Callable[[list[Change]], None],
    batch: Callable[[int], list[Change]],
    args: argparse.Namespace,
) -> tuple[str, float]:
    """Timed lookups while a thread applies ``batch(i)`` for i = 0, 1, ... back to back
    (to the same backend); the latencies, and the blocks per second the writer applied
    meanwhile (it shares the GIL with the lookups, which run back to back too)."""
    stop = threading.Event()
    applied = [0]

    def write() -> None:
        i = 0
        while not stop.is_set():
            changes = batch(i)
            apply(changes)
            applied[0] += sum(len(c.keys) for c in changes)
            i += 1

    writer = threading.Thread(target=write)
    started = time.perf_counter()
    writer.start()
    try:
        (line,) = latencies([call], args.lookups // 4)
    finally:
        stop.set()
        writer.join()
    return line, applied[0] / (time.perf_counter() - started)


#: How lookups are timed: wall clock, or this thread's CPU time (``--clock cpu``: steadier
#: on a machine shared with other work, but blind to waiting for a lock).
CLOCK = time.perf_counter_ns


def latencies(calls: list[Callable[[], object]], n: int) -> list[str]:
    """p50/p99/mean of ``n`` timed calls each; the calls take turns in rounds of 100, so
    a burst of other work on the machine spreads over all of them."""
    times: list[list[int]] = [[] for _ in calls]
    clock = CLOCK
    for _ in range(2):
        for call in calls:
            call()  # warm up
    for _ in range(max(1, n // 100)):
        for call, out in zip(calls, times, strict=True):
            for _ in range(100):
                t0 = clock()
                call()
                out.append(clock() - t0)
    lines = []
    for out in times:
        out.sort()
        lines.append(
            f"p50 {percentile(out, 0.5):7.1f} us   p99 {percentile(out, 0.99):7.1f} us   "
            f"mean {statistics.fmean(out) / 1000:7.1f} us"
        )
    return lines


# -- store / remove ---------------------------------------------------------------------------


def bench_updates(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(2)
    members = member_ids(args.update_members)
    n = args.update_blocks
    per_member_keys = [random_keys(rng, n // len(members)) for _ in members]
    total = sum(k.size for k in per_member_keys)
    per_call = args.batch_events
    print(
        f"store/remove: {total:,} blocks, {len(members)} members, {EVENT_BLOCKS}-block events "
        f"(keys as lists of Python ints, conversion included)"
    )

    def run(label: str, calls: list[list[Change]], backend: MemoryBackend) -> None:
        blocks = sum(len(c.keys) for call in calls for c in call)
        gc.collect()
        t0 = time.perf_counter()
        for call in calls:
            backend.apply(call)
        dt = time.perf_counter() - t0
        print(f"  {label:<58} {blocks / dt / 1e6:6.2f} M blocks/s  ({dt:5.2f} s)")

    stores = interleave([events(m, k) for m, k in zip(members, per_member_keys, strict=True)])
    removes = interleave(
        [events(m, k, Op.REMOVE) for m, k in zip(members, per_member_keys, strict=True)]
    )
    batched = [stores[i : i + per_call] for i in range(0, len(stores), per_call)]
    unbatched = [[c] for c in stores]
    shape = f"{per_call} events ({per_call * EVENT_BLOCKS} blocks) per apply"

    backend = MemoryBackend()
    run(f"store, {shape}, into an empty index", batched, backend)
    fresh = MemoryBackend()
    fresh.apply([Change(Op.STORE, "warm:1", MODEL, Tier.GPU, np.concatenate(per_member_keys))])
    fresh.clear_member("warm:1")  # same table size, all dead: no growth during the run
    run(f"store, {shape}, table already sized", batched, fresh)
    announces = [
        [Change(Op.ANNOUNCE, c.member, c.model, c.tier, c.keys) for c in call] for call in batched
    ]
    run(f"announce (already held), {shape}", announces, backend)
    run(f"store a second copy of every block, {shape}", batched, fresh)
    run(
        f"remove, {shape}",
        [removes[i : i + per_call] for i in range(0, len(removes), per_call)],
        backend,
    )

    # The steady state of a busy cluster: each event evicts 32 old blocks and stores 32 new.
    churn = MemoryBackend()
    run("store (warm-up for churn)", batched, churn)
    fresh_keys = [random_keys(rng, k.size) for k in per_member_keys]
    mixed: list[Change] = []
    for member, old, new in zip(members, per_member_keys, fresh_keys, strict=True):
        pairs = zip(events(member, old, Op.REMOVE), events(member, new), strict=True)
        mixed.extend(c for pair in pairs for c in pair)
    mixed = interleave([mixed[i :: len(members)] for i in range(len(members))])
    run(
        f"churn: remove 32 + store 32 per event, {shape}",
        [mixed[i : i + per_call] for i in range(0, len(mixed), per_call)],
        churn,
    )

    single = MemoryBackend()
    run(f"store, one {EVENT_BLOCKS}-block event per apply", unbatched, single)
    run(f"remove, one {EVENT_BLOCKS}-block event per apply", [[c] for c in removes], single)
    arrays = [
        [Change(c.op, c.member, c.model, c.tier, np.array(c.keys, np.uint64))] for c in stores
    ]
    run(f"store, one {EVENT_BLOCKS}-block event per apply, uint64 arrays", arrays, MemoryBackend())


# -- memory -----------------------------------------------------------------------------------


def sharing_profile(rng: np.random.Generator, blocks: int, members: int) -> list[np.ndarray]:
    """Keys each member holds. ``blocks`` distinct keys:

    * 0.5% system-prompt blocks held by every member;
    * 10% shared-document blocks, each held by 4 members (a document asked about on
      several replicas);
    * the rest conversation blocks: 75% held by one member, 25% by two (a conversation
      that moved once).
    """
    keys = random_keys(rng, blocks)
    n_sys = blocks // 200
    n_doc = blocks // 10
    held: list[list[np.ndarray]] = [[] for _ in range(members)]
    for m in range(members):
        held[m].append(keys[:n_sys])
    docs = keys[n_sys : n_sys + n_doc]
    for i, part in enumerate(np.array_split(docs, members)):
        for j in range(4):
            held[(i + j) % members].append(part)
    conv = keys[n_sys + n_doc :]
    owner = rng.integers(0, members, conv.size)
    second = (owner + rng.integers(1, members, conv.size)) % members
    twice = rng.random(conv.size) < 0.25
    for m in range(members):
        held[m].append(conv[(owner == m) | (twice & (second == m))])
    return [np.concatenate(h) for h in held]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_memory(args: argparse.Namespace) -> None:
    print(
        f"memory: {args.memory_blocks:,} distinct blocks over {args.memory_members} members; "
        "profile: 0.5% system-prompt blocks held by all, 10% document blocks held by 4, "
        "the rest conversation blocks held by 1 (75%) or 2 (25%); built from 32-block "
        "events, 128 per apply call"
    )
    # Each measurement in a fresh interpreter, so the RSS delta is not hidden by memory
    # an earlier section freed but the allocator kept.
    ctx = multiprocessing.get_context("spawn")
    runs = [(False, 0.0), (True, 0.0)]
    if args.memory_copies:
        runs.append((False, args.memory_copies))
    for stamped, copies in runs:
        worker = ctx.Process(target=_memory_worker, args=(args, stamped, copies))
        worker.start()
        worker.join()


def _memory_worker(args: argparse.Namespace, stamped: bool, copies: float) -> None:
    rng = np.random.default_rng(3)
    held = sharing_profile(rng, args.memory_blocks, args.memory_members)
    members = member_ids(args.memory_members)
    entries = sum(h.size for h in held)
    # Inputs are built before measuring, as uint64 arrays (lists of Python ints would
    # count the inputs' own objects in the RSS figure).
    per_member = [
        [
            Change(Op.STORE, m, MODEL, Tier.GPU, h[i : i + EVENT_BLOCKS])
            for i in range(0, h.size, EVENT_BLOCKS)
        ]
        for m, h in zip(members, held, strict=True)
    ]
    changes = interleave(per_member)
    if copies:  # a second copy of a share of each member's entries, stored afterwards
        changes += [
            Change(Op.STORE, m, MODEL, Tier.GPU, h[i : i + EVENT_BLOCKS])
            for m, h in zip(members, held, strict=True)
            for i in range(0, int(h.size * copies), EVENT_BLOCKS)
        ]
    calls = [changes[i : i + 128] for i in range(0, len(changes), 128)]
    del per_member, changes
    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    backend = MemoryBackend(capacity_blocks=10 * args.memory_blocks if stamped else None)
    for call in calls:
        backend.apply(call)
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss = rss_bytes() - rss0
    stats = backend.stats()
    label = "with capacity bound (+stamps)" if stamped else "unbounded (no stamps)"
    if copies:
        label += f", {copies:.0%} of entries in two copies"
    print(
        f"  {label}: {entries:,} entries ({entries / stats.keys:.2f} per block), "
        f"table {stats.extra['table_slots']:,} slots for {stats.keys:,} keys\n"
        f"    tracemalloc {current / 2**20:6.1f} MiB = {current / entries:5.1f} B/entry "
        f"({current / stats.keys:5.1f} B/block; peak while building {peak / 2**20:.0f} MiB)\n"
        f"    RSS delta   {rss / 2**20:6.1f} MiB = {rss / entries:5.1f} B/entry",
        flush=True,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--only", choices=["lookup", "updates", "memory"], action="append")
    parser.add_argument("--members", type=int, default=64, help="members in the lookup index")
    parser.add_argument("--chain", type=int, default=512, help="blocks in the looked-up chain")
    parser.add_argument("--background", type=int, default=1_000_000, help="other blocks held")
    parser.add_argument("--lookups", type=int, default=20_000, help="timed lookups per case")
    parser.add_argument("--update-blocks", type=int, default=2_000_000)
    parser.add_argument("--update-members", type=int, default=16)
    parser.add_argument("--batch-events", type=int, default=128, help="events per apply call")
    parser.add_argument("--memory-blocks", type=int, default=1_000_000)
    parser.add_argument("--memory-members", type=int, default=16)
    parser.add_argument(
        "--memory-copies",
        type=float,
        default=0.05,
        help="share of entries also measured with a second copy (a second BlockStored)",
    )
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="lookup timer")
    args = parser.parse_args(argv)
    global CLOCK
    CLOCK = time.perf_counter_ns if args.clock == "wall" else time.thread_time_ns
    if args.quick:
        args.background, args.lookups = 50_000, 2_000
        args.update_blocks, args.memory_blocks = 100_000, 100_000
    only = set(args.only or ["lookup", "updates", "memory"])
    load = ", load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print(
        f"numpy {np.__version__}, {os.cpu_count()} CPUs{load}, lookups timed by {args.clock} clock"
    )
    if "lookup" in only:
        bench_lookup(args)
    if "updates" in only:
        bench_updates(args)
    if "memory" in only:
        bench_memory(args)


if __name__ == "__main__":
    main()

"""Runs vLLM 0.33's own ``BlockPool`` through a seeded request mix and prints each step.

Run by the interpreter of a venv holding vLLM (``KVTEST_VLLM_PYTHON``), never imported
by kvindex: ``tests/test_sim_pool_vllm.py`` starts it and replays every step on the
simulator's pool (``bench/sim/pool.py``), which must choose the same blocks, publish the
same events and hold the same hashes. No model and no GPU: the pool is driven the way
the simulated pod drives its own (longest cached prefix capped at all tokens but the
last, touch, allocate, cache the full blocks; free in reverse order), in a pool small
enough that most admissions evict, with shared prefixes, block-aligned prompts and
one-block prompts sent again (copies stored from the chain's root).

Output, one JSON object per line: ``{"op": "admit", "rid", "keys", "tokens", "hit",
"new", "full", "blocks", "events", "cached"}`` or ``{"op": "free", "rid", "events",
"cached"}``. ``keys`` are the prompt's full-block hashes as published (uint64),
``blocks`` the block ids vLLM gave the request (its null block is id 0, so the
simulator's ids are one less), ``events`` the step's events as plain lists and
``cached`` the uint64 hashes in ``cached_block_hash_to_block`` afterwards.

    python tests/vllm_pool_driver.py [--seed 1] [--steps 400] [--blocks 12]
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

BLOCK = 4
MASK = 2**64 - 1


def u64(block_hash: int | bytes) -> int:
    if isinstance(block_hash, int):
        return block_hash & MASK
    return int.from_bytes(block_hash, "big") & MASK


def plain(event: object) -> list[object]:
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return [
            "stored",
            [u64(h) for h in event.block_hashes],
            None if parent is None else u64(parent),
            list(event.token_ids),
            event.block_size,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["removed", [u64(h) for h in event.block_hashes], event.medium]
    return [type(event).__name__]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--blocks", type=int, default=12, help="usable blocks")
    args = parser.parse_args()
    init_none_hash(sha256)
    rng = random.Random(args.seed)
    hasher = get_request_block_hasher(BLOCK, sha256)
    # One more block than the simulator's pool: vLLM keeps block 0 as its null block.
    pool = BlockPool(args.blocks + 1, True, BLOCK, enable_kv_cache_events=True)
    prefixes = [list(range(1000 * i, 1000 * i + BLOCK * (2 + i % 2))) for i in range(1, 4)]
    one_block = list(range(9000, 9000 + BLOCK))
    running: dict[int, list] = {}
    out = sys.stdout

    def cached() -> list[int]:
        keys = pool.cached_block_hash_to_block._cache
        return sorted(u64(maybe_convert_block_hash(get_block_hash(key))) for key in keys)

    def free(rid: int) -> None:
        pool.free_blocks(reversed(running.pop(rid)))
        line = {"op": "free", "rid": rid, "events": [plain(e) for e in pool.take_events()]}
        out.write(json.dumps({**line, "cached": cached()}) + "\n")

    for rid in range(args.steps):
        if running and rng.random() < 0.4:
            free(rng.choice(list(running)))
            continue
        roll = rng.random()
        if roll < 0.15:
            prompt = list(one_block)  # sent again: cannot hit, stores from the root
        else:
            prompt = list(rng.choice(prefixes))
            if roll < 0.6:
                extra = BLOCK * rng.randint(1, 2) if rng.random() < 0.5 else rng.randint(1, 9)
                prompt += [rng.randrange(30_000) for _ in range(extra)]
        request = Request(
            f"r{rid}", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher
        )
        keys = request.block_hashes
        limit = min((len(prompt) - 1) // BLOCK, len(keys))
        hit: list = []
        for block_hash in keys[:limit]:
            found = pool.get_cached_block(block_hash, [0])
            if found is None:
                break
            hit.append(found[0])
        new = -(-len(prompt) // BLOCK) - len(hit)
        while new + sum(1 for b in hit if b.ref_cnt == 0) > pool.get_num_free_blocks():
            free(next(iter(running)))  # the oldest request makes room
        pool.touch(hit)
        blocks = hit + pool.get_new_blocks(new)
        full = len(prompt) // BLOCK
        pool.cache_full_blocks(request, blocks, len(hit), full, BLOCK, 0)
        running[rid] = blocks
        line = {
            "op": "admit",
            "rid": rid,
            "keys": [u64(maybe_convert_block_hash(h)) for h in keys],
            "tokens": prompt,
            "hit": len(hit),
            "new": new,
            "full": full,
            "blocks": [b.block_id for b in blocks],
            "events": [plain(e) for e in pool.take_events()],
        }
        out.write(json.dumps({**line, "cached": cached()}) + "\n")


if __name__ == "__main__":
    main()

"""Drive vLLM's own KVCacheManager with a hybrid (full attention + sliding window) KV
layout and record what it publishes and what it would hit.

Runs under an interpreter that has vLLM (CPU torch, no model, no GPU):
``python tests/hybrid_vllm_driver.py SEED STEPS CONFIG...``. It does not import kvindex.
It prints one JSON document, per config: per step, the KV-event batch vLLM's ``KVCacheManager``
published (msgpack of vLLM's own ``KVEventBatch``, base64) and probes: token lists with
the hit vLLM computes for them after that step, both as ``get_computed_blocks`` (capped
at ``len - 1`` tokens) and as the coordinator's uncapped ``find_longest_cache_hit``,
and vLLM's prefix-cache map per KV group after that step.

The workload keeps the block pool small, so blocks are evicted constantly: shared system
prompts, multi-turn continuations, identical resends, a few decode steps per request,
several requests running at once.
"""

from __future__ import annotations

import base64
import json
import math
import random
import sys
import time

import msgspec
import torch
from vllm.distributed.kv_events import KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

HASH_BLOCK = 16


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


def window(block_size: int, size: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=size
    )


#: name -> (group specs, pool blocks)
CONFIGS = {
    # Gemma-like: one full-attention group, one sliding-window group (the "simple hybrid").
    "full+window": ([full(16), window(16, 48)], 40),
    # Two window groups with one spec: looked up together (both must hold a block).
    "full+window+window": ([full(16), window(16, 40), window(16, 40)], 60),
    # Three spec groups: the coordinator iterates to a fixed point.
    "full+window+wide": ([full(16), window(16, 33), window(16, 80)], 60),
    # Groups with different block sizes: hits align to the LCM (32).
    "full16+window32": ([full(16), window(32, 64)], 40),
    # Only a sliding window: vLLM's unitary coordinator.
    "window": ([window(16, 40)], 24),
}


def build(name: str) -> tuple[KVCacheManager, int]:
    specs, blocks = CONFIGS[name]
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    sizes = [s.block_size for s in specs]
    scheduler = math.lcm(*sizes)
    hash_block = math.gcd(*sizes)
    manager = KVCacheManager(
        config,
        max_model_len=4096,
        scheduler_block_size=scheduler,
        hash_block_size=hash_block,
        enable_caching=True,
        enable_kv_cache_events=True,
    )
    return manager, hash_block


def cached_by_group(manager: KVCacheManager) -> dict[str, list[int]]:
    """vLLM's prefix-cache map, per KV group: the published (int) hashes it holds."""
    found: dict[str, set[int]] = {}
    for key, blocks in manager.block_pool.cached_block_hash_to_block._cache.items():
        if blocks:
            group = int.from_bytes(key[-4:], "big")
            found.setdefault(str(group), set()).add(int.from_bytes(key[:-4], "big") % 2**64)
    return {group: sorted(hashes) for group, hashes in found.items()}


def main() -> None:
    seed, steps = int(sys.argv[1]), int(sys.argv[2])
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    out = {}
    for k, name in enumerate(sys.argv[3:]):
        out[name] = record(name, seed + k, steps, hash_fn)
    json.dump(out, sys.stdout)


def record(name: str, seed: int, steps: int, hash_fn: object) -> dict:
    rng = random.Random(seed)
    manager, hash_block = build(name)
    hasher = get_request_block_hasher(hash_block, hash_fn)
    encoder = msgspec.msgpack.Encoder()
    systems = [[rng.randrange(1, 30000) for _ in range(rng.choice([16, 40, 64]))] for _ in range(3)]
    history: list[list[int]] = []
    running: list[Request] = []
    out = []
    counter = 0

    def new_request(tokens: list[int]) -> Request:
        nonlocal counter
        counter += 1
        return Request(
            f"r{counter}", tokens, SamplingParams(max_tokens=64), None, block_hasher=hasher
        )

    def run(tokens: list[int]) -> None:
        request = new_request(tokens)
        for _attempt in range(2):
            blocks, hit = manager.get_computed_blocks(request)[:2]
            got = manager.allocate_slots(
                request, len(tokens) - hit, num_new_computed_tokens=hit, new_computed_blocks=blocks
            )
            if got is not None:
                break
            while running:  # pool exhausted: finish the running requests, then retry
                manager.free(running.pop(0))
        else:
            return
        request.num_computed_tokens = len(tokens)
        for _ in range(rng.randrange(0, 20)):  # decode a little
            request.append_output_token_ids(rng.randrange(1, 30000))
            if manager.allocate_slots(request, 1) is None:
                break
            request.num_computed_tokens += 1
        history.append(list(request.all_token_ids))
        running.append(request)
        while len(running) > rng.choice([0, 1, 2, 3]):
            manager.free(running.pop(rng.randrange(len(running))))

    for _ in range(steps):
        roll = rng.random()
        if history and roll < 0.35:  # next turn of a chat
            base = rng.choice(history[-6:])
            tokens = base + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 60))]
        elif history and roll < 0.45:  # identical resend
            tokens = list(rng.choice(history[-6:]))
        elif roll < 0.6:  # a block-aligned canned prompt
            tokens = list(rng.choice(systems)) + [7] * 32
        else:
            tokens = list(rng.choice(systems)) + [
                rng.randrange(1, 30000) for _ in range(rng.randrange(1, 150))
            ]
        run(tokens[:1500])
        events = manager.take_events()
        payload = encoder.encode(KVEventBatch(ts=time.time(), events=events))
        probes = []
        candidates = history[-8:] + [h[: rng.randrange(1, len(h) + 1)] for h in history[-8:]]
        candidates += [[*h, rng.randrange(1, 30000)] for h in history[-4:]]
        for tokens in candidates:
            probe = new_request(tokens)
            capped = manager.get_computed_blocks(probe)[1]
            uncapped = manager.coordinator.find_longest_cache_hit(probe.block_hashes, len(tokens))[
                1
            ]
            probes.append({"tokens": tokens, "capped": capped, "uncapped": uncapped})
        out.append(
            {
                "payload": base64.b64encode(payload).decode(),
                "probes": probes,
                "cached": cached_by_group(manager),
            }
        )
    return {"hash_block_size": hash_block, "steps": out}


if __name__ == "__main__":
    main()

"""Runs real vLLM KVCacheManagers and prints their KV events with the truth after each step.

Run by the interpreter of a venv holding vLLM (``KVTEST_VLLM_PYTHON``, default
``/tmp/vv/bin/python``), never imported by kvindex: ``tests/test_vllm_copies.py``
starts it and replays its output into the index. No model and no GPU: only the
engine core's ``KVCacheManager`` (prefix caching and KV events on, a small block pool
so eviction is constant) driven by a few-line scheduler, with requests sent in both
``kv_cache_report_mode`` values.

Output, one JSON object per line: ``{"phase", "payload", "truth"}``; ``payload`` is the
step's ``KVEventBatch`` msgpack-encoded exactly as vLLM's ``ZmqEventPublisher`` does
(base64), ``truth`` the uint64 hashes of group 0 in ``cached_block_hash_to_block``
after the step (what vLLM itself would hit).

    python tests/vllm_copies_driver.py [--seed 1] [--rounds 400]
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import sys
import time

import msgspec
import torch
from vllm.distributed.kv_events import KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

BLOCK = 16
MASK = 2**64 - 1


class Engine:
    """One engine's KV-cache manager and a minimal scheduler: admit (prefix hit, then
    allocate and compute the whole prompt), decode a token, finish."""

    def __init__(self, num_blocks: int) -> None:
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=4096,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.running: dict[str, Request] = {}
        self.next_id = 0
        self.encode = msgspec.msgpack.Encoder().encode  # as vLLM's ZmqEventPublisher

    def request(self, prompt: list[int], mode: str) -> Request:
        self.next_id += 1
        params = SamplingParams(max_tokens=64, extra_args={"kv_cache_report_mode": mode})
        return Request(f"r{self.next_id}", prompt, params, None, block_hasher=self.hasher)

    def admit(self, request: Request) -> bool:
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        new = self.manager.allocate_slots(request, request.num_tokens - hit, hit, blocks)
        if new is None:  # no room: vLLM's scheduler leaves it waiting (it asks again)
            return False
        request.num_computed_tokens = request.num_tokens
        request.status = RequestStatus.RUNNING
        self.running[request.request_id] = request
        return True

    def decode(self, request: Request, token: int) -> None:
        request.append_output_token_ids(token)
        if self.manager.allocate_slots(request, 1) is None:
            self.finish(request)  # out of blocks: stop it (frees its blocks)
            return
        request.num_computed_tokens += 1

    def finish(self, request: Request) -> None:
        self.manager.free(request)
        request.status = RequestStatus.FINISHED_STOPPED
        self.running.pop(request.request_id, None)

    def step(self, phase: str) -> dict[str, object]:
        """The events since the last step, encoded, and the truth now."""
        events = self.manager.take_events()
        payload = self.encode(KVEventBatch(ts=time.time(), events=events))
        cached = self.manager.block_pool.cached_block_hash_to_block._cache
        truth = sorted(
            _as_u64(maybe_convert_block_hash(get_block_hash(key)))
            for key in cached
            if get_group_id(key) == 0
        )
        return {"phase": phase, "payload": base64.b64encode(payload).decode(), "truth": truth}


def _as_u64(block_hash: int | bytes) -> int:
    if isinstance(block_hash, int):
        return block_hash & MASK
    return int.from_bytes(block_hash, "big") & MASK


def minimal_case(out: list[dict[str, object]]) -> None:
    """The issue's case: A computes a 48-token prompt; B sends it again and stays
    running (its last block is recomputed into a second copy); C evicts A's copy."""
    engine = Engine(num_blocks=8)
    prompt = list(range(100, 148))
    a = engine.request(prompt, "incremental")
    engine.admit(a)
    engine.finish(a)
    out.append(engine.step("minimal"))
    b = engine.request(prompt, "incremental")
    engine.admit(b)
    out.append(engine.step("minimal"))
    c = engine.request(list(range(5000, 5000 + 16 * 4)), "incremental")  # evicts A's copy
    engine.admit(c)
    out.append(engine.step("minimal"))


def workload(out: list[dict[str, object]], seed: int, rounds: int, modes: list[str]) -> None:
    """Multi-turn chats over a few shared, often block-aligned prompts, in a pool small
    enough that every round evicts; requests pick their report mode from ``modes``."""
    rng = random.Random(seed)
    engine = Engine(num_blocks=24)
    system = [list(range(7000 + 64 * i, 7000 + 64 * i + 32)) for i in range(3)]  # 2 blocks
    phase = "+".join(modes)
    for _ in range(rounds):
        roll = rng.random()
        if engine.running and roll < 0.35:
            request = rng.choice(list(engine.running.values()))
            for _ in range(rng.randint(1, 20)):
                if request.request_id not in engine.running:
                    break
                engine.decode(request, rng.randrange(30_000))
        elif engine.running and roll < 0.55:
            engine.finish(rng.choice(list(engine.running.values())))
        else:
            prompt = list(rng.choice(system))
            if rng.random() < 0.7:  # a user turn: ends on a block boundary half the time
                extra = BLOCK * rng.randint(1, 3) if rng.random() < 0.5 else rng.randint(1, 40)
                prompt += [rng.randrange(30_000) for _ in range(extra)]
            elif rng.random() < 0.5:
                prompt += list(range(9000, 9000 + BLOCK))  # one canned, aligned turn
            if len(prompt) <= BLOCK:
                continue
            request = engine.request(prompt, rng.choice(modes))
            for _ in range(3):  # a refused request asks again, as vLLM's scheduler does
                if engine.admit(request):
                    break
                if engine.running:
                    engine.finish(rng.choice(list(engine.running.values())))
        out.append(engine.step(phase))


def single_block_prompts(out: list[dict[str, object]]) -> None:
    """A prompt of exactly one block, sent twice: the second request cannot hit (vLLM
    recomputes the last token) and stores a second copy from the chain's root: counted
    under report mode ``incremental``, where no announcement can come."""
    engine = Engine(num_blocks=6)
    prompt = list(range(300, 300 + BLOCK))
    first = engine.request(prompt, "incremental")
    engine.admit(first)
    second = engine.request(prompt, "incremental")
    engine.admit(second)
    out.append(engine.step("one-block"))
    engine.finish(first)
    filler = engine.request(list(range(8000, 8000 + BLOCK * 4)), "incremental")
    engine.admit(filler)
    out.append(engine.step("one-block"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    init_none_hash(sha256)
    out: list[dict[str, object]] = []
    minimal_case(out)
    workload(out, args.seed, args.rounds, ["incremental"])
    workload(out, args.seed + 1, args.rounds, ["incremental", "full"])
    workload(out, args.seed + 2, args.rounds, ["full"])
    single_block_prompts(out)
    for line in out:
        sys.stdout.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()

"""Block hashing of an 8,192-token prompt: pure Python, memo, compiled, and the floors.

``/score`` with ``token_ids`` hashes every full block of the prompt as vLLM does
(indexer/keys.py ``BlockHasher``): 512 blocks of 16 tokens. Printed per path, for fresh
random tokens every round (what a new prompt costs; a list of new ints, as msgspec
decodes them): ns per block and µs per 512-block chain, as the median over the rounds
of the wall time and of this thread's CPU time (the CPU figure moves less on a shared
machine), and the best round's wall time (what a quiet core gets). The cases run
interleaved, in a rotating order, so load hits them alike.

- ``pure, cold``: pickle + hashlib per block, every block a memo miss (and insert);
- ``pure, memo warm``: the same prompt again, every block a memo hit (a tuple build and
  a dict lookup per block): what a repeated prompt costs on the pure path;
- ``compiled``: indexer/_chain.c (serialisation written in C, SHA-256 from OpenSSL);
  from a list of ints, and from the ``array('I')`` a binary ``/score`` body gives;
- floors: ``hashlib.sha256`` over each block's serialised bytes alone (bytes built
  beforehand, one Python call per block); the SHA-256 compressions alone (one hashlib
  call over as many 64-byte blocks as the chain's padded inputs take: the cost no
  implementation of this chain avoids, since each block's input holds the previous
  digest); and ``pickle.dumps`` alone (tuples built beforehand).

Also the other algorithms (sha256_cbor; xxhash, xxhash_cbor with a seed), LoRA +
cache-salt extras, one lookahead token and a prompt with eight images
(``mm_features``: the blocks they overlap are hashed by the pure path even on the
compiled one), pure cold against compiled. Target (issue
13): compiled cold chain <= 60 µs; printed PASS/FAIL from the CPU-time median.

Run: ``python bench/bench_hash.py [--rounds 200] [--vocab 150000]``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import statistics
import time
from array import array
from collections.abc import Callable

import numpy as np

from kvindex.indexer import compiled
from kvindex.indexer.keys import (
    BlockExtras,
    BlockHasher,
    ExtraKeyStyle,
    HashAlgo,
    HashConfig,
    MmFeature,
)

TOKENS = 8192
BLOCK_SIZE = 16
BLOCKS = TOKENS // BLOCK_SIZE
TARGET_US = 60.0
LORA_SALT = BlockExtras("my-lora", "/adapters/my-lora", "tenant-a")
# Eight 576-token images (a LLaVA-style placeholder count) spread over the prompt.
IMAGES = BlockExtras(
    mm_features=tuple(MmFeature(f"{i:064x}", 100 + i * 1000, 576) for i in range(8))
)

Case = Callable[[list[int]], Callable[[], object]]  # fresh tokens -> the timed call


def with_chain(core: object, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with compiled.chain set to ``core`` (None: the pure path)."""

    def run() -> object:
        saved, compiled.chain = compiled.chain, core
        try:
            return fn()
        finally:
            compiled.chain = saved

    return run


def cases(core: object) -> dict[str, Case]:
    sha = BlockHasher(HashConfig())
    out: dict[str, Case] = {}

    def pure_cold(tokens: list[int]) -> Callable[[], object]:
        return with_chain(None, lambda: sha.keys(tokens))

    def pure_warm(tokens: list[int]) -> Callable[[], object]:
        with_chain(None, lambda: sha.keys(tokens))()  # fills the memo, untimed
        return with_chain(None, lambda: sha.keys(tokens))

    out["sha256  pure, cold"] = pure_cold
    out["sha256  pure, memo warm"] = pure_warm
    if core is not None:
        out["sha256  compiled, list"] = lambda t: with_chain(core, lambda: sha.keys(t))
        out["sha256  compiled, array('I')"] = lambda t: (
            lambda a: with_chain(core, lambda: sha.keys(a))
        )(array("I", t))

    def sha_floor(tokens: list[int]) -> Callable[[], object]:
        data = [pickle.dumps(x, protocol=5) for x in block_inputs(sha, tokens)]

        def run() -> None:
            for d in data:
                hashlib.sha256(d).digest()

        return run

    def compression_floor(tokens: list[int]) -> Callable[[], object]:
        data = [pickle.dumps(x, protocol=5) for x in block_inputs(sha, tokens)]
        blocks = sum((len(d) + 9 + 63) // 64 for d in data)  # with SHA-256's padding
        whole = bytes(64 * blocks)
        return lambda: hashlib.sha256(whole).digest()

    def pickle_floor(tokens: list[int]) -> Callable[[], object]:
        inputs = block_inputs(sha, tokens)
        return lambda: [pickle.dumps(x, protocol=5) for x in inputs]

    out["floor: hashlib.sha256 of the bytes"] = sha_floor
    out["floor: SHA-256 compressions alone"] = compression_floor
    out["floor: pickle.dumps alone"] = pickle_floor
    others = [
        ("sha256_cbor", HashConfig(algo=HashAlgo.SHA256_CBOR), BlockExtras()),
        ("xxhash", HashConfig(algo=HashAlgo.XXHASH, seed="42"), BlockExtras()),
        ("xxhash_cbor", HashConfig(algo=HashAlgo.XXHASH_CBOR, seed="42"), BlockExtras()),
        ("sha256 lora+salt", HashConfig(extra_key_style=ExtraKeyStyle.TAGGED), LORA_SALT),
        ("sha256 lookahead 1", HashConfig(lookahead_tokens=1), BlockExtras()),
    ]
    others.append(("sha256 8 images", HashConfig(), IMAGES))
    for name, config, extras in others:
        hasher = BlockHasher(config, memo_size=0)
        paths = [("pure", None)] + ([("compiled", core)] if core is not None else [])
        for path, chain in paths:
            out[f"{name}  {path}"] = lambda t, h=hasher, e=extras, c=chain: with_chain(
                c, lambda: h.keys(t, e)
            )
    return out


def block_inputs(hasher: BlockHasher, tokens: list[int]) -> list[tuple]:
    """Each block's (parent digest, tokens, None), as the chain hashes them."""
    digests = with_chain(None, lambda: BlockHasher(hasher.config, memo_size=0).digests(tokens))()
    parents = [hasher.none_hash, *digests[:-1]]
    return [
        (parents[i], tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]), None)
        for i in range(BLOCKS)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="fresh prompts per case")
    parser.add_argument("--vocab", type=int, default=150_000, help="token ids in 1..vocab-1")
    args = parser.parse_args()
    core = compiled.chain
    rng = np.random.default_rng(7)
    table = cases(core)
    wall: dict[str, list[float]] = {name: [] for name in table}
    cpu: dict[str, list[float]] = {name: [] for name in table}
    names = list(table)
    for round_ in range(args.rounds + 5):  # the first 5 rounds warm up
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            tokens = rng.integers(1, args.vocab, TOKENS).tolist()
            call = table[name](tokens)
            c0, w0 = time.thread_time(), time.perf_counter()
            call()
            w1, c1 = time.perf_counter(), time.thread_time()
            if round_ >= 5:
                wall[name].append(w1 - w0)
                cpu[name].append(c1 - c0)
    print(
        f"{TOKENS} tokens (1..{args.vocab - 1}), block size {BLOCK_SIZE}: {BLOCKS} blocks; "
        f"{args.rounds} fresh prompts per case; hashing: {compiled.hashing()}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'case':<38}{'ns/block':>10}{'µs/chain':>10}{'CPU ns/block':>14}{'CPU µs':>9}"
        f"{'best µs':>9}"
    )
    for name in names:
        w, c, best = statistics.median(wall[name]), statistics.median(cpu[name]), min(wall[name])
        print(f"{name:<38}{w / BLOCKS * 1e9:>10,.0f}{w * 1e6:>10,.1f}"
              f"{c / BLOCKS * 1e9:>14,.0f}{c * 1e6:>9,.1f}{best * 1e6:>9,.1f}")  # fmt: skip
    if core is None:
        print("FAIL: compiled chain <= 60 µs: kvindex.indexer._chain is not built")
        return
    got = statistics.median(cpu["sha256  compiled, list"]) * 1e6
    verdict = "PASS" if got <= TARGET_US else "FAIL"
    print(f"{verdict}: compiled cold chain {got:.1f} µs CPU (target <= {TARGET_US:.0f} µs)")


if __name__ == "__main__":
    main()

"""Block keys against vLLM's own hashing: compiled and pure paths, every algorithm.

``tests/vllm_side/block_hashes.py`` runs in an interpreter that has vLLM 0.33
(``KVTEST_VLLM_PYTHON``, else the checkout's ``.venv-vllm``) and hashes each
prompt as the engine core does: a ``Request`` with its LoRA adapter, cache salt and
multimodal items (``MultiModalFeatureSpec``s: identifier and placeholder range),
through ``get_request_block_hasher`` (with lookahead tokens where asked) over
``vllm.utils.hashing``, NONE_HASH from the case's PYTHONHASHSEED. kvindex's keys and
digests for the same prompts must be those, on both paths. Without such an
interpreter the test skips, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import xxhash

from kvindex.indexer import compiled
from kvindex.indexer.keys import BlockExtras, BlockHasher, HashAlgo, HashConfig, MmFeature
from tests.support.vllm import vllm_python

SCRIPT = Path(__file__).parent / "vllm_side" / "block_hashes.py"
EDGES = [0, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 + 5, 2**40, 2**63, 2**70, -1, -(2**31)]
ALGOS = [("sha256", None), ("sha256", "42"), ("sha256_cbor", None), ("xxhash", "42")]
ALGOS += [("xxhash_cbor", "7")]
EXTRAS = {
    "none": (None, None),
    "lora": (("my-lora", "/adapters/my-lora"), None),
    "salt": (None, "tenant-a"),
    "lora+salt": (("my-lora", "/adapters/my-lora"), "tenant-a"),
}


def cases() -> list[dict]:
    rng = random.Random(13)
    out = []
    for algo, seed in ALGOS:
        for extras, (lora, salt) in EXTRAS.items():
            for lookahead in (0, 1, 3):
                size = rng.choice([16, 16, 1, 5, 32])
                length = rng.choice([8192, 100, size * 3 + lookahead, size - 1])
                tokens = [rng.randrange(150_000) for _ in range(max(1, length))]
                out.append(
                    {
                        "name": f"{algo}/{seed}/{extras}/lookahead {lookahead}/{size}x{length}",
                        "algo": algo,
                        "seed": seed,
                        "block_size": size,
                        "lookahead": lookahead,
                        "tokens": tokens,
                        "lora": lora,
                        "cache_salt": salt,
                    }
                )
        out.append(
            {
                "name": f"{algo}/{seed}/token values at opcode edges",
                "algo": algo,
                "seed": seed,
                "block_size": 4,
                "lookahead": 0,
                "tokens": EDGES * 3,
                "lora": None,
                "cache_salt": "s",
            }
        )
    out += mm_cases(rng)
    return out


def mm_cases(rng: random.Random) -> list[dict]:
    """Prompts with images: items inside one block, across many, on block edges, one
    right after another, the same identifier twice, and with LoRA, salt and lookahead."""
    out = []
    for number in range(24):
        size = rng.choice([16, 16, 4, 5, 1])
        length = rng.randrange(size * 2, size * 40)
        items = []
        position = rng.randrange(0, size * 3)
        while position < length:
            span = rng.choice([1, size - 1 or 1, size, size + 1, rng.randrange(1, size * 6)])
            if position + span > length:
                break
            identifier = rng.choice(["img-a", "img-b", f"sha-{rng.randrange(1 << 60):x}"])
            items.append([identifier, position, span])
            position += span + rng.choice([0, 0, 1, size, rng.randrange(0, size * 4)])
        lora, salt = list(EXTRAS.values())[number % len(EXTRAS)]
        out.append(
            {
                "name": f"sha256/mm {number}/{size}x{length}/{len(items)} items",
                "algo": rng.choice(["sha256", "sha256_cbor"]),
                "seed": None,
                "block_size": size,
                "lookahead": rng.choice([0, 0, 1, 3]),
                "tokens": [rng.randrange(150_000) for _ in range(length)],
                "lora": lora,
                "cache_salt": salt,
                "mm": items,
            }
        )
    return out


@pytest.fixture(scope="module")
def engine_hashes(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    python = vllm_python()
    if python is None or not Path(python).exists():
        message = "no vLLM interpreter: set KVTEST_VLLM_PYTHON to a Python with vllm 0.33"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    work = tmp_path_factory.mktemp("vllm_hashes")
    request = work / "cases.json"
    chosen = cases()
    request.write_text(json.dumps({"cases": chosen}), encoding="utf-8")
    # vLLM's xxhash variants need the xxhash module; a vLLM venv without it gets this
    # interpreter's (the same CPython version, the same wheel kvindex hashes with).
    extra = work / "xxhash_path"
    extra.mkdir()
    (extra / "xxhash").symlink_to(Path(xxhash.__file__).parent)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env["PYTHONPATH"] = str(extra)
    done = subprocess.run(
        [python, str(SCRIPT), str(request)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    if done.returncode != 0 and "No module named 'vllm" in done.stderr:
        pytest.skip(f"{python} cannot import vLLM: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return chosen, json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["compiled", "pure"])
def test_keys_equal_vllms_own(path: str, engine_hashes: tuple[list[dict], list[dict]]) -> None:
    if path == "compiled" and compiled.chain is None:
        pytest.skip("kvindex.indexer._chain was not built")
    chosen, results = engine_hashes
    saved = compiled.chain
    if path == "pure":
        compiled.chain = None
    try:
        checked = 0
        for case, result in zip(chosen, results, strict=True):
            config = HashConfig(
                algo=HashAlgo(case["algo"]),
                block_size=case["block_size"],
                seed=case["seed"],
                lookahead_tokens=case["lookahead"],
            )
            lora_name, lora_path = case["lora"] or (None, None)
            mm = tuple(MmFeature(*item) for item in case.get("mm", []))
            extras = BlockExtras(lora_name, lora_path, case["cache_salt"], mm)
            hasher = BlockHasher(config)
            assert hasher.keys(case["tokens"], extras) == result["keys"], case["name"]
            digests = [d.hex() for d in hasher.digests(case["tokens"], extras)]
            assert digests == result["digests"], case["name"]
            checked += len(result["keys"])
        assert checked > 10_000  # the prompts were long enough to mean something
    finally:
        compiled.chain = saved

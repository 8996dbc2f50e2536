"""Runs under a Python with vLLM installed: vLLM's own block hashes of the prompts in a
JSON file, written as JSON for tests/test_keys_vllm.py to compare with kvindex's.

Each prompt becomes a vLLM ``Request`` (with its LoRA adapter and cache salt) hashed by
the block hasher the engine core builds (``get_request_block_hasher`` over
``vllm.utils.hashing``'s functions, NONE_HASH from ``init_none_hash`` with the case's
PYTHONHASHSEED), so extra keys and lookahead tokens are vLLM's own.

Input: {"cases": [{"algo", "seed", "block_size", "lookahead", "tokens", "lora":
[name, path] | null, "cache_salt", "mm": [[identifier, offset, length]] (optional)}]}.
Multimodal items become ``MultiModalFeatureSpec``s without data, as the engine core
holds an item whose processed data is cached: only identifier and position are hashed.
Output: [{"keys": [uint64], "digests": [hex]}].
"""

import json
import os
import sys

from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

with open(sys.argv[1], encoding="utf-8") as request_file:
    cases = json.load(request_file)["cases"]
out = []
for number, case in enumerate(cases):
    if case["seed"] is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = case["seed"]
    hash_fn = get_hash_fn_by_name(case["algo"])
    init_none_hash(hash_fn)  # reads PYTHONHASHSEED now
    hasher = get_request_block_hasher(case["block_size"], hash_fn, case["lookahead"])
    lora = LoRARequest(case["lora"][0], 1, case["lora"][1]) if case["lora"] else None
    mm = [
        MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset, length))
        for identifier, offset, length in case.get("mm") or []
    ]
    request = Request(
        f"r{number}",
        case["tokens"],
        SamplingParams(max_tokens=1),
        None,
        mm_features=mm or None,
        lora_request=lora,
        cache_salt=case["cache_salt"],
        block_hasher=hasher,
    )
    digests = [bytes(h) for h in request.block_hashes]
    out.append(
        {
            "keys": [int.from_bytes(d[-8:], "big") for d in digests],
            "digests": [d.hex() for d in digests],
        }
    )
json.dump(out, sys.stdout)

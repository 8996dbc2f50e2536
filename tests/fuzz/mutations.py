"""Structure-aware mutators: a seed input decoded into its tree (msgpack or JSON), a few
nodes changed into values parsers get wrong (integer and float edges, wrong types,
deep nesting, swapped tags and field names, repeated or dropped items), encoded again;
then, sometimes, a few bytes changed the way a broken sender or a hostile one would.

Every choice comes from the ``random.Random`` passed in, so one seed gives one input.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from typing import Any

import msgspec

U64 = 2**64 - 1
INTS = [
    0, 1, -1, 15, 16, 17, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1,
    2**32, 2**53 + 1, 2**63 - 1, 2**63, U64, -(2**31), -(2**63), 4095, 4096,
]  # fmt: skip
FLOATS = [0.0, -0.0, 1.5, 1e30, -1e30, 1e308, math.inf, -math.inf, math.nan, 5e-324]
NAMES = [
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids", "ts", "events", "data_parallel_rank",
    "model", "prompt", "messages", "pods", "cache_salt", "request_id", "max_tokens", "role",
    "add_generation_prompt",
]  # fmt: skip
STRINGS = [
    "", "BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU", "STORAGE",
    "decode", "prefill", "m", "127.0.0.1:8000", "\u00e9\U0001f642", "\x00", "a" * 300,
]  # fmt: skip
BYTES = [b"", bytes(8), b"\xff" * 8, bytes(range(32)), b"\xff" * 33]


def scalar(rng: random.Random, floats: bool = True) -> Any:
    kind = rng.randrange(7 if floats else 6)
    if kind == 0:
        return rng.choice(INTS) + rng.choice([0, 0, 0, 1, -1])
    if kind == 1:
        return rng.choice(STRINGS + NAMES)
    if kind == 2:
        return rng.choice([None, True, False])
    if kind == 3:
        return rng.randrange(-(2**70), 2**70) >> rng.randrange(71)
    if kind == 4:
        return []
    if kind == 5:
        return {}
    return rng.choice(FLOATS)


def _nodes(tree: Any, path: tuple = ()) -> list[tuple]:
    """Paths to every node of a tree of lists and dicts, the root first."""
    out = [path]
    if isinstance(tree, list):
        for i, item in enumerate(tree):
            out += _nodes(item, (*path, i))
    elif isinstance(tree, dict):
        for key, item in tree.items():
            out += _nodes(item, (*path, key))
    return out


def _get(tree: Any, path: tuple) -> Any:
    for step in path:
        tree = tree[step]
    return tree


def _put(tree: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(tree, path[:-1])[path[-1]] = value
    return tree


def mutate_tree(tree: Any, rng: random.Random, floats: bool = True) -> Any:
    """One change somewhere in ``tree`` (changed in place where it can be); the result."""
    path = rng.choice(_nodes(tree))
    node = _get(tree, path)
    how = rng.randrange(9)
    if how == 0:  # a value of another kind
        return _put(tree, path, scalar(rng, floats))
    if how == 1:  # nested deeper: parsers that recurse run out of stack
        depth = rng.choice([2, 16, 40, 200])  # 1,000 deep: the seed corpus has it
        for _ in range(depth):
            node = [node]
        return _put(tree, path, node)
    if how == 2 and isinstance(node, int) and not isinstance(node, bool):
        return _put(tree, path, rng.choice(INTS) + rng.choice([0, 1, -1]))
    if how == 3 and isinstance(node, list) and node:  # drop, repeat or reorder items
        i = rng.randrange(len(node))
        choice = rng.randrange(4)
        if choice == 0:
            del node[i]
        elif choice == 1:
            node.insert(i, node[i])
        elif choice == 2:
            node.extend(node[: rng.randrange(1, 8)] * rng.choice([1, 50]))
        else:
            rng.shuffle(node)
        return tree
    if how == 4 and isinstance(node, dict) and node:  # a field dropped, renamed or added
        key = rng.choice(list(node))
        choice = rng.randrange(3)
        if choice == 0:
            del node[key]
        elif choice == 1:
            node[rng.choice(NAMES)] = node.pop(key)
        else:
            node[rng.choice(NAMES + STRINGS)] = scalar(rng, floats)
        return tree
    if how == 5 and isinstance(node, str):  # a tag or name swapped, or a string damaged
        return _put(tree, path, rng.choice(STRINGS + NAMES + [node[::-1], node + "\x00"]))
    if how == 6 and isinstance(node, dict):  # an event's map as its array, and back
        return _put(tree, path, list(node.values()))
    if how == 7 and isinstance(node, list) and node and isinstance(node[0], str):
        keys = ["type", *rng.sample(NAMES, min(len(node) - 1, len(NAMES)))]
        return _put(tree, path, dict(zip(keys, node, strict=False)))
    if how == 8 and isinstance(node, list | bytes | str):  # an empty one
        return _put(tree, path, type(node)())
    return _put(tree, path, scalar(rng, floats))


#: Bytes that mean something in msgpack: fixarray/fixmap/fixstr, nil, false/true, bin,
#: float, uint/int 8..64, str, array and map 16/32 headers.
MSGPACK_BYTES = bytes.fromhex("9091938081a0abc0c2c3c4cacbcccdcecfd0d3d9dadcdddedfff7f")
JSON_BYTES = b'[]{}",:\\ \t\n\r0123456789-+.eEnulltrue\x00\xa0\xc3'


def mutate_bytes(data: bytes, rng: random.Random, alphabet: bytes, others: list[bytes]) -> bytes:
    """A few byte-level changes: set, insert, delete, truncate, splice from another seed,
    repeat a chunk; new bytes mostly from ``alphabet``."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        how = rng.randrange(7)
        at = rng.randrange(len(out) + 1)
        byte = rng.choice(alphabet) if rng.random() < 0.7 else rng.randrange(256)
        if how == 0 and at < len(out):
            out[at] = byte
        elif how == 1:
            out.insert(at, byte)
        elif how == 2 and at < len(out):
            del out[at : at + rng.choice([1, 1, 2, 8])]
        elif how == 3:
            del out[at:]
        elif how == 4 and others:
            other = rng.choice(others)
            start = rng.randrange(len(other) + 1)
            out[at:at] = other[start : start + rng.randrange(1, 64)]
        elif how == 5 and at < len(out):
            chunk = out[at : at + rng.randrange(1, 16)]
            out[at:at] = chunk * rng.randrange(1, 4)
        elif at < len(out):
            out[at] ^= 1 << rng.randrange(8)
    return bytes(out)


def mutated_msgpack(seeds: list[bytes], rng: random.Random) -> bytes:
    """A seed payload with its msgpack tree changed, then maybe its bytes."""
    data = rng.choice(seeds)
    try:
        tree = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        tree = None
    if tree is not None and rng.random() < 0.8:
        for _ in range(rng.randint(1, 3)):
            tree = mutate_tree(tree, rng)
        try:
            data = msgspec.msgpack.encode(tree)
        except (OverflowError, RecursionError):  # an int past 64 bits, or nested too deep
            tree = None
    if tree is None or rng.random() < 0.4:
        data = mutate_bytes(data, rng, MSGPACK_BYTES, seeds)
    return data


_JSON_STYLES: list[Callable[[Any, random.Random], str | bytes]] = [
    lambda tree, rng: msgspec.json.encode(tree),
    lambda tree, rng: json.dumps(tree),  # NaN and Infinity as bare words
    lambda tree, rng: json.dumps(tree, indent=rng.choice([0, 2, "\t"])),
    lambda tree, rng: json.dumps(tree, separators=(" ,\r\n", " : "), ensure_ascii=False),
]


def mutated_json(seeds: list[bytes], rng: random.Random) -> bytes:
    """A seed body with its JSON tree changed and written in one of several styles,
    then maybe its bytes."""
    data = rng.choice(seeds)
    try:
        tree = json.loads(data)
    except (ValueError, RecursionError):
        tree = None
    if tree is not None and rng.random() < 0.8:
        for _ in range(rng.randint(1, 3)):
            tree = mutate_tree(tree, rng)
        try:
            text = rng.choice(_JSON_STYLES)(tree, rng)
        except (ValueError, RecursionError, TypeError):  # nested past json's limit
            text = data
        data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if tree is None or rng.random() < 0.4:
        data = mutate_bytes(data, rng, JSON_BYTES, seeds)
    return data

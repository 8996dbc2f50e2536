"""Block keys must equal vLLM's own prefix-cache hashes, bit for bit.

The vectors below were computed once with vLLM 0.33.0's own ``vllm/utils/hashing.py``
hash functions (the wheel from PyPI, loaded standalone) chained exactly as its
``hash_block_tokens`` does, for tokens 1..48 and block size 16. The first two are the
reference values docs/correctness.md publishes ("Block keys").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvindex.indexer.keys import (
    BlockExtras,
    BlockHasher,
    ExtraKeyStyle,
    HashAlgo,
    HashConfig,
    KeyConfigError,
    hash_value,
    none_hash,
)

TOKENS = list(range(1, 49))
LORA_SALT_TAGGED = (
    "lora+salt",
    BlockExtras("my-lora", "/adapters/my-lora", "s"),
    ExtraKeyStyle.TAGGED,
)
LORA_SALT_BARE = ("lora+salt", BlockExtras("my-lora", None, "s"), ExtraKeyStyle.BARE)
SALT_TAGGED = ("salt", BlockExtras(None, None, "s"), ExtraKeyStyle.TAGGED)
PLAIN = ("plain", BlockExtras(), ExtraKeyStyle.TAGGED)

# (algo, seed, case, keys) confirmed against vLLM 0.33.0.
VECTORS = [
    ("sha256", None, PLAIN, [1403909460543360175, 1643945449041937783, 17267691262617277681]),
    (
        "sha256",
        None,
        LORA_SALT_TAGGED,
        [765688210021116699, 11225512390786867075, 11538692766110092437],
    ),
    (
        "sha256",
        None,
        LORA_SALT_BARE,
        [2305961319832573177, 6176926327913675104, 15285336189576410735],
    ),
    ("sha256", None, SALT_TAGGED, [6642714154629393795, 9284337328647074606, 2075244033528060958]),
    ("sha256", "42", PLAIN, [4508471921923631364, 13026579715664180657, 13013428365699305829]),
    (
        "sha256",
        "42",
        LORA_SALT_TAGGED,
        [4616824986756048620, 2363637465968129931, 6355992368757218083],
    ),
    ("sha256_cbor", None, PLAIN, [8866452693264111234, 807986237951177663, 10877177626832001922]),
    (
        "sha256_cbor",
        None,
        LORA_SALT_TAGGED,
        [15141760979832474779, 15299495713380158361, 6556096770385827976],
    ),
    (
        "sha256_cbor",
        None,
        LORA_SALT_BARE,
        [12644588451557502807, 12394571607428274826, 11873510081053749473],
    ),
    (
        "sha256_cbor",
        "42",
        SALT_TAGGED,
        [9043789807622431229, 10533565847341231743, 15221628796979312940],
    ),
    ("xxhash", "42", PLAIN, [3721381939863447827, 5535045439232338803, 10799314947390897412]),
    (
        "xxhash",
        "42",
        LORA_SALT_TAGGED,
        [921974157717373676, 6993695533657381230, 222949263680728997],
    ),
    (
        "xxhash",
        "42",
        LORA_SALT_BARE,
        [17465617580884613480, 4708637871903368058, 17394463424238686673],
    ),
    ("xxhash_cbor", "42", PLAIN, [14255326629130133946, 8320077250611386183, 2601926622393216353]),
    (
        "xxhash_cbor",
        "42",
        LORA_SALT_TAGGED,
        [17693456333519504787, 16608367578773951575, 12279666108517969170],
    ),
    (
        "xxhash_cbor",
        "42",
        SALT_TAGGED,
        [1659337966136308279, 3047652844417968843, 11306484814243791176],
    ),
]


@pytest.mark.parametrize(("algo", "seed", "case", "expected"), VECTORS, ids=lambda v: str(v)[:20])
def test_keys_match_vllm(algo: str, seed: str | None, case: tuple, expected: list[int]) -> None:
    _, extras, style = case
    hasher = BlockHasher(HashConfig(algo=HashAlgo(algo), seed=seed, extra_key_style=style))
    assert hasher.keys(TOKENS, extras) == expected


def test_the_documented_reference_values() -> None:
    tokens = list(range(1, 33))
    assert BlockHasher(HashConfig()).keys(tokens) == [1403909460543360175, 1643945449041937783]
    cbor = BlockHasher(HashConfig(algo=HashAlgo.SHA256_CBOR))
    assert cbor.keys(tokens) == [8866452693264111234, 807986237951177663]
    docs = (Path(__file__).resolve().parents[1] / "docs" / "correctness.md").read_text("utf-8")
    assert "| `sha256` | 1403909460543360175 | 1643945449041937783 |" in docs
    assert "| `sha256_cbor` | 8866452693264111234 | 807986237951177663 |" in docs


def test_memo_does_not_change_results() -> None:
    hasher = BlockHasher(HashConfig(), memo_size=1)
    first = hasher.keys(TOKENS)
    for _ in range(3):
        assert hasher.keys(TOKENS) == first
    assert BlockHasher(HashConfig(), memo_size=0).keys(TOKENS) == first


def test_partial_trailing_block_is_not_hashed() -> None:
    hasher = BlockHasher(HashConfig())
    assert hasher.keys(TOKENS[:47]) == hasher.keys(TOKENS[:32])
    assert hasher.keys(TOKENS[:15]) == []


def test_chain_continues_from_a_parent_digest() -> None:
    hasher = BlockHasher(HashConfig())
    digests = hasher.digests(TOKENS)
    tail = hasher.keys(TOKENS[16:], parent=digests[0], first_block_index=1)
    assert tail == hasher.keys(TOKENS)[1:]


def test_salt_changes_only_the_chain_through_block_zero() -> None:
    hasher = BlockHasher(HashConfig())
    plain = hasher.keys(TOKENS)
    salted = hasher.keys(TOKENS, BlockExtras(cache_salt="tenant-a"))
    other = hasher.keys(TOKENS, BlockExtras(cache_salt="tenant-b"))
    assert len(set(plain) | set(salted) | set(other)) == 9  # every block differs (chained)


def test_lookahead_tokens_enter_extra_keys() -> None:
    config = HashConfig(lookahead_tokens=1)
    hasher = BlockHasher(config)
    keys = hasher.keys(TOKENS)
    assert len(keys) == 2  # the last block has no token after it
    expected = hash_value(
        HashAlgo.SHA256, (none_hash(HashAlgo.SHA256, None), tuple(TOKENS[:16]), (None, 17))
    )
    assert keys[0] == int.from_bytes(expected[-8:], "big")


def test_xxhash_without_seed_is_refused_with_advice() -> None:
    with pytest.raises(KeyConfigError, match="PYTHONHASHSEED"):
        BlockHasher(HashConfig(algo=HashAlgo.XXHASH))


def test_tagged_lora_needs_its_path() -> None:
    hasher = BlockHasher(HashConfig())
    with pytest.raises(KeyConfigError, match="path"):
        hasher.keys(TOKENS, BlockExtras(lora_name="my-lora"))


def test_bad_block_size_is_refused() -> None:
    with pytest.raises(KeyConfigError):
        HashConfig(block_size=0)

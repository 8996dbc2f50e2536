"""The compiled hash chain (indexer/_chain.c) against the pure path, byte for byte.

The pure path (pickle / cbor2 + hashlib / xxhash in indexer/keys.py) is the reference:
every key and digest the compiled chain gives must be the pure path's, and every hash
input it writes must be ``pickle.dumps(..., protocol=5)`` or ``cbor2.dumps(...,
canonical=True)`` of the same tuple. Covered: every algorithm, block sizes 1..64 and
ones large enough for the pickler to split frames, token values at each opcode's edge,
negatives and ints past 64 bits (left to the pure path block by block), parents of
every length, LoRA and cache-salt extras in both styles (the same str object twice is
pickled as a memo reference, two equal strings in full), lookahead, short prompts, and
token lists, tuples and integer arrays. ``tests/test_keys_vllm.py`` checks the chain
against vLLM's own code.
"""

from __future__ import annotations

import contextlib
import pickle
from array import array
from collections.abc import Iterator

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.api.version import implementations
from kvindex.indexer import compiled
from kvindex.indexer.keys import (
    _COMPILED,
    NO_EXTRAS,
    BlockExtras,
    BlockHasher,
    ExtraKeyStyle,
    HashAlgo,
    HashConfig,
    MmFeature,
    none_hash,
)
from tests.test_keys import TOKENS, VECTORS

pytestmark = pytest.mark.skipif(
    compiled.chain is None, reason="kvindex.indexer._chain was not built (no compiler/OpenSSL)"
)

SEED = {HashAlgo.SHA256: None, HashAlgo.SHA256_CBOR: None}  # xxhash needs a seed
EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5]
EDGES += [2**63 - 1, 2**63, 2**64 - 1, -1, -24, -25, -256, -257, -(2**31), -(2**31) - 1]
EDGES += [-(2**63), -(2**40), 2**40, 127, 128, 32767, 32768, -128, -129, -32768, -32769]
BEYOND_64_BITS = [2**64, -(2**63) - 1, 2**100, -(2**100)]


@contextlib.contextmanager
def pure_hashing() -> Iterator[None]:
    saved, compiled.chain = compiled.chain, None
    try:
        yield
    finally:
        compiled.chain = saved


def config(algo: HashAlgo, **kw: object) -> HashConfig:
    return HashConfig(algo=algo, seed=SEED.get(algo, "42"), **kw)  # type: ignore[arg-type]


def both(cfg: HashConfig, tokens, extras=NO_EXTRAS, parent=None, first=0):
    """(compiled, pure) keys and digests of the same chain."""
    hasher = BlockHasher(cfg, memo_size=0)
    got = (
        hasher.keys(tokens, extras, parent, first),
        hasher.digests(tokens, extras, parent, first),
    )
    with pure_hashing():
        reference = BlockHasher(cfg)
        want = (
            reference.keys(tokens, extras, parent, first),
            reference.digests(tokens, extras, parent, first),
        )
    return got, want


def reference_bytes(serialisation: int, value: object) -> bytes:
    return (
        pickle.dumps(value, protocol=5)
        if serialisation == 0
        else cbor2.dumps(value, canonical=True)
    )


def written(serialisation: int, tokens, size: int, look: int, start: int, parent: bytes, extra):
    """(what _chain writes, what pickle / cbor2 write) for one block; what it writes for
    the blocks after a chain's first (the extra keys' pickle copied in) must be the same
    where the extra keys do not hold the parent object itself."""
    serialise = compiled.chain.serialise
    got = serialise(serialisation, tokens, size, look, start, parent, extra, False)
    if not holds(extra, parent):
        assert serialise(serialisation, tokens, size, look, start, parent, extra, True) == got
    block = tuple(tokens[start : start + size])
    if look:
        extra = (extra, *tokens[start + size : start + size + look])
    return got, reference_bytes(serialisation, (parent, block, extra))


def holds(value: object, target: object) -> bool:
    if value is target:
        return True
    return isinstance(value, tuple) and any(holds(item, target) for item in value)


@pytest.mark.parametrize("path", ["compiled", "pure"])
@pytest.mark.parametrize(("algo", "seed", "case", "expected"), VECTORS, ids=lambda v: str(v)[:20])
def test_vllm_vectors_on_both_paths(path, algo, seed, case, expected) -> None:
    _, extras, style = case
    cfg = HashConfig(algo=HashAlgo(algo), seed=seed, extra_key_style=style)
    with pure_hashing() if path == "pure" else contextlib.nullcontext():
        assert BlockHasher(cfg).keys(TOKENS, extras) == expected


@pytest.mark.parametrize("algo", list(HashAlgo))
@pytest.mark.parametrize("size", [*range(1, 18), 31, 32, 33, 63, 64])
def test_every_block_size(algo: HashAlgo, size: int) -> None:
    tokens = [(i * 7919 + size) % 150_000 for i in range(size * 5 + 3)]
    got, want = both(config(algo, block_size=size), tokens)
    assert got == want
    assert len(got[0]) == len(tokens) // size


@pytest.mark.parametrize("serialisation", [0, 1])
@pytest.mark.parametrize("value", EDGES)
def test_token_values_at_every_opcode_edge(serialisation: int, value: int) -> None:
    for size in (1, 3, 4, 16):
        tokens = [value, 5, value, value, 7, 300] * 4
        got, want = written(serialisation, tokens, size, 0, 2, bytes(32), None)
        assert got == want, (value, size)


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_edge_tokens_through_the_chain(algo: HashAlgo) -> None:
    tokens = EDGES * 3
    got, want = both(config(algo), tokens)
    assert got == want and len(got[0]) == len(tokens) // 16


@pytest.mark.parametrize("algo", list(HashAlgo))
@pytest.mark.parametrize("odd", [*BEYOND_64_BITS, True, 3.0])
def test_tokens_the_compiled_writer_leaves_to_python(algo: HashAlgo, odd: object) -> None:
    """A token that is not an int in [-2^63, 2^64) sends its block to the pure path; the
    blocks around it stay compiled and the chain is the pure path's."""
    tokens = list(range(100, 164))
    tokens[21] = odd  # block 1 of 4
    cfg = config(algo)
    serialisation, digest = _COMPILED[algo]
    parent = BlockHasher(cfg).none_hash
    keys, _, done, _ = compiled.chain.chain(
        serialisation, digest, tokens, 16, 0, 0, 4, parent, None, None, 0, False
    )
    assert done == 1 and len(keys) == 1
    got, want = both(cfg, tokens)
    assert got == want and len(got[0]) == 4


def test_plain_prompts_never_leave_the_compiled_path() -> None:
    tokens = [(i * 104729) % 2**31 for i in range(8192)]
    parent = none_hash(HashAlgo.SHA256, None)
    keys, digests, done, last = compiled.chain.chain(
        0, None, tokens, 16, 0, 0, 512, parent, None, None, 0, True
    )
    assert done == 512 and len(keys) == len(digests) == 512 and last == digests[-1]
    with pure_hashing():
        assert BlockHasher(HashConfig()).keys(tokens) == keys


@pytest.mark.parametrize("look", [0, 3])
@pytest.mark.parametrize("token", [2**30, 300, 5, -(2**40)])
@pytest.mark.parametrize("size", [13_090, 13_097, 13_098, 13_099, 13_100, 13_101, 13_104, 30_000])
def test_frames_split_where_the_pickler_splits_them(size: int, token: int, look: int) -> None:
    """A block's pickle past 64 KiB is split into frames before the object that would
    start past the limit (the last token too: no frame then holds only the trailer)."""
    tokens = [token] * (size + look) + [token + 1] * 3
    for extra in (None, ("a" * 10,)):
        got, want = written(0, tokens, size, look, 0, bytes(32), extra)
        assert got == want, (size, token, look, extra)


@pytest.mark.parametrize("length", [65_535, 65_536, 65_537, 70_000, 300])
@pytest.mark.parametrize("tokens_before", [16, 13_000, 13_100])
def test_payloads_of_64k_go_outside_frames(length: int, tokens_before: int) -> None:
    big = "y" * length
    tokens = [2**30] * tokens_before
    for extra in ((big,), (big, big), (("lora", big, "p"),), (big, "z" * 65_536), (big.encode(),)):
        got, want = written(0, tokens, tokens_before, 0, 0, bytes(32), extra)
        assert got == want, (length, tokens_before, len(extra))


@pytest.mark.parametrize("serialisation", [0, 1])
def test_the_same_object_twice_is_a_memo_reference(serialisation: int) -> None:
    one = "".join(["ab", "cd"])
    other = "".join(["ab", "cd"])
    assert one == other and one is not other
    shared, separate = (one, one), (one, other)
    got_shared = written(serialisation, TOKENS, 16, 0, 0, bytes(32), shared)
    got_separate = written(serialisation, TOKENS, 16, 0, 0, bytes(32), separate)
    assert got_shared[0] == got_shared[1] and got_separate[0] == got_separate[1]
    if serialisation == 0:  # pickle memoizes by identity: BINGET for the second
        assert got_shared[0] != got_separate[0] and b"h\x02" in got_shared[0]
    else:  # cbor2 shares nothing by default
        assert got_shared[0] == got_separate[0]
    nested = (("lora", one, one), ("cache_salt", other), (), ((1, -2, 2**40), None, b"b"))
    for extra in (nested, (nested, nested), ((one,) * 5,)):
        got, want = written(serialisation, TOKENS, 16, 0, 0, bytes(32), extra)
        assert got == want


LORA, PATH, SALT = "my-lora", "/adapters/my-lora", "tenant-a"
SAME = "".join(["sh", "ared"])
EXTRAS = {
    "none": BlockExtras(),
    "lora": BlockExtras(LORA, PATH),
    "salt": BlockExtras(cache_salt=SALT),
    "lora+salt": BlockExtras(LORA, PATH, SALT),
    "one object everywhere": BlockExtras(SAME, SAME, SAME),
    "lora named like the tag": BlockExtras("lora", "lora", "cache_salt"),
    "non-ascii": BlockExtras("lóra-ü", "/ä/ß", "sälz-🙂"),
}


@pytest.mark.parametrize("algo", list(HashAlgo))
@pytest.mark.parametrize("style", list(ExtraKeyStyle))
@pytest.mark.parametrize("name", list(EXTRAS))
@pytest.mark.parametrize("first", [0, 1, 3])
def test_extras_in_both_styles(algo, style, name, first) -> None:
    cfg = config(algo, extra_key_style=style)
    got, want = both(cfg, TOKENS, EXTRAS[name], None, first)
    assert got == want and len(got[0]) == 3


@pytest.mark.parametrize("algo", list(HashAlgo))
@pytest.mark.parametrize("look", [1, 2, 3, 4, 17])
@pytest.mark.parametrize("name", ["none", "lora+salt", "one object everywhere"])
@pytest.mark.parametrize("length", [0, 5, 16, 31, 48, 65, 100])
def test_lookahead(algo: HashAlgo, look: int, name: str, length: int) -> None:
    cfg = config(algo, lookahead_tokens=look)
    got, want = both(cfg, [t * 3 - 40 for t in range(length)], EXTRAS[name])
    assert got == want


@pytest.mark.parametrize("algo", list(HashAlgo))
@pytest.mark.parametrize("parent_len", [0, 1, 16, 32, 255, 256, 300])
def test_parents_of_every_length(algo: HashAlgo, parent_len: int) -> None:
    parent = bytes(range(256))[:parent_len] * 2
    parent = parent[:parent_len]
    for extras in (EXTRAS["none"], EXTRAS["lora+salt"]):
        got, want = both(config(algo), TOKENS, extras, parent, 1)
        assert got == want


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_short_and_empty_prompts(algo: HashAlgo) -> None:
    for tokens in ([], [1], list(range(15)), list(range(16)), list(range(17))):
        got, want = both(config(algo), tokens, EXTRAS["lora+salt"])
        assert got == want and len(got[0]) == len(tokens) // 16


@pytest.mark.parametrize("code", list("bBhHiIlLqQ"))
def test_token_arrays_tuples_and_other_sequences(code: str) -> None:
    values = [v for v in [3, 100, 255, 256, 30_000, 65_535, 65_536, 2**31 - 1, 2**32 - 1] * 8]
    values += [2**63 + 9, -5, -(2**31) - 1] * 6
    item_bits = array(code).itemsize * 8
    signed = code.islower()
    low, high = (-(2 ** (item_bits - 1)), 2 ** (item_bits - 1)) if signed else (0, 2**item_bits)
    tokens = array(code, [v for v in values if low <= v < high][:64])
    cfg = HashConfig()
    for form in (tokens, tuple(tokens), range(5, 5 + len(tokens))):
        got, want = both(cfg, form)
        assert got == want and len(got[0]) == len(tokens) // 16
    assert both(cfg, tokens)[0] == both(cfg, tokens.tolist())[1]


def test_lone_surrogates_match_the_pure_path_or_fail_alike() -> None:
    odd = BlockExtras("bad\udc80lora", "/p\ud800", "s\udfff")
    got, want = both(HashConfig(extra_key_style=ExtraKeyStyle.BARE), TOKENS, odd)
    assert got == want  # pickle writes them with "surrogatepass": left to Python
    cbor = BlockHasher(HashConfig(algo=HashAlgo.SHA256_CBOR, extra_key_style=ExtraKeyStyle.BARE))
    with pytest.raises(UnicodeEncodeError):
        cbor.keys(TOKENS, odd)
    with pure_hashing(), pytest.raises(UnicodeEncodeError):
        cbor.keys(TOKENS, odd)


def test_bad_arguments_are_errors_not_crashes() -> None:
    chain = compiled.chain.chain
    parent = bytes(32)
    with pytest.raises(ValueError):
        chain(0, None, [1, 2, 3], 16, 0, 0, 1, parent, None, None, 0, False)
    with pytest.raises(TypeError):
        chain(0, None, {1, 2}, 1, 0, 0, 1, parent, None, None, 0, False)
    with pytest.raises(TypeError):
        chain(0, None, array("d", [1.0]), 1, 0, 0, 1, parent, None, None, 0, False)
    with pytest.raises(TypeError):
        chain(0, None, [1], 1, 0, 0, 1, "not bytes", None, None, 0, False)
    with pytest.raises(ValueError):
        chain(0, None, [1], 0, 0, 0, 1, parent, None, None, 0, False)
    with pytest.raises(TypeError):
        chain(0, lambda data: "no bytes", [1], 1, 0, 0, 1, parent, None, None, 0, False)
    with pytest.raises(ZeroDivisionError):
        chain(0, lambda data: 1 / 0, [1], 1, 0, 0, 1, parent, None, None, 0, False)
    assert compiled.chain.serialise(0, [1, 2], 1, 0, 0, parent, object(), True) is None
    assert compiled.hashing() == "compiled" and "compiled hashing" in implementations()


INTS = st.one_of(
    st.integers(0, 150_000),
    st.sampled_from(EDGES + BEYOND_64_BITS),
    st.integers(-(2**70), 2**70),
)
TEXT = st.text(st.characters(codec="utf-8"), max_size=12)
KEYS = st.recursive(
    st.one_of(st.none(), TEXT, st.binary(max_size=8), st.integers(-(2**65), 2**65)),
    lambda inner: (
        st.tuples(inner) | st.tuples(inner, inner) | st.lists(inner, max_size=5).map(tuple)
    ),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    algo=st.sampled_from(list(HashAlgo)),
    size=st.integers(1, 40),
    look=st.integers(0, 4),
    tokens=st.lists(INTS, max_size=160),
    lora=st.none() | TEXT,
    salt=st.none() | TEXT,
    style=st.sampled_from(list(ExtraKeyStyle)),
    parent=st.none() | st.binary(max_size=300),
    first=st.integers(0, 2),
)
def test_random_chains_equal_the_pure_path(
    algo, size, look, tokens, lora, salt, style, parent, first
) -> None:
    extras = BlockExtras(lora, None if lora is None else f"/a/{lora}", salt)
    cfg = config(algo, block_size=size, lookahead_tokens=look, extra_key_style=style)
    got, want = both(cfg, tokens, extras, parent, first)
    assert got == want


@settings(max_examples=300, deadline=None)
@given(
    serialisation=st.sampled_from([0, 1]),
    tokens=st.lists(INTS, min_size=8, max_size=8),
    size=st.integers(1, 6),
    look=st.integers(0, 2),
    parent=st.binary(max_size=300),
    extra=KEYS,
)
def test_random_hash_inputs_are_picklers_bytes(serialisation, tokens, size, look, parent, extra):
    got, want = written(serialisation, tokens, size, look, 0, parent, extra)
    assert got is None or got == want
    if all(_writable(t) for t in tokens[: size + look]) and _writable(extra):
        assert got == want  # nothing here is left to Python


def _writable(value: object, depth: int = 0) -> bool:
    """Whether _chain writes ``value`` itself (see indexer/_chain.c)."""
    if value is None or isinstance(value, str | bytes):
        return True
    if isinstance(value, int):
        return -(2**63) <= value < 2**64
    return depth < 16 and all(_writable(item, depth + 1) for item in value)


@settings(max_examples=150, deadline=None)
@given(
    algo=st.sampled_from(list(HashAlgo)),
    size=st.sampled_from([1, 3, 16]),
    lookahead=st.sampled_from([0, 0, 1, 4]),
    first=st.sampled_from([0, 0, 1, 5]),
    gaps=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), max_size=6),
    salt=st.sampled_from([None, "s"]),
    chained=st.booleans(),
)
def test_multimodal_items_on_both_paths(
    algo: HashAlgo, size: int, lookahead: int, first: int, gaps, salt, chained: bool
) -> None:
    """Blocks that items overlap are hashed by the pure path, the runs between them by
    the compiled one: the chain is the pure path's whatever the items' places (block
    edges, the lookahead span, items before ``tokens``' first block)."""
    items, at = [], -30  # offsets in the sequence; tokens start at block ``first``
    for gap, length in gaps:
        items.append(MmFeature(f"img-{at}", at + gap, length))
        at += gap + length
    tokens = [(i * 7919) % 150_000 for i in range(max(at, 0) + 2 * size + lookahead)]
    extras = BlockExtras(None, None, salt, tuple(items))
    parent = b"\x07" * 32 if chained else None
    got, want = both(
        config(algo, block_size=size, lookahead_tokens=lookahead), tokens, extras, parent, first
    )
    assert got == want

"""Block keys identical to vLLM's prefix-cache hashes.

vLLM hashes each *full* block of ``block_size`` tokens as::

    digest_i = H((digest_{i-1} or NONE_HASH, tuple(tokens_i), extra_keys_i))

and publishes the digest's last 8 bytes as a big-endian uint64. Because kvindex can
recompute these keys from a prompt, the index stores the engine's own hashes and a
prompt's chain can be looked up directly. :class:`BlockHasher` lists the facts about
vLLM's hashing (0.33) this follows.
"""

from __future__ import annotations

import enum
import hashlib
import pickle
from array import array
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

import cbor2
import xxhash

from kvindex.events.errors import ClientError
from kvindex.indexer import compiled

_U64_MASK = 2**64 - 1

#: The seed vLLM >= 0.29 derives NONE_HASH from for sha256 variants when PYTHONHASHSEED
#: is unset.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


class HashAlgo(enum.StrEnum):
    """vLLM's ``--prefix-caching-hash-algo`` values."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"
    XXHASH = "xxhash"
    XXHASH_CBOR = "xxhash_cbor"

    @property
    def seed_is_random_when_unset(self) -> bool:
        """Whether vLLM (>= 0.29) picks a random per-process seed when none is set."""
        return self in (HashAlgo.XXHASH, HashAlgo.XXHASH_CBOR)


class ExtraKeyStyle(enum.StrEnum):
    """How LoRA and cache-salt extra keys are spelled inside the hash input."""

    BARE = "bare"  # vLLM <= 0.30: "my-lora", "salt"
    TAGGED = "tagged"  # vLLM >= 0.31: ("lora", name, path), ("cache_salt", salt)


def _pickle(value: Any) -> bytes:
    return pickle.dumps(value, protocol=5)


def _cbor(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS: dict[HashAlgo, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    HashAlgo.SHA256: (_pickle, _sha256),
    HashAlgo.SHA256_CBOR: (_cbor, _sha256),
    HashAlgo.XXHASH: (_pickle, xxhash.xxh3_128_digest),
    HashAlgo.XXHASH_CBOR: (_cbor, xxhash.xxh3_128_digest),
}


class KeyConfigError(ClientError):
    """A hash configuration that cannot reproduce any engine's keys."""


def hash_value(algo: HashAlgo, value: Any) -> bytes:
    """vLLM's ``H(value)`` for ``algo``: serialise, then digest."""
    serialise, digest = _DIGESTS[algo]
    return digest(serialise(value))


def published(digest: bytes) -> int:
    """The uint64 vLLM publishes for a digest (its last 8 bytes, big-endian)."""
    return int.from_bytes(digest, "big") & _U64_MASK


@dataclass(frozen=True, slots=True)
class HashConfig:
    """Everything that decides an engine's block hashes.

    ``seed`` is the pods' ``PYTHONHASHSEED`` (None when unset: vLLM's default rule).
    """

    algo: HashAlgo = HashAlgo.SHA256
    block_size: int = 16
    seed: str | None = None
    extra_key_style: ExtraKeyStyle = ExtraKeyStyle.TAGGED
    lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise KeyConfigError(f"block size must be positive, got {self.block_size}")
        if self.lookahead_tokens < 0:
            raise KeyConfigError("lookahead tokens must be >= 0")

    @property
    def reproducible(self) -> bool:
        """False when the pods' NONE_HASH is random per process (xxhash, no seed)."""
        return self.seed is not None or not self.algo.seed_is_random_when_unset

    def describe(self) -> str:
        seed = "unset" if self.seed is None else repr(self.seed)
        return f"{self.algo.value}, block size {self.block_size}, seed {seed}"


@dataclass(frozen=True, slots=True)
class MmFeature:
    """One multimodal item of a prompt: vLLM's ``MultiModalFeatureSpec.identifier`` and
    its placeholder range (``mm_position``) in token positions of the sequence."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class BlockExtras:
    """Per-request inputs that enter block hashes besides tokens.

    ``lora_path`` is needed only for the tagged style (vLLM >= 0.31 hashes the adapter's
    path; events publish only its name). ``mm_features`` are sorted by offset and do not
    overlap (vLLM's own assumption; ``/score`` checks it).
    """

    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm_features: tuple[MmFeature, ...] = ()

    def for_block(
        self, index: int, style: ExtraKeyStyle, block_size: int = 0, lookahead: int = 0
    ) -> tuple[Any, ...] | None:
        """The ``extra_keys`` tuple of block ``index`` (None when it has none).

        ``block_size`` and ``lookahead`` place the block's token span, which only the
        multimodal keys need: with lookahead the span runs on over the lookahead tokens,
        as vLLM's ``generate_lookahead_block_hash_extra_keys`` has it.
        """
        items: list[Any] = []
        if self.lora_name is not None:
            if style is ExtraKeyStyle.BARE:
                items.append(self.lora_name)
            else:
                if self.lora_path is None:
                    raise KeyConfigError(
                        f"LoRA adapter {self.lora_name!r} needs its path for vLLM >= 0.31 "
                        "hashes; add it to the model's `loras` in the model config"
                    )
                items.append(("lora", self.lora_name, self.lora_path))
        if self.mm_features:
            if style is ExtraKeyStyle.BARE:
                # Only vLLM 0.33's form is checked against vLLM's code; the bare
                # releases' form is not, so it is refused rather than guessed.
                raise KeyConfigError(
                    "multimodal features are hashed as vLLM >= 0.31 does; this model's "
                    "extra_key_style is bare (vLLM <= 0.30), whose multimodal keys "
                    "kvindex does not reproduce"
                )
            start = index * block_size
            end = start + block_size + lookahead
            named: set[int] = set()
            for item in self.mm_features:
                if item.offset >= end:
                    break
                if item.offset + item.length > start:
                    identifier = item.identifier
                    if id(identifier) in named:
                        identifier = _separate(identifier)
                    named.add(id(identifier))
                    items.append(("mm", identifier, item.offset - start))
        if index == 0 and self.cache_salt:
            if style is ExtraKeyStyle.BARE:
                items.append(self.cache_salt)
            else:
                items.append(("cache_salt", self.cache_salt))
        return tuple(items) if items else None


NO_EXTRAS = BlockExtras()


def _separate(text: str) -> str:
    """An equal string that is another object. pickle writes an object it has already
    written in one input as a back-reference, so one identifier object named twice in a
    block (an image repeated) would serialise unlike vLLM's, whose items each hold their
    own string (decoded from its own message)."""
    return "".join((text[:1], text[1:])) if len(text) > 1 else text


_INT_TYPECODES = frozenset("bBhHiIlLqQ")

#: The chain's serialisation code for indexer/_chain.c and its digest (None: SHA-256 in C).
_COMPILED: dict[HashAlgo, tuple[int, Callable[[bytes], bytes] | None]] = {
    HashAlgo.SHA256: (0, None),
    HashAlgo.SHA256_CBOR: (1, None),
    HashAlgo.XXHASH: (0, xxhash.xxh3_128_digest),
    HashAlgo.XXHASH_CBOR: (1, xxhash.xxh3_128_digest),
}


@dataclass(slots=True)
class BlockHasher:
    """Computes vLLM block-hash chains for one HashConfig.

    Facts about vLLM, checked against ``vllm/utils/hashing.py`` and
    ``vllm/v1/core/kv_cache_utils.py`` (0.33):

    * ``sha256``: SHA-256 of ``pickle.dumps(x, protocol=5)`` (the default since 0.10.2);
      ``sha256_cbor``: SHA-256 of ``cbor2.dumps(x, canonical=True)``; ``xxhash`` /
      ``xxhash_cbor``: xxh3_128 of the same serialisations.
    * ``NONE_HASH = H(seed)``. The seed is ``PYTHONHASHSEED`` when set. When unset, since
      0.29 the sha256 variants use the fixed string ``"vllm-none-hash"`` (every pod agrees)
      and the xxhash variants a random per-process seed (no two pods agree, nothing to
      reproduce). Before 0.29 an unset seed was random for every algorithm.
    * ``extra_keys`` is None for a block without extras, else a tuple in the order LoRA,
      multimodal, cache salt, prompt embeds. Up to 0.30 items are bare (the adapter name on
      every block, the salt on block 0); from 0.31 they are tagged: ``("lora", name, path)``
      and ``("cache_salt", salt)``.
    * Multimodal items (vLLM 0.33, ``_gen_mm_extra_hash_keys``): every block a placeholder
      range overlaps gets ``("mm", identifier, offset - block_start)`` between the LoRA and
      the salt, so the offset is negative in the blocks after the item's first. Events
      publish it untagged, as ``(identifier, offset - block_start)``.
    * With lookahead hashing (0.33, ``num_hash_lookahead_tokens`` L > 0) each block's extra
      keys become ``(E, t_1, ..., t_L)``: E is the usual extra keys (or None) and t are the
      L tokens after the block, so only blocks followed by L tokens are hashed.

    Hashing is the hot path of ``/score``. The compiled chain (indexer/_chain.c, when
    built: :data:`kvindex.indexer.compiled.chain`) writes each block's pickle or CBOR
    bytes itself and hashes them with OpenSSL, so SHA-256's own compressions are much
    of a block's cost; blocks it cannot write (tokens past 64 bits, extra keys
    of other types) are hashed here, one by one, by the pure path, which stays the
    reference, as are blocks that multimodal items overlap (their extra keys differ
    block by block, and the C writer takes one extras tuple for block 0 and one for the
    rest).

    The pure path (pickle + hashlib) memoises each block's (digest, published key) per
    (parent digest, block tokens, extras): prompts that share a system prompt or a chat
    history re-hash only their new blocks, and a hit costs building the block's token
    tuple and one dict lookup. The memo is two generations
    of dicts, swapped when the young one fills, bounding memory at ``2 * memo_size``
    entries without per-hit LRU bookkeeping. The compiled path has no memo: a hit (the
    tuple and the lookup) costs more than hashing the block again (bench/bench_hash.py).
    """

    config: HashConfig
    memo_size: int = 65_536
    _none_hash: bytes = field(init=False)
    _young: dict[tuple[bytes, tuple[int, ...], Any], tuple[bytes, int]] = field(init=False)
    _old: dict[tuple[bytes, tuple[int, ...], Any], tuple[bytes, int]] = field(init=False)

    def __post_init__(self) -> None:
        if not self.config.reproducible:
            raise KeyConfigError(
                f"{self.config.algo.value} with PYTHONHASHSEED unset uses a random seed in "
                "every vLLM process, so no block key can be reproduced: set PYTHONHASHSEED "
                "on every pod and the same --hash-seed here, or use --key-mode tokens"
            )
        self._none_hash = none_hash(self.config.algo, self.config.seed)
        self._young = {}
        self._old = {}

    @property
    def none_hash(self) -> bytes:
        return self._none_hash

    def digests(
        self,
        tokens: Sequence[int],
        extras: BlockExtras = NO_EXTRAS,
        parent: bytes | None = None,
        first_block_index: int = 0,
    ) -> list[bytes]:
        """Digests of every full block of ``tokens`` (chained from ``parent``).

        ``first_block_index`` is the position of ``tokens[0]``'s block in its sequence
        (extras such as the cache salt apply to block 0 only).
        """
        if compiled.chain is not None:
            digests: list[bytes] = []
            self._compiled(compiled.chain, tokens, extras, parent, first_block_index, digests)
            return digests
        return [d for d, _ in self._chain(tokens, extras, parent, first_block_index)]

    def keys(
        self,
        tokens: Sequence[int],
        extras: BlockExtras = NO_EXTRAS,
        parent: bytes | None = None,
        first_block_index: int = 0,
    ) -> list[int]:
        """Published uint64 keys of every full block of ``tokens``.

        ``tokens`` is a list or tuple of ints, or an ``array.array`` of integers (the
        binary ``/score`` body): the compiled path reads either directly.
        """
        if compiled.chain is not None:
            return self._compiled(compiled.chain, tokens, extras, parent, first_block_index)
        return [k for _, k in self._chain(tokens, extras, parent, first_block_index)]

    def _block_count(self, tokens: Sequence[int]) -> int:
        lookahead = self.config.lookahead_tokens
        if len(tokens) < lookahead:
            return 0
        return (len(tokens) - lookahead) // self.config.block_size

    def _compiled(
        self,
        core: ModuleType,
        tokens: Sequence[int],
        extras: BlockExtras,
        parent: bytes | None,
        first_block_index: int,
        digests: list[bytes] | None = None,
    ) -> list[int]:
        count = self._block_count(tokens)
        if count == 0:
            return []
        cfg = self.config
        if not isinstance(tokens, list | tuple) and not (
            isinstance(tokens, array) and tokens.typecode in _INT_TYPECODES
        ):
            tokens = list(tokens)
        # The C writer takes one extras tuple for block 0 and one for the rest: blocks
        # that multimodal items overlap (their keys differ block by block) are hashed
        # here, the runs between them there.
        plain = replace(extras, mm_features=()) if extras.mm_features else extras
        with_items = self._blocks_with_items(extras, first_block_index, count)
        first = rest = None
        if plain != NO_EXTRAS:
            first = plain.for_block(first_block_index, cfg.extra_key_style)
            rest = plain.for_block(first_block_index + 1, cfg.extra_key_style)
        serialisation, digest = _COMPILED[cfg.algo]
        previous = parent if parent else self._none_hash
        want_digests = digests is not None
        keys: list[int] = []
        done = 0
        while True:
            at = bisect_left(with_items, done)
            stop = with_items[at] if at < len(with_items) else count
            if done < stop:
                got, got_digests, done, previous = core.chain(
                    serialisation, digest, tokens, cfg.block_size, cfg.lookahead_tokens, done,
                    stop, previous, first, rest, first_block_index, want_digests,
                )  # fmt: skip
                keys = got if not keys else keys + got
                if digests is not None:
                    digests += got_digests
            if done == count:
                return keys
            # a block with multimodal items, or one the compiled writer leaves to the
            # reference serialisation
            previous = hash_value(
                cfg.algo, self._block_input(tokens, done, previous, extras, first_block_index)
            )
            keys.append(published(previous))
            if digests is not None:
                digests.append(previous)
            done += 1

    def _blocks_with_items(
        self, extras: BlockExtras, first_block_index: int, count: int
    ) -> list[int]:
        """The blocks (0 = ``tokens``' first) whose hashed span a multimodal item
        overlaps, sorted: block j spans ``[j*size, (j+1)*size + lookahead)``."""
        if not extras.mm_features:
            return []
        size, lookahead = self.config.block_size, self.config.lookahead_tokens
        blocks: set[int] = set()
        for item in extras.mm_features:
            low = (item.offset - size - lookahead) // size + 1 - first_block_index
            high = (item.offset + item.length - 1) // size - first_block_index
            blocks.update(range(max(low, 0), min(high, count - 1) + 1))
        return sorted(blocks)

    def _block_input(
        self,
        tokens: Sequence[int],
        index: int,
        previous: bytes,
        extras: BlockExtras,
        first_block_index: int,
    ) -> tuple[bytes, tuple[int, ...], Any]:
        """What vLLM hashes for block ``index``: (parent digest, tokens, extra keys)."""
        cfg = self.config
        size, lookahead = cfg.block_size, cfg.lookahead_tokens
        start = index * size
        extra = None
        if extras != NO_EXTRAS:
            extra = extras.for_block(
                first_block_index + index, cfg.extra_key_style, size, lookahead
            )
        if lookahead:
            extra = (extra, *tokens[start + size : start + size + lookahead])
        return (previous, tuple(tokens[start : start + size]), extra)

    def _chain(
        self,
        tokens: Sequence[int],
        extras: BlockExtras,
        parent: bytes | None,
        first_block_index: int,
    ) -> list[tuple[bytes, int]]:
        if isinstance(tokens, array):  # one list, not a new int per token of every block
            tokens = tokens.tolist()
        cfg = self.config
        size = cfg.block_size
        lookahead = cfg.lookahead_tokens
        algo = cfg.algo
        style = cfg.extra_key_style
        previous = parent if parent else self._none_hash
        young, old = self._young, self._old
        plain = extras == NO_EXTRAS and not lookahead
        extra = None
        out: list[tuple[bytes, int]] = []
        for i in range(self._block_count(tokens)):
            start = i * size
            block = tuple(tokens[start : start + size])
            if not plain:
                extra = extras.for_block(first_block_index + i, style, size, lookahead)
                if lookahead:
                    extra = (extra, *tokens[start + size : start + size + lookahead])
            memo_key = (previous, block, extra)
            entry = young.get(memo_key)
            if entry is None:
                entry = old.get(memo_key)
                if entry is None:
                    digest = hash_value(algo, memo_key)
                    entry = (digest, int.from_bytes(digest[-8:], "big"))
                young[memo_key] = entry
            out.append(entry)
            previous = entry[0]
        if len(young) > self.memo_size:
            self._old, self._young = young, {}
        return out


def none_hash(algo: HashAlgo, seed: str | None) -> bytes:
    """vLLM's NONE_HASH for ``algo`` and the pods' PYTHONHASHSEED (None = unset, the
    >= 0.29 default rule for sha256 variants)."""
    if seed is None:
        if algo.seed_is_random_when_unset:
            raise KeyConfigError(f"{algo.value} with an unset seed is random per process")
        seed = DEFAULT_NONE_HASH_SEED
    return hash_value(algo, seed)

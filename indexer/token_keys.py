"""Token-content keys: kvindex's own block-hash chain, for engines it cannot reproduce.

When the pods' hashes cannot be recomputed (xxhash with an unset seed gives every engine
process its own random NONE_HASH), the index is keyed by a chain kvindex computes itself
from each BlockStored's ``token_ids``; ``/score`` computes the same chain from the
prompt. Removals carry only engine hashes, so each member keeps an engine-hash →
own-key map, learned from its stores.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvindex.events.errors import ClientError
from kvindex.indexer.keys import NO_EXTRAS, BlockExtras, MmFeature

_ROOT = b"kvindex-content-root"


class TokenRangeError(ClientError):
    """A token id outside 0..2^32-1 (no vocabulary is that large)."""


@dataclass(slots=True)
class ContentHasher:
    """Builds content keys: ``key_i = xxh3_64(key_{i-1} || tokens_i || extras_i)``.

    Keys depend only on token content, LoRA name, cache salt and multimodal items, so
    every pod serving the same prompt gets the same keys whatever its engine's hash
    seed. A block without items keys as it did before items were hashed.
    """

    block_size: int

    def keys(
        self,
        tokens: Sequence[int],
        extras: BlockExtras = NO_EXTRAS,
        parent: int | None = None,
        first_block_index: int = 0,
    ) -> list[int]:
        size = self.block_size
        count = len(tokens) // size
        if count == 0:
            return []
        try:
            packed = array("I", tokens[: count * size]).tobytes()
        except OverflowError:
            raise TokenRangeError("token ids must be in 0..4294967295") from None
        lora = (extras.lora_name or "").encode()
        salt = (extras.cache_salt or "").encode()
        previous = _ROOT if parent is None else parent.to_bytes(8, "big")
        step = size * 4
        out: list[int] = []
        items = extras.mm_features
        for i in range(count):
            extra = lora + b"\x00" + salt if first_block_index + i == 0 and salt else lora
            if items:
                extra += _items_in(items, i * size, (i + 1) * size)
            key = xxhash.xxh3_64_intdigest(previous + packed[i * step : (i + 1) * step] + extra)
            out.append(key)
            previous = key.to_bytes(8, "big")
        return out


def _items_in(items: tuple[MmFeature, ...], start: int, end: int) -> bytes:
    """The multimodal items a block overlaps, as a block's extra bytes: what vLLM hashes
    (identifier and offset from the block's start, indexer/keys.py), which events
    publish, so a prompt's content keys and a stored event's agree. Positions are
    counted from ``tokens[0]``, which events and prompts both start at a block edge."""
    out = b""
    for item in items:
        if item.offset >= end:
            break
        if item.offset + item.length > start:
            out += b"\x00mm\x00%s\x00%d" % (item.identifier.encode(), item.offset - start)
    return out


class EngineKeyMap:
    """Per member: engine hash → [own key, copies in GPU, CPU, STORAGE].

    An entry lives while any tier of that member holds a copy of the block, so a GPU
    eviction does not lose the mapping a later CPU-tier removal needs, and the first of
    two copies' removals does not lose the mapping the second one needs. The copy counts
    follow the same rule as the index's (:class:`~kvindex.indexer.backend.Op`): a store
    adds a copy, an announcement holds at least one, a removal takes one away.
    """

    def __init__(self) -> None:
        self._maps: dict[str, dict[int, list[int]]] = {}

    def learn(
        self,
        member: str,
        tier: int,
        engine_keys: Sequence[int],
        own_keys: Sequence[int],
        *,
        add_copy: bool = True,
    ) -> None:
        table = self._maps.setdefault(member, {})
        at = 1 + tier
        for engine, own in zip(engine_keys, own_keys, strict=False):
            entry = table.get(engine)
            if entry is None:
                entry = table[engine] = [own, 0, 0, 0]
            entry[0] = own
            entry[at] = entry[at] + 1 if add_copy else max(entry[at], 1)

    def resolve(self, member: str, engine_key: int) -> int | None:
        entry = self._maps.get(member, {}).get(engine_key)
        return None if entry is None else entry[0]

    def resolve_any(self, engine_keys: Sequence[int]) -> list[int | None]:
        """Own keys of hashes any member published (None where none did), for engines
        that give one block the same hash on every pod (SGLang's page chain), so a
        published hash names the block wherever it is cached.

        Called from a request thread while the ingesting thread writes: the list of
        tables is copied first (a member added meanwhile cannot break the loop), and a
        single dict lookup is atomic in CPython."""
        tables = list(self._maps.values())
        out: list[int | None] = []
        for engine in engine_keys:
            own = None
            for table in tables:
                entry = table.get(engine)
                if entry is not None:
                    own = entry[0]
                    break
            out.append(own)
        return out

    def resolve_many(
        self, member: str, tier: int, engine_keys: Sequence[int], *, add_copy: bool = True
    ) -> tuple[list[int], int]:
        """Own keys for ``engine_keys`` (also counting a copy in ``tier``); and how many
        were unknown."""
        table = self._maps.get(member, {})
        at = 1 + tier
        out: list[int] = []
        for engine in engine_keys:
            entry = table.get(engine)
            if entry is not None:
                out.append(entry[0])
                entry[at] = entry[at] + 1 if add_copy else max(entry[at], 1)
        return out, len(engine_keys) - len(out)

    def forget(self, member: str, tier: int, engine_keys: Sequence[int]) -> list[int]:
        """Own keys of ``engine_keys`` that lose a copy in ``tier``; unmaps a key when
        no copy is left in any tier."""
        table = self._maps.get(member)
        if not table:
            return []
        at = 1 + tier
        out: list[int] = []
        for engine in engine_keys:
            entry = table.get(engine)
            if entry is None or not entry[at]:
                continue
            out.append(entry[0])
            entry[at] -= 1
            if not (entry[1] or entry[2] or entry[3]):
                del table[engine]
        return out

    def clear(self, member: str, tier: int | None = None) -> None:
        table = self._maps.get(member)
        if not table:
            return
        if tier is None:
            del self._maps[member]
            return
        at = 1 + tier
        for engine, entry in list(table.items()):
            entry[at] = 0
            if not (entry[1] or entry[2] or entry[3]):
                del table[engine]

    def size(self, member: str) -> int:
        return len(self._maps.get(member, {}))

    def to_state(self) -> dict[str, Any]:
        """Every member's map as flat arrays, for a snapshot."""
        members = sorted(m for m, table in self._maps.items() if table)
        entries = [self._maps[m] for m in members]
        flat = [(e, entry) for table in entries for e, entry in table.items()]
        return {
            "members": members,
            "sizes": np.array([len(table) for table in entries], np.int64),
            "engine": np.array([e for e, _ in flat], np.uint64),
            "own": np.array([entry[0] for _, entry in flat], np.uint64),
            # per entry its GPU, CPU and STORAGE copies, flat (3 per entry)
            "copies": np.array([c for _, entry in flat for c in entry[1:]], np.int64),
        }

    def from_state(self, state: dict[str, Any]) -> None:
        """Replace every map with :meth:`to_state`'s output (a snapshot with a ``tiers``
        bitmask instead of ``copies`` counts one copy per tier named)."""
        engine, own = (state[k].tolist() for k in ("engine", "own"))
        if "copies" in state:
            flat = state["copies"].tolist()
            copies = [flat[i : i + 3] for i in range(0, len(flat), 3)]
        else:
            copies = [[(t >> i) & 1 for i in range(3)] for t in state["tiers"].tolist()]
        if not len(engine) == len(own) == len(copies) == int(state["sizes"].sum()):
            raise ValueError("engine-key map arrays do not fit together")
        if any(len(c) != 3 or min(c) < 0 for c in copies):
            raise ValueError("engine-key map copy counts are not valid")
        maps: dict[str, dict[int, list[int]]] = {}
        start = 0
        for member, n in zip(state["members"], state["sizes"].tolist(), strict=True):
            end = start + n
            values = [[o, *c] for o, c in zip(own[start:end], copies[start:end], strict=True)]
            maps[str(member)] = dict(zip(engine[start:end], values, strict=True))
            start = end
        self._maps = maps

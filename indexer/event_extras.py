"""The extra keys a BlockStored publishes, read back into the request's hash inputs.

vLLM publishes each block's extra keys untagged (0.17+; vLLM 0.33
``kv_cache_utils.to_event_extra_keys``), in the order the hash takes them: the LoRA
adapter's name on every block, each multimodal item overlapping the block as
``(identifier, offset - block_start)``, the cache salt as a bare string on block 0,
then prompt-embedding digests. The hash check (indexer/verify.py) recomputes an event's
keys from them and token-key mode (indexer/ingest.py) builds its content keys from
them, so both read them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import MmFeature


@dataclass(frozen=True, slots=True)
class EventExtras:
    """What an event's extra keys say. ``mm_features`` offsets are token positions from
    the event's first block (negative for an item that began before it); ``unread``
    is whether some key is none of these (a prompt-embedding digest)."""

    salt: str | None
    mm_features: tuple[MmFeature, ...]
    unread: bool


def read_event_extras(event: BlockStored) -> EventExtras:
    lora = event.lora_name
    salt: str | None = None
    unread = False
    seen: dict[tuple[str, int], int] = {}  # (identifier, offset) -> last block naming it
    for index, keys in enumerate(event.extra_keys or []):
        if keys is None:
            continue
        items = list(keys)
        if lora is not None and items and items[0] == lora:
            items = items[1:]
        while items and _is_mm_key(items[0]):
            identifier, offset = items.pop(0)
            seen[(identifier, index * event.block_size + offset)] = index
        first = index == 0 and event.parent_block_hash is None  # the salt's only block
        if first and len(items) == 1 and isinstance(items[0], str):
            salt, items = items[0], []
        unread = unread or bool(items)
    return EventExtras(salt, _placed(seen, event.block_size), unread)


def _is_mm_key(item: Any) -> bool:
    return (
        isinstance(item, list | tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and type(item[1]) is int
    )


def _placed(seen: dict[tuple[str, int], int], block_size: int) -> tuple[MmFeature, ...]:
    """Items placed so they overlap exactly the blocks the event names them in: an event
    gives an item's start (its offset in the first block naming it) but not its length,
    and only which blocks an item overlaps, and where it starts, enter the hash."""
    features = []
    for (identifier, offset), last in seen.items():
        end = max(offset + 1, last * block_size + 1)
        features.append(MmFeature(identifier, offset, end - offset))
    return tuple(sorted(features, key=lambda f: f.offset))

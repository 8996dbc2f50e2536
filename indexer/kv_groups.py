"""KV-cache groups of hybrid models: where each group's blocks live in the index, and the
group layout of each model as learned from its engines' events.

vLLM's hybrid memory allocator (models with sliding-window or Mamba layers besides full
attention: Gemma 3, gpt-oss, Qwen3-Next, Llama 4 ...) caches every block once per KV
group. Each group stores and evicts on its own, and two groups hold the same hash for
the same tokens, so the index keeps one namespace per group: group 0 under the model's
own name (exactly where a model without groups is indexed), group ``g``
under :func:`group_model`. Stores, removes and clears then work per group unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass

#: ``kv_cache_spec_kind`` values whose cache hit is vLLM's FullAttentionManager rule
#: (vLLM 0.33 ``KVCacheSpecKind``: MLA and sink attention are FullAttentionSpec subclasses).
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
#: Kinds whose hit is vLLM's SlidingWindowManager rule (SlidingWindowMLASpec subclasses
#: SlidingWindowSpec).
SLIDING_WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
MAMBA_KIND = "mamba"
#: Kinds kvindex can compute a hit for. Chunked local attention is not among them: its
#: chunk size is not on the wire.
SCORABLE_KINDS = FULL_ATTENTION_KINDS | SLIDING_WINDOW_KINDS | {MAMBA_KIND}

_SEPARATOR = "#kv-group-"


def group_model(model: str, group_idx: int | None) -> str:
    """The index namespace of one KV group's blocks: the model itself for group 0 (and
    for events without a group), ``<model>#kv-group-<g>`` for the others."""
    if not group_idx:
        return model
    return f"{model}{_SEPARATOR}{group_idx}"


def is_group_namespace(name: str) -> bool:
    """Whether an index model name is a non-primary KV group's namespace."""
    return _SEPARATOR in name


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """What kvindex knows of one KV group: its attention kind, its sliding window (only
    for sliding-window kinds) and its block size in tokens (0 until a store with tokens
    says)."""

    kind: str
    sliding_window: int | None = None
    block_size: int = 0

    @property
    def is_full_attention(self) -> bool:
        return self.kind in FULL_ATTENTION_KINDS


#: One model's groups: group_idx -> spec.
Layout = Mapping[int, GroupSpec]


class KvLayouts:
    """Per model, the KV group layout its engines announced. Written by the ingest
    thread, read by scoring threads.

    Every engine of one model has the same layout (it follows from the model's
    architecture and the engine's block size), so the first engine to announce a group
    defines it; a different announcement later is counted in ``conflicts`` and ignored.
    A group's block size is the largest full block seen (vLLM 0.33 may also publish
    partial Mamba tails, which are smaller).

    The layout (which group is which attention kind, its sliding window and block size)
    comes from ``BlockStored.group_idx`` (vLLM 0.20+) with ``kv_cache_spec_kind`` and
    ``kv_cache_spec_sliding_window`` (vLLM 0.22+; in 0.33 ``KVCacheManager.take_events``
    sets them on every BlockStored). Engines that publish no kind leave the model without
    a layout, and it is indexed and scored as a model without groups: group 0 only.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layouts: dict[str, dict[int, GroupSpec]] = {}
        self.conflicts = 0

    def learn(
        self, model: str, group_idx: int, kind: str, sliding_window: int | None, block_size: int
    ) -> None:
        with self._lock:
            groups = self._layouts.setdefault(model, {})
            known = groups.get(group_idx)
            if known is None:
                groups[group_idx] = GroupSpec(kind, sliding_window, max(block_size, 0))
                return
            if (known.kind, known.sliding_window) != (kind, sliding_window):
                self.conflicts += 1
                return
            if block_size > known.block_size:
                groups[group_idx] = GroupSpec(kind, sliding_window, block_size)

    def get(self, model: str) -> dict[int, GroupSpec] | None:
        """The model's groups (a copy), or None when no engine announced any."""
        with self._lock:
            groups = self._layouts.get(model)
            return dict(groups) if groups else None

    def all(self) -> dict[str, dict[int, GroupSpec]]:
        with self._lock:
            return {model: dict(groups) for model, groups in self._layouts.items()}

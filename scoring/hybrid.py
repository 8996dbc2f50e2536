"""The prefix-cache hit of a hybrid model, computed exactly as vLLM 0.33 computes it.

With several KV groups (full attention plus sliding-window or Mamba layers) a prompt hits
only as far as every group can serve it, each kind by its own rule. This transcribes
vLLM 0.33.0's ``HybridKVCacheCoordinator.find_longest_cache_hit`` and the per-kind
managers' (``vllm/v1/core/kv_cache_coordinator.py``, ``single_type_kv_cache_manager.py``)
for what kvindex sees on the wire: no EAGLE/MTP drop, no context parallelism, hits
aligned to the scheduler block size (:func:`unsupported_reason` names other layouts).
Inputs are bitmasks per group of equal spec: bit ``i`` set when block ``i`` of that
group's view of the prompt is cached in every KV group of it. Nothing here touches the
index: the scorer builds the masks from presence queries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvindex.indexer.kv_groups import (
    FULL_ATTENTION_KINDS,
    MAMBA_KIND,
    SCORABLE_KINDS,
    SLIDING_WINDOW_KINDS,
    GroupSpec,
)


@dataclass(frozen=True, slots=True)
class SpecGroup:
    """KV groups sharing one spec, looked up together (vLLM's ``SpecGroup``)."""

    spec: GroupSpec
    group_ids: tuple[int, ...]

    @property
    def is_full_attention(self) -> bool:
        return self.spec.kind in FULL_ATTENTION_KINDS


@dataclass(frozen=True, slots=True)
class HybridPlan:
    """How to compute one model's hit: its spec groups in lookup order, the alignment
    of a hit in tokens, and whether vLLM uses its single-group (unitary) coordinator."""

    groups: tuple[SpecGroup, ...]
    alignment_tokens: int
    unitary: bool


def unsupported_reason(layout: Mapping[int, GroupSpec], hash_block_size: int) -> str | None:
    """Why kvindex cannot reproduce vLLM's hit for this layout, or None when it can."""
    for idx, spec in sorted(layout.items()):
        if spec.kind not in SCORABLE_KINDS:
            return f"KV group {idx} has kind {spec.kind!r}, whose cache-hit rule is not supported"
        if spec.kind in SLIDING_WINDOW_KINDS and not spec.sliding_window:
            return f"KV group {idx} is a sliding window without a window size"
        if spec.block_size <= 0:
            return f"KV group {idx} has not announced its block size yet"
        if spec.block_size % hash_block_size:
            return (
                f"KV group {idx} has block size {spec.block_size}, not a multiple of the "
                f"model's block size {hash_block_size}"
            )
        if spec.kind == MAMBA_KIND and spec.block_size > hash_block_size and len(layout) > 1:
            # vLLM 0.33 partial_hash_hits_enabled: sub-block (fine-grained) hits.
            return f"KV group {idx} is Mamba with fine-grained prefix hits"
    return None


def plan(layout: Mapping[int, GroupSpec]) -> HybridPlan:
    """vLLM 0.33 ``verify_and_split_kv_cache_groups``: groups of equal spec are merged
    (kvindex sees kind, window and block size, the parts of a spec that decide a hit),
    in group order, then stably sorted so full attention comes first. A hit is aligned
    to the scheduler block size, ``math.lcm`` of the group block sizes
    (``kv_cache_utils``); one group alone uses ``UnitaryKVCacheCoordinator``."""
    merged: dict[GroupSpec, list[int]] = {}
    for idx in sorted(layout):
        merged.setdefault(layout[idx], []).append(idx)
    groups = [SpecGroup(spec, tuple(ids)) for spec, ids in merged.items()]
    groups.sort(key=lambda g: not g.is_full_attention)
    sizes = [layout[idx].block_size for idx in layout]
    unitary = len(layout) == 1
    return HybridPlan(tuple(groups), sizes[0] if unitary else math.lcm(*sizes), unitary)


def full_attention_hit(held: int, block_size: int, max_length: int, alignment_tokens: int) -> int:
    """``FullAttentionManager.find_longest_cache_hit`` (no fine-grained phase, no EAGLE):
    the leading run of cached blocks within ``max_length``, rounded down to the
    alignment. Returns tokens."""
    limit = max_length // block_size
    run = _leading_ones(held)
    hit_length = min(run, limit) * block_size
    return hit_length - hit_length % alignment_tokens


def sliding_window_hit(
    held: int, block_size: int, sliding_window: int, max_length: int, alignment_tokens: int
) -> int:
    """``SlidingWindowManager.find_longest_cache_hit`` (no EAGLE): scan from the last
    block within ``max_length`` leftwards for ``cdiv(window - 1, block_size)`` cached
    blocks in a row, skipping a run's first (rightmost) block when the hit would not end
    on the alignment; without such a run, the run of cached blocks at the start is a
    hit, trimmed to the alignment. Returns tokens."""
    need = -(-(sliding_window - 1) // block_size)
    max_num_blocks = max_length // block_size
    contiguous = 0
    for i in range(max_num_blocks - 1, -1, -1):
        if held >> i & 1:
            if (
                contiguous == 0
                and block_size != alignment_tokens
                and ((i + 1) * block_size) % alignment_tokens
            ):
                continue
            contiguous += 1
            if contiguous >= need:
                return (i + contiguous) * block_size
        else:
            contiguous = 0
    blocks = contiguous
    while block_size != alignment_tokens and blocks * block_size % alignment_tokens:
        blocks -= 1
    return blocks * block_size


def mamba_hit(held: int, block_size: int, max_length: int, alignment_tokens: int) -> int:
    """``MambaManager.find_longest_cache_hit`` (block-granular): the last cached state
    within ``max_length`` whose end is aligned. Returns tokens."""
    for i in range(max_length // block_size - 1, -1, -1):
        if held >> i & 1:
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens:
                continue
            return (i + 1) * block_size
    return 0


def group_hit(group: SpecGroup, held: int, max_length: int, alignment_tokens: int) -> int:
    """One spec group's hit in tokens, by its kind's rule."""
    spec = group.spec
    if group.is_full_attention:
        return full_attention_hit(held, spec.block_size, max_length, alignment_tokens)
    if spec.kind in SLIDING_WINDOW_KINDS:
        assert spec.sliding_window is not None
        return sliding_window_hit(
            held, spec.block_size, spec.sliding_window, max_length, alignment_tokens
        )
    return mamba_hit(held, spec.block_size, max_length, alignment_tokens)


def find_longest_cache_hit(
    hybrid: HybridPlan, held: Sequence[int], max_cache_hit_length: int
) -> int:
    """The hit in tokens, as vLLM 0.33's coordinator computes it for these cached blocks.

    ``held[k]`` is the cached-block mask of ``hybrid.groups[k]``. With one KV group,
    ``UnitaryKVCacheCoordinator``: one call of its rule aligned to its block size.
    Otherwise ``HybridKVCacheCoordinator``'s fixed point: every group in turn may
    shorten the candidate length (full attention is looked up once, then only trimmed);
    when a pass shortened it, all groups are checked again, except in the "simple
    hybrid" (exactly two spec groups, the first full attention), where one pass is the
    answer.
    """
    groups = hybrid.groups
    alignment = hybrid.alignment_tokens
    if hybrid.unitary:
        return group_hit(groups[0], held[0], max_cache_hit_length, alignment)
    simple = len(groups) == 2 and groups[0].is_full_attention
    full_length: dict[int, int] = {}  # spec group -> its (once looked up) hit
    hit_length = max_cache_hit_length
    while True:
        curr = hit_length
        for k, group in enumerate(groups):
            if group.is_full_attention and k in full_length:
                curr = min(curr, full_length[k])
                continue
            curr = group_hit(group, held[k], curr, alignment)
            if group.is_full_attention:
                full_length[k] = curr
        if curr >= hit_length:
            break
        hit_length = curr
        if simple:
            break
    return hit_length


def _leading_ones(mask: int) -> int:
    """How many low bits of ``mask`` are set before the first clear one."""
    return (~mask & (mask + 1)).bit_length() - 1

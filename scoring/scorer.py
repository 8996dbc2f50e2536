"""Token ids to per-pod cached-prefix scores.

A pod can reuse only the *leading* blocks of a prompt it already holds (vLLM's prefix
cache is a hash chain), so a pod's answer is its longest consecutive cached prefix:
``matched_blocks``, how many of those sit in each tier, and a tier-weighted ``score``
(a block in CPU memory must be copied back before use and is worth less than one on
the GPU).

Hybrid models (several KV groups, learned from the events): a pod's answer is the hit
vLLM's hybrid coordinator would find over every group (:mod:`kvindex.scoring.hybrid`),
uncapped like the plain path (vLLM caps a new request at ``prompt_tokens - 1``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from kvindex.indexer.backend import IndexBackend, MemberMatch, MemberPresence, Tier
from kvindex.indexer.keys import BlockExtras, KeyConfigError, MmFeature
from kvindex.indexer.kv_groups import GroupSpec, KvLayouts, group_model
from kvindex.indexer.models import KeyMode, ModelCatalog
from kvindex.indexer.token_keys import ContentHasher
from kvindex.scoring import hybrid


class TierWeights(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one cached block is worth per tier, relative to recomputing it (0).

    These defaults are the only ones: the config file's ``scoring.tier_weights``
    decodes into this type."""

    gpu: float = 1.0
    cpu: float = 0.8
    storage: float = 0.5

    def of(self, tier: Tier) -> float:
        return (self.gpu, self.cpu, self.storage)[tier]


class PodScore(msgspec.Struct, gc=False):
    """One pod's answer; also the element of /score's JSON answer, as is."""

    pod: Annotated[str, msgspec.Meta(description="The pod id (ip:port).")]
    matched_blocks: Annotated[
        int, msgspec.Meta(description="Leading blocks of the prompt the pod holds.")
    ]
    matched_tokens: Annotated[int, msgspec.Meta(description="matched_blocks times block_size.")]
    gpu_blocks: Annotated[int, msgspec.Meta(description="Of those, blocks in GPU memory.")]
    cpu_blocks: Annotated[int, msgspec.Meta(description="Of those, blocks in CPU memory.")]
    storage_blocks: Annotated[int, msgspec.Meta(description="Of those, blocks in storage.")]
    score: Annotated[
        float, msgspec.Meta(description="The matched blocks weighted by tier (tier_weights).")
    ]
    # (:mod:`kvindex.scoring.route.speculative`)
    speculative_blocks: Annotated[
        int,
        msgspec.Meta(
            description="Blocks past matched_blocks that a recent /route sent to this pod "
            "and its events have not confirmed yet; never counted in the fields above."
        ),
    ] = 0
    stream_state: Annotated[
        str | None,
        msgspec.Meta(
            description="The pod's event stream state when it is not live, as "
            "/index/pods says (unheard: not heard from since kvindex started, restored, "
            "incomplete, gapped, replaying, ...); null: live, or no stream here."
        ),
    ] = None


@dataclass(slots=True)
class ScoreResult:
    model: str
    block_size: int
    prompt_tokens: int
    prompt_blocks: int
    pods: list[PodScore] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # the prompt's block keys, block 0 first
    best: int | None = None  # best_matched_blocks when the scorer knew it (pods best first)

    @property
    def best_matched_blocks(self) -> int:
        if self.best is not None:
            return self.best
        return max((p.matched_blocks for p in self.pods), default=0)


class LoraUnknown(KeyConfigError):
    """A LoRA adapter whose path the model config does not give (vLLM >= 0.31 hashes it)."""


class Scorer:
    """Scores prompts against an index backend."""

    def __init__(
        self,
        backend: IndexBackend,
        catalog: ModelCatalog,
        weights: TierWeights | None = None,
        layouts: KvLayouts | None = None,
    ) -> None:
        self._backend = backend
        self._catalog = catalog
        self._weights = weights or TierWeights()
        self._layouts = layouts
        self._content: dict[int, ContentHasher] = {}
        self._gpu_scores: list[float] = []  # score of n GPU blocks (see _add_scores)

    def block_keys(
        self,
        model: str,
        tokens: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: tuple[MmFeature, ...] = (),
    ) -> list[int]:
        """The index keys of every full block of ``tokens`` for ``model``."""
        keying = self._catalog.keying(model)
        if keying.key_mode is KeyMode.TOKENS:
            size = keying.hash.block_size
            hasher = self._content.get(size)
            if hasher is None:
                hasher = self._content[size] = ContentHasher(size)
            return hasher.keys(tokens, BlockExtras(lora_name, None, cache_salt, mm_features))
        path = None
        if lora_name is not None:
            path = keying.lora_path(lora_name)
            if path is None and keying.hash.extra_key_style == "tagged":
                raise LoraUnknown(
                    f"LoRA adapter {lora_name!r} of model {model!r} is not in the model config; "
                    "vLLM >= 0.31 hashes the adapter path, so add it under `loras`"
                )
        extras = BlockExtras(lora_name, path, cache_salt, mm_features)
        return self._catalog.hasher(model).keys(tokens, extras)

    def score(
        self,
        model: str,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_features: tuple[MmFeature, ...] = (),
        candidates: Collection[str] | None = None,
        max_hit_tokens: int | None = None,
    ) -> ScoreResult:
        """Every pod's cached prefix of ``tokens``, best first; ``candidates`` (normalised
        pod ids) restricts the answer and each candidate is listed even with no match.

        ``max_hit_tokens`` caps a hit as vLLM's ``max_cache_hit_length`` does (a new
        request is capped at ``len(tokens) - 1``, its last token recomputed for logits);
        by default nothing is capped. For a hybrid model the cap can change more than the
        last block: a sliding window's hit is searched from the cap leftwards."""
        keys = self.block_keys(model, tokens, lora_name, cache_salt, mm_features)
        return self.score_keys(
            model,
            keys,
            candidates=candidates,
            max_hit_tokens=max_hit_tokens,
            prompt_tokens=len(tokens),
        )

    def score_keys(
        self,
        model: str,
        keys: list[int],
        *,
        candidates: Collection[str] | None = None,
        max_hit_tokens: int | None = None,
        prompt_tokens: int | None = None,
    ) -> ScoreResult:
        """:meth:`score` for a prompt given as its block keys, block 0 first (the
        engine's published block hashes, for a model keyed by them): nothing is hashed.
        ``prompt_tokens`` defaults to the full blocks' tokens, all the keys can tell."""
        block_size = self._catalog.keying(model).hash.block_size
        if prompt_tokens is None:
            prompt_tokens = len(keys) * block_size
        max_length = prompt_tokens if max_hit_tokens is None else max(0, max_hit_tokens)
        result = ScoreResult(model, block_size, prompt_tokens, len(keys), keys=keys)
        layout = None if self._layouts is None else self._layouts.get(model)
        if layout is not None and _is_plain(layout):
            layout = None
        if layout is not None:
            reason = hybrid.unsupported_reason(layout, block_size)
            if reason is not None:
                result.warnings.append(
                    f"hybrid KV-cache hit not reproduced ({reason}): scores count KV group 0 only"
                )
                layout = None
        if not keys:
            matches = []
        elif layout is None:
            if max_hit_tokens is not None:
                keys = keys[: max_length // block_size]
            matches = self._backend.lookup(model, keys, candidates) if keys else []
        else:
            matches = self._hybrid_matches(model, keys, max_length, block_size, layout, candidates)
        self._add_scores(result, matches, block_size, in_order=layout is None)
        if candidates:
            seen = {p.pod for p in result.pods}
            result.pods.extend(
                PodScore(pod, 0, 0, 0, 0, 0, 0.0) for pod in sorted(set(candidates) - seen)
            )
        return result

    def _add_scores(
        self, result: ScoreResult, matches: list[MemberMatch], block_size: int, in_order: bool
    ) -> None:
        """Each match as a PodScore in ``result.pods``, best first (score, then matched
        blocks, descending, then pod). Runs for every pod of every request, so:

        A backend's lookup answers best first by blocks, then GPU blocks, then member
        (the IndexBackend contract). When every match is GPU-only, the score grows with
        the blocks, so that order *is* the answer's: it is checked in the same loop
        (``in_order`` says whether the matches come from a lookup at all) and the sort
        is skipped. A GPU-only score depends on the block count alone and comes from a
        table (no ``round`` per pod).
        """
        weights = self._weights
        w_gpu, w_cpu, w_storage = weights.gpu, weights.cpu, weights.storage
        gpu_scores = self._gpu_scores
        if matches and len(gpu_scores) <= matches[0].matched_blocks:
            gpu_scores = self._gpu_score_table(max(m.matched_blocks for m in matches))
        pods = result.pods
        append = pods.append
        ordered = in_order and w_gpu >= 0
        last_n, last_pod = -1, ""
        for match in matches:
            n = match.matched_blocks
            gpu, cpu, storage = match.by_tier
            pod = match.member
            if gpu == n and n < len(gpu_scores):
                score = gpu_scores[n]
            else:
                ordered = False  # (a hybrid answer may exceed the table: no order then)
                score = round(gpu * w_gpu + cpu * w_cpu + storage * w_storage, 6)
            if ordered and last_n >= 0 and (n > last_n or (n == last_n and pod < last_pod)):
                ordered = False
            last_n, last_pod = n, pod
            append(PodScore(pod, n, n * block_size, gpu, cpu, storage, score))
        if matches:
            result.best = matches[0].matched_blocks if ordered else None
        if not ordered:
            pods.sort(key=_answer_order)

    def _gpu_score_table(self, blocks: int) -> list[float]:
        """Scores of 0..``blocks`` GPU blocks (at least), grown by doubling; replaced in
        one assignment, so threads scoring at once each see a whole table."""
        table = self._gpu_scores
        size = max(blocks + 1, 2 * len(table), 64)
        w_gpu = self._weights.gpu
        table = table + [round(n * w_gpu, 6) for n in range(len(table), size)]
        self._gpu_scores = table
        return table

    def _hybrid_matches(
        self,
        model: str,
        keys: Sequence[int],
        max_length: int,
        block_size: int,
        layout: dict[int, GroupSpec],
        candidates: Collection[str] | None,
    ) -> list[MemberMatch]:
        """Each pod's hit under vLLM's hybrid rule, from one presence query per KV group.

        A group with blocks of ``s`` times the model's block size is probed on every
        ``s``-th key (vLLM 0.33 ``BlockHashListWithBlockSize``: the hash at a block's last
        hash-block boundary is that block's hash). Tier counts come from the first spec
        group in lookup order (full attention when there is one); blocks a window skips
        count as GPU (they cost nothing to reuse)."""
        steps = hybrid.plan(layout)
        answers: list[list[dict[str, MemberPresence]]] = []  # per spec group, per KV group
        for group in steps.groups:
            scale = group.spec.block_size // block_size
            view = keys[scale - 1 :: scale]
            answers.append(
                [
                    {
                        p.member: p
                        for p in self._backend.presence(group_model(model, g), view, candidates)
                    }
                    for g in group.group_ids
                ]
            )
        members = {member for per_group in answers for found in per_group for member in found}
        held: dict[str, list[int]] = {}
        tiers: dict[str, tuple[int, int, int]] = {}
        for member in members:
            masks = []
            for per_group in answers:
                mask = -1  # cached in every KV group of the spec group (get_cached_block)
                for found in per_group:
                    presence = found.get(member)
                    mask &= 0 if presence is None else presence.held
                masks.append(mask)
            held[member] = masks
            first_found = answers[0][0].get(member)
            if first_found is not None:
                tiers[member] = first_found.by_tier
        out = []
        first = steps.groups[0].spec.block_size
        for member, masks in held.items():
            tokens = hybrid.find_longest_cache_hit(steps, masks, max_length)
            if tokens <= 0:
                continue
            blocks = tokens // block_size
            scale = first // block_size
            low = (1 << (tokens // first)) - 1
            gpu, cpu, storage = tiers.get(member, (0, 0, 0))
            on_cpu = (cpu & ~gpu & low).bit_count() * scale
            on_storage = (storage & ~gpu & ~cpu & low).bit_count() * scale
            out.append(
                MemberMatch(member, blocks, (blocks - on_cpu - on_storage, on_cpu, on_storage))
            )
        return out


def _answer_order(p: PodScore) -> tuple[float, int, str]:
    return (-p.score, -p.matched_blocks, p.pod)


def _is_plain(layout: dict[int, GroupSpec]) -> bool:
    """A single full-attention group at index 0: the plain longest-prefix rule applies."""
    spec = layout.get(0)
    return len(layout) == 1 and spec is not None and spec.is_full_attention

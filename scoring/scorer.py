"""Token ids to per-pod cached-prefix scores.

A pod can reuse only the *leading* blocks of a prompt it already holds (vLLM's prefix
cache is a hash chain), so a pod's answer is its longest consecutive cached prefix:
``matched_blocks``, how many of those sit in each tier, and a tier-weighted ``score``
(a block in CPU memory must be copied back before use and is worth less than one on
the GPU).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import msgspec

from kvindex.indexer.backend import IndexBackend, Tier
from kvindex.indexer.keys import BlockExtras, KeyConfigError
from kvindex.indexer.models import KeyMode, ModelCatalog
from kvindex.indexer.token_keys import ContentHasher


@dataclass(frozen=True, slots=True)
class TierWeights:
    """What one cached block is worth per tier, relative to recomputing it (0)."""

    gpu: float = 1.0
    cpu: float = 0.8
    storage: float = 0.5

    def of(self, tier: Tier) -> float:
        return (self.gpu, self.cpu, self.storage)[tier]


class PodScore(msgspec.Struct, gc=False):
    """One pod's answer; also the element of /score's JSON answer, as is."""

    pod: str
    matched_blocks: int
    matched_tokens: int
    gpu_blocks: int
    cpu_blocks: int
    storage_blocks: int
    score: float


@dataclass(slots=True)
class ScoreResult:
    model: str
    block_size: int
    prompt_tokens: int
    prompt_blocks: int
    pods: list[PodScore] = field(default_factory=list)

    @property
    def best_matched_blocks(self) -> int:
        return max((p.matched_blocks for p in self.pods), default=0)


class LoraUnknown(KeyConfigError):
    """A LoRA adapter whose path the model config does not give (vLLM >= 0.31 hashes it)."""


class Scorer:
    """Scores prompts against an index backend."""

    def __init__(
        self, backend: IndexBackend, catalog: ModelCatalog, weights: TierWeights | None = None
    ) -> None:
        self._backend = backend
        self._catalog = catalog
        self._weights = weights or TierWeights()
        self._content: dict[int, ContentHasher] = {}

    def block_keys(
        self,
        model: str,
        tokens: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """The index keys of every full block of ``tokens`` for ``model``."""
        keying = self._catalog.keying(model)
        if keying.key_mode is KeyMode.TOKENS:
            size = keying.hash.block_size
            hasher = self._content.get(size)
            if hasher is None:
                hasher = self._content[size] = ContentHasher(size)
            return hasher.keys(tokens, BlockExtras(lora_name, None, cache_salt))
        path = None
        if lora_name is not None:
            path = keying.lora_path(lora_name)
            if path is None and keying.hash.extra_key_style == "tagged":
                raise LoraUnknown(
                    f"LoRA adapter {lora_name!r} of model {model!r} is not in the model config; "
                    "vLLM >= 0.31 hashes the adapter path, so add it under `loras`"
                )
        return self._catalog.hasher(model).keys(tokens, BlockExtras(lora_name, path, cache_salt))

    def score(
        self,
        model: str,
        tokens: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        candidates: Collection[str] | None = None,
    ) -> ScoreResult:
        """Every pod's cached prefix of ``tokens``, best first; ``candidates`` (normalised
        pod ids) restricts the answer and each candidate is listed even with no match."""
        keys = self.block_keys(model, tokens, lora_name, cache_salt)
        block_size = self._catalog.keying(model).hash.block_size
        result = ScoreResult(model, block_size, len(tokens), len(keys))
        matches = [] if not keys else self._backend.lookup(model, keys, candidates)
        weights = self._weights
        w_gpu, w_cpu, w_storage = weights.gpu, weights.cpu, weights.storage
        for match in matches:
            gpu, cpu, storage = match.by_tier
            result.pods.append(
                PodScore(
                    match.member,
                    match.matched_blocks,
                    match.matched_blocks * block_size,
                    gpu,
                    cpu,
                    storage,
                    round(gpu * w_gpu + cpu * w_cpu + storage * w_storage, 6),
                )
            )
        result.pods.sort(key=lambda p: (-p.score, -p.matched_blocks, p.pod))
        if candidates:
            seen = {p.pod for p in result.pods}
            result.pods.extend(
                PodScore(pod, 0, 0, 0, 0, 0, 0.0) for pod in sorted(set(candidates) - seen)
            )
        return result

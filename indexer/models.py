"""Per-model keying settings: how each model's block keys are made.

Block size, hash algorithm, seed and extra-key style are properties of the engines
serving a model, so they are configured per model with global defaults. The catalog is
built once by the composition root from CLI flags and the model config file.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvindex.indexer.keys import BlockHasher, HashConfig, KeyConfigError


class KeyMode(enum.StrEnum):
    """What the index is keyed by.

    ``engine``: the engine's own block hashes (the default). Scores are exact and
    events need nothing but their hashes, but kvindex must reproduce the pods' hash
    configuration, which the ingest check verifies.

    ``tokens``: kvindex's own hash chain over each event's ``token_ids``. Choose it only
    when the engines' hashes cannot be reproduced (xxhash with PYTHONHASHSEED unset, a
    custom hash); it needs token ids in every BlockStored (vLLM >= 0.9 sends them) and
    keeps an engine-hash -> own-key map per pod so removals still resolve, which costs
    memory per cached block per pod (bench/README.md).
    """

    ENGINE = "engine"
    TOKENS = "tokens"


class Engine(enum.StrEnum):
    """An engine that serves a model's pods, for what its events allow.

    ``vllm``: hashes kvindex reproduces (``key_mode: engine`` works). ``sglang``: signed,
    opaque hashes (a SHA-256 page chain kvindex does not recompute) and its own event
    layouts (:mod:`kvindex.events.wire.sglang`). ``trtllm``: TensorRT-LLM's streaming events,
    vLLM's format (decoded as vLLM's) with hashes of its own block manager. Any engine but
    vLLM needs ``key_mode: tokens``, which is what lets pods of different engines share
    one model's keys.
    """

    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


#: Engines whose block hashes kvindex reproduces.
HASH_COMPATIBLE = frozenset({Engine.VLLM})


class ReportMode(enum.StrEnum):
    """How the model's clients ask vLLM to report cache hits (``kv_cache_report_mode``
    in a request's ``SamplingParams.extra_args``, vLLM 0.33).

    ``incremental`` (vLLM's default): every ``BlockStored`` is a new physical copy, so
    every store adds a copy and the index equals the engine's cache map exactly.

    ``full``: some requests also re-announce the blocks their prompt hit, as a
    ``BlockStored`` from the root of the chain built exactly like a real store and never
    matched by a removal. A store from the root is then taken as an announcement (held
    at least once, no copy added), so nothing is over-counted; the price is that a real
    second copy stored from the root (a one-block prompt sent twice, a request that skips
    the prefix cache, a hybrid model re-storing after a shorter combined hit) is not
    counted and its first eviction drops the hash early.
    """

    INCREMENTAL = "incremental"
    FULL = "full"


@dataclass(frozen=True, slots=True)
class ModelKeying:
    """How one model's keys are made."""

    hash: HashConfig = field(default_factory=HashConfig)
    key_mode: KeyMode = KeyMode.ENGINE
    loras: Mapping[str, str] = field(default_factory=dict)  # adapter name -> path
    report_mode: ReportMode = ReportMode.INCREMENTAL
    engines: frozenset[Engine] = frozenset({Engine.VLLM})

    def lora_path(self, name: str) -> str | None:
        return self.loras.get(name)


class ModelCatalog:
    """Keying settings per model, falling back to the global default.

    Hashers are built lazily and shared, so their memo of recently hashed blocks serves
    both ingest checks and scoring.
    """

    def __init__(
        self, default: ModelKeying | None = None, models: Mapping[str, ModelKeying] | None = None
    ) -> None:
        self.default = default or ModelKeying()
        self._models = dict(models or {})
        self._hashers: dict[str, BlockHasher] = {}
        for name, keying in {"(default)": self.default, **self._models}.items():
            foreign = sorted(keying.engines - HASH_COMPATIBLE)
            if keying.key_mode is KeyMode.ENGINE and foreign:
                raise KeyConfigError(
                    f"model {name!r}: {', '.join(foreign)} pods publish block hashes kvindex "
                    "cannot reproduce, so its keys could not agree with theirs or with "
                    "other engines' pods; set key_mode: tokens"
                )
        for name, keying in self._models.items():
            if keying.key_mode is KeyMode.ENGINE and not keying.hash.reproducible:
                raise KeyConfigError(
                    f"model {name!r}: {keying.hash.algo.value} with no seed cannot be "
                    "reproduced; set hash_seed (the pods' PYTHONHASHSEED) or key_mode: tokens"
                )

    def configured(self) -> list[str]:
        return sorted(self._models)

    def models_with(self, engine: Engine) -> list[str]:
        """Configured models some of whose pods run ``engine``."""
        return sorted(name for name, k in self._models.items() if engine in k.engines)

    def is_configured(self, model: str) -> bool:
        return model in self._models

    def keying(self, model: str) -> ModelKeying:
        return self._models.get(model, self.default)

    def hasher(self, model: str) -> BlockHasher:
        """The engine-hash chain builder for ``model`` (raises KeyConfigError when the
        model's configuration cannot reproduce engine hashes)."""
        hasher = self._hashers.get(model)
        if hasher is None:
            hasher = BlockHasher(self.keying(model).hash)
            self._hashers[model] = hasher
        return hasher

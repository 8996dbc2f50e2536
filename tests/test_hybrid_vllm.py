"""kvindex's hybrid hit equals vLLM 0.33's own, on the events vLLM's own code publishes.

``tests/hybrid_vllm_driver.py`` runs vLLM's real ``KVCacheManager`` (hybrid
coordinator, block pool, request hashing; CPU only, no model) under an interpreter
that has vLLM, and records every KV-event batch it publishes and, after each batch,
what ``get_computed_blocks`` (and the uncapped ``find_longest_cache_hit``) returns for
probe prompts. Here each batch goes through kvindex's decoder and ingestor into the
memory backend, and every probe's ``/score`` answer must equal vLLM's hit.

The interpreter is ``KVTEST_VLLM_PYTHON``, else the checkout's ``.venv-vllm``;
without one the tests skip and say why.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest

from kvindex.events.ingest.sink import Delivery
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.vllm import BatchDecoder
from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.keys import HashConfig
from kvindex.indexer.kv_groups import group_model
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import ModelCatalog, ModelKeying
from kvindex.scoring.scorer import Scorer
from tests.support.vllm import vllm_python

# vLLM's own code runs in a subprocess: seconds each, outside the everyday subset.
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("hybrid_vllm_driver.py")
MODEL = "hybrid-model"
POD = StreamId("127.0.0.1:8000")


CONFIGS = ["full+window", "full+window+window", "full+window+wide", "full16+window32", "window"]


@pytest.fixture(scope="module")
def recorded() -> dict:
    """One driver run for every config (importing vLLM costs most of it)."""
    python = vllm_python()
    if python is None:
        pytest.skip("no vLLM interpreter: set KVTEST_VLLM_PYTHON to a Python with vllm 0.33")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    done = subprocess.run(
        [python, str(DRIVER), "1", "60", *CONFIGS],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-5:]
        if any("ModuleNotFoundError" in line or "ImportError" in line for line in tail):
            pytest.skip(f"{python} cannot import vLLM's core: {tail[-1]}")
        raise AssertionError(f"driver failed ({done.returncode}):\n" + "\n".join(tail))
    return json.loads(done.stdout)


class Replica:
    """kvindex fed with one recorded run: the ingestor on vLLM's events, and a second
    backend holding exactly vLLM's own cache map (step by step), both scored with the
    layout the ingestor learned from the events."""

    def __init__(self, run: dict) -> None:
        self.run = run
        self.catalog = ModelCatalog(ModelKeying(hash=HashConfig(block_size=run["hash_block_size"])))
        self.backend = MemoryBackend()
        self.ingestor = Ingestor(self.backend, self.catalog)
        self.scorer = Scorer(self.backend, self.catalog, layouts=self.ingestor.layouts)
        self.mirror = MemoryBackend()
        self.mirror_scorer = Scorer(self.mirror, self.catalog, layouts=self.ingestor.layouts)
        self._decode = BatchDecoder().decode
        self._mirrored: dict[str, set[int]] = {}

    def apply(self, seq: int, step: dict) -> None:
        batch = self._decode(base64.b64decode(step["payload"])).batch
        self.ingestor.deliver([Delivery(POD, MODEL, seq, batch, 0.0)])
        changes = []
        for group in set(step["cached"]) | set(self._mirrored):
            now = set(step["cached"].get(group, ()))
            before = self._mirrored.get(group, set())
            target = group_model(MODEL, int(group))
            if now - before:
                changes.append(Change(Op.STORE, POD.member, target, Tier.GPU, sorted(now - before)))
            if before - now:
                changes.append(
                    Change(Op.REMOVE, POD.member, target, Tier.GPU, sorted(before - now))
                )
            self._mirrored[group] = now
        if changes:
            self.mirror.apply(changes)

    def groups_equal_vllm(self, step: dict) -> bool:
        return all(
            self.backend.member_keys(POD.member, group_model(MODEL, int(group))) == hashes
            for group, hashes in step["cached"].items()
        )


def hit(scorer: Scorer, tokens: list[int], cap: int | None = None) -> int:
    result = scorer.score(MODEL, tokens, max_hit_tokens=cap)
    return max((p.matched_tokens for p in result.pods), default=0)


@pytest.mark.parametrize("config", CONFIGS)
def test_hit_rule_equals_vllm_on_its_own_cache_map(recorded: dict, config: str) -> None:
    """The hit rule, exactly: kvindex holding vLLM's own cache map answers every probe
    as vLLM does, capped (``get_computed_blocks``) and uncapped, through evictions."""
    replica = Replica(recorded[config])
    hits = probes = 0
    for seq, step in enumerate(replica.run["steps"]):
        replica.apply(seq, step)
        for probe in step["probes"]:
            tokens = probe["tokens"]
            got = (
                hit(replica.mirror_scorer, tokens),
                hit(replica.mirror_scorer, tokens, len(tokens) - 1),
            )
            want = (probe["uncapped"], probe["capped"])
            assert got == want, f"step {seq}, {len(tokens)} tokens: kvindex {got}, vLLM {want}"
            probes += 1
            hits += probe["capped"] > 0
    # the workload exercised hits, misses and evictions
    assert probes // 10 < hits < probes
    assert replica.ingestor.counts.blocks_removed > 0


@pytest.mark.parametrize("config", CONFIGS)
def test_events_ingested_then_scored_equal_vllm(recorded: dict, config: str) -> None:
    """End to end: vLLM's published events through kvindex's decoder and ingestor give
    every KV group's block set and every probe's hit exactly as vLLM has them.

    A hybrid model re-stores from block 0 whenever a request's combined hit is shorter
    than its full-attention group's: under report mode ``incremental`` (the default)
    those root stores are copies, so evicting one copy keeps the block.
    """
    replica = Replica(recorded[config])
    for seq, step in enumerate(replica.run["steps"]):
        replica.apply(seq, step)
        for group, hashes in step["cached"].items():
            mine = set(replica.backend.member_keys(POD.member, group_model(MODEL, int(group))))
            extra = mine - set(hashes)
            assert not extra, f"step {seq}, KV group {group}: {len(extra)} blocks vLLM lacks"
            missing = set(hashes) - mine
            assert not missing, f"step {seq}, KV group {group}: {len(missing)} blocks missing"
        for probe in step["probes"]:
            tokens = probe["tokens"]
            got = (hit(replica.scorer, tokens), hit(replica.scorer, tokens, len(tokens) - 1))
            want = (probe["uncapped"], probe["capped"])
            assert got == want, f"step {seq}, {len(tokens)} tokens: kvindex {got}, vLLM {want}"
    assert replica.ingestor.counts.skipped["other_kv_group"] == 0
    assert replica.ingestor.layouts.conflicts == 0

"""Offload tiers against vLLM's own connector code: the index's CPU and STORAGE tiers
equal what the pod's own tiers hold.

``tests/vllm_offload_driver.py`` runs vLLM 0.33's ``OffloadingEventsTracker`` (the
offloading connector's translation of tier events into KV events; CPU, no model) in an
interpreter that has vLLM and prints each step's batch, encoded by vLLM's own encoder,
with the block hashes each medium's LOCAL residencies hold afterwards. Here every batch
goes through kvindex's decoder and Ingestor into each backend, and after every step the
member's CPU and STORAGE keys must equal that truth. The steps cover what the decisions
in indexer/ingest.py rest on:

* ``ownership`` is ignored: one chunk held by the primary CPU tier and by KVCR's CPU
  inventory (ownership ``"kvcr"``) is two residencies, each stored and removed on its
  own, so counting copies per (member, hash, tier) keeps the block while either holds it;
* ``locality="REMOTE"`` stores (shared network storage) are not indexed;
* placeholder stores (the connector's default: ``block_size`` 0, no tokens) carry the
  chunk's hash, the GPU block hash when a chunk is one block; self-describing stores
  carry every block of a chunk.

Skips when no such interpreter is there, except under ``CI=true``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from kvindex.events.ingest.sink import Delivery
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.vllm import BatchDecoder
from kvindex.indexer.backend import IndexBackend, Tier
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import ModelCatalog, ModelKeying
from tests.redis_fixtures import redis_backend_factory
from tests.support.vllm import run_vllm_driver

pytestmark = pytest.mark.slow  # vLLM's own code runs in a subprocess

DRIVER = Path(__file__).with_name("vllm_offload_driver.py")
MODEL = "m"
POD = StreamId("127.0.0.1:8000")


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    return run_vllm_driver(DRIVER, timeout_s=300)


BACKENDS: dict[str, Callable[[pytest.FixtureRequest], IndexBackend]] = {
    "memory": lambda request: MemoryBackend(),
    "redis": redis_backend_factory,
}


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_offload_tiers_equal_the_pods_own(
    kind: str, steps: list[dict], request: pytest.FixtureRequest
) -> None:
    backend = BACKENDS[kind](request)
    try:
        decoder = BatchDecoder()
        phase = None
        seen = {"kvcr": 0, "placeholder": 0, "remote": 0, "cpu_shared": 0}
        for seq, step in enumerate(steps):
            if step["phase"] != phase:  # each phase is a fresh engine
                phase = step["phase"]
                ingestor = Ingestor(backend, ModelCatalog(ModelKeying()))
                ingestor.reset(POD, "engine_restart")
            payload = base64.b64decode(step["payload"])
            for event in msgspec.msgpack.decode(payload)[1]:  # as the engine sent them
                seen["kvcr"] += event.get("ownership") == "kvcr"
                seen["placeholder"] += event.get("block_size") == 0
                seen["remote"] += event.get("locality") == "REMOTE"
            seen["cpu_shared"] += step["cpu_shared"]
            ingestor.deliver([Delivery(POD, MODEL, seq, decoder.decode(payload).batch, 0.0)])
            for tier, truth in ((Tier.CPU, step["cpu"]), (Tier.STORAGE, step["storage"])):
                held = set(backend.member_keys(POD.member, MODEL, tier))
                assert held == set(truth), (
                    f"{phase} step {seq} {tier.label}: {len(held - set(truth))} indexed "
                    f"but not held, {len(set(truth) - held)} held but not indexed"
                )
        # The steps proved something: each case happened.
        assert {s["phase"] for s in steps} == {"placeholder", "self-describing"}
        assert all(seen.values()), seen
    finally:
        backend.close()

"""Copy counts against real vLLM: the index equals each engine's prefix-cache map.

``tests/vllm_copies_driver.py`` runs vLLM 0.33's own ``KVCacheManager`` (CPU, no model)
in an interpreter that has vLLM (``KVTEST_VLLM_PYTHON``, else
the checkout's ``.venv-vllm``) and prints each step's event batch, encoded by vLLM's own
encoder, with the hashes its ``cached_block_hash_to_block`` holds afterwards. Here
every batch goes through kvindex's decoder and Ingestor into each backend, and after
every step the member's keys must equal that truth, with the model's
``kv_cache_report_mode`` set as its clients send (``incremental`` phases, the one-block
duplicate included, and ``full`` for full and mixed traffic). Skips when no such
interpreter is there.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path

import pytest

from kvindex.events.ingest.sink import Delivery
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.vllm import BatchDecoder
from kvindex.indexer.backend import IndexBackend
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import ModelCatalog, ModelKeying, ReportMode
from tests.redis_fixtures import redis_backend_factory
from tests.support.vllm import run_vllm_driver

# vLLM's own code runs in a subprocess: seconds each, outside the everyday subset.
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("vllm_copies_driver.py")
MODEL = "m"
POD = StreamId("127.0.0.1:8000")


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    """The driver's output (one run for every backend: importing vLLM takes a while)."""
    return run_vllm_driver(DRIVER, "--rounds", "250", timeout_s=600)


BACKENDS: dict[str, Callable[[pytest.FixtureRequest], IndexBackend]] = {
    "memory": lambda request: MemoryBackend(),
    "redis": redis_backend_factory,
}


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_index_equals_the_engines_cache_map(
    kind: str, steps: list[dict], request: pytest.FixtureRequest
) -> None:
    backend = BACKENDS[kind](request)
    try:
        decoder = BatchDecoder()
        phase, checked = None, 0
        for seq, step in enumerate(steps):
            if step["phase"] != phase:  # each phase is a fresh engine
                phase = step["phase"]
                # The model's kv_cache_report_mode says what its clients send.
                mode = ReportMode.FULL if "full" in phase else ReportMode.INCREMENTAL
                ingestor = Ingestor(backend, ModelCatalog(ModelKeying(report_mode=mode)))
                ingestor.reset(POD, "engine_restart")
            batch = decoder.decode(base64.b64decode(step["payload"])).batch
            ingestor.deliver([Delivery(POD, MODEL, seq, batch, 0.0)])
            held = set(backend.member_keys(POD.member, MODEL))
            truth = set(step["truth"])
            assert not held - truth, f"{phase} step {seq}: indexed but not cached"
            assert held == truth, f"{phase} step {seq}: cached but not indexed"
            checked += 1
        assert checked == len(steps) > 700
        assert {s["phase"] for s in steps} == {
            "minimal",
            "incremental",
            "incremental+full",
            "full",
            "one-block",
        }
    finally:
        backend.close()

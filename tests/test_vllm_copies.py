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
import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from kvindex.events.identity import StreamId
from kvindex.events.sink import Delivery
from kvindex.events.wire import BatchDecoder
from kvindex.indexer.backend import IndexBackend
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.memory import MemoryBackend
from kvindex.indexer.models import ModelCatalog, ModelKeying, ReportMode
from tests.redis_fixtures import redis_backend_factory
from tests.support.vllm import vllm_python

# vLLM's own code runs in a subprocess: seconds each, outside the everyday subset.
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("vllm_copies_driver.py")
MODEL = "m"
POD = StreamId("127.0.0.1:8000")


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    """The driver's output (one run for every backend: importing vLLM takes a while)."""
    python = vllm_python()
    if python is None or not Path(python).exists():
        pytest.skip(f"no vLLM interpreter at {python} (set KVTEST_VLLM_PYTHON)")
    try:
        done = subprocess.run(
            [python, str(DRIVER), "--rounds", "250"],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the vLLM driver ran past 600 s")
    if done.returncode != 0 and "ModuleNotFoundError" in done.stderr:
        pytest.skip(f"{python} cannot import vLLM: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


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

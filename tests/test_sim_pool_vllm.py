"""The simulator's block pool against vLLM 0.33's own ``BlockPool``, step by step.

``tests/vllm_pool_driver.py`` drives vLLM's ``BlockPool`` (CPU, no model) in an
interpreter that has vLLM (``KVTEST_VLLM_PYTHON``, else the checkout's ``.venv-vllm``)
and prints every admission and release with vLLM's events and cached hashes. Here each
step is replayed on ``bench/sim/pool.py``: the same hit, the same block ids, the same
events (duplicate copies, root copies and their evictions included) and the same cached
hashes, which the pool's event view must equal too. Skips when no such interpreter is
there.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sim.pool import BlockPool
from kvindex.events.wire.vllm import BlockRemoved, BlockStored
from tests.support.vllm import run_vllm_driver

# vLLM's own code runs in a subprocess: seconds, outside the everyday subset.
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("vllm_pool_driver.py")
BLOCK = 4  # the driver's block size
BLOCKS = 12


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    return run_vllm_driver(DRIVER, "--steps", "600", "--blocks", str(BLOCKS), timeout_s=300)


def plain(event: object) -> list[object]:
    """The driver's form of an event."""
    if isinstance(event, BlockStored):
        return [
            "stored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["removed", list(event.block_hashes), event.medium]
    return [type(event).__name__]


def test_the_pool_does_what_vllms_block_pool_does(steps: list[dict]) -> None:
    pool = BlockPool(BLOCKS, BLOCK)
    running: dict[int, list[int]] = {}
    root_copies = 0  # requests that store a cached root hash again (a one-block prompt)
    for n, step in enumerate(steps):
        where = f"step {n} ({step['op']} r{step['rid']})"
        if step["op"] == "free":
            pool.release(running.pop(step["rid"]))
        else:
            keys, tokens = step["keys"], step["tokens"]
            limit = min((len(tokens) - 1) // BLOCK, len(keys))
            hit = pool.match(keys[:limit])
            assert hit == step["hit"], where
            root_copies += not hit and step["full"] > 0 and pool.match(keys[:1]) == 1
            blocks = pool.touch(keys[:hit]) + pool.allocate(step["new"])
            assert blocks == [b - 1 for b in step["blocks"]], where  # vLLM's null block is 0
            pool.cache(blocks, keys, hit, step["full"], tokens)
            running[step["rid"]] = blocks
        assert [plain(e) for e in pool.drain_events()] == step["events"], where
        assert pool.cached_keys() == set(step["cached"]), where
        assert pool.event_view() == pool.cached_keys(), where
    # The mix must have reached the cases the pool is checked for.
    admissions = [s for s in steps if s["op"] == "admit"]
    assert len(admissions) > 300
    assert pool.evictions > 100
    assert pool.duplicate_stores > 10
    assert root_copies > 5

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

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.sim.pool import BlockPool
from kvindex.events.wire import BlockRemoved, BlockStored
from tests.support.vllm import vllm_python

# vLLM's own code runs in a subprocess: seconds, outside the everyday subset.
pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("vllm_pool_driver.py")
BLOCK = 4  # the driver's block size
BLOCKS = 12


@pytest.fixture(scope="module")
def steps() -> list[dict]:
    python = vllm_python()
    if python is None or not Path(python).exists():
        pytest.skip(f"no vLLM interpreter at {python} (set KVTEST_VLLM_PYTHON)")
    try:
        done = subprocess.run(
            [python, str(DRIVER), "--steps", "600", "--blocks", str(BLOCKS)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the vLLM driver ran past 300 s")
    if done.returncode != 0 and "ModuleNotFoundError" in done.stderr:
        pytest.skip(f"{python} cannot import vLLM: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


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

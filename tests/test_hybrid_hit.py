"""The hybrid hit rule (kvindex.scoring.hybrid), case by case, as vLLM 0.33 defines it.

``tests/test_hybrid_vllm.py`` checks the same rule against vLLM's own managers; these
cases pin each step by hand (including Mamba, which that driver does not run) and the
scorer's use of it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvindex.events.ingest.sink import Delivery
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.vllm import BlockRemoved, BlockStored, EventBatch
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.keys import BlockHasher, HashConfig
from kvindex.indexer.kv_groups import GroupSpec, KvLayouts, group_model
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.snapshot_file import read_snapshot, write_snapshot
from kvindex.indexer.models import ModelCatalog
from kvindex.scoring import hybrid
from kvindex.scoring.scorer import Scorer

FULL = GroupSpec("full_attention", None, 16)
SWA = GroupSpec("sliding_window", 48, 16)  # needs cdiv(47, 16) = 3 blocks in a row
MAMBA = GroupSpec("mamba", None, 16)


def mask(*blocks: int) -> int:
    return sum(1 << b for b in blocks)


def upto(n: int) -> int:
    return (1 << n) - 1


# -- one group's rule -----------------------------------------------------------------------


def test_full_attention_is_the_leading_run_within_the_cap_rounded_to_alignment() -> None:
    assert hybrid.full_attention_hit(mask(0, 1, 2, 4), 16, 1000, 16) == 48
    assert hybrid.full_attention_hit(upto(8), 16, 100, 16) == 96  # 100 // 16 = 6 blocks
    assert hybrid.full_attention_hit(upto(5), 16, 1000, 32) == 64  # 80 rounded down to 32s
    assert hybrid.full_attention_hit(0, 16, 1000, 16) == 0


def test_sliding_window_scans_from_the_cap_leftwards() -> None:
    # vLLM's docstring example: block 4, window 8 -> 2 blocks; [NULL, NULL, 7, 8] hits 4
    assert hybrid.sliding_window_hit(mask(2, 3), 4, 8, 16, 4) == 16
    # the rightmost run of 3 within the cap wins, whatever lies before it
    assert hybrid.sliding_window_hit(mask(1, 4, 5, 6, 9), 16, 48, 160, 16) == 112
    # the cap moves the scan: blocks 0-9 held, cap 100 tokens -> blocks 0-5
    assert hybrid.sliding_window_hit(upto(10), 16, 48, 100, 16) == 96
    # a run shorter than the window only counts when it starts at block 0
    assert hybrid.sliding_window_hit(mask(0, 1, 5, 6), 16, 48, 160, 16) == 32
    assert hybrid.sliding_window_hit(mask(1, 2, 5, 6), 16, 48, 160, 16) == 0


def test_sliding_window_alignment_skips_a_misaligned_run_end() -> None:
    # alignment 32 (another group has 32-token blocks): a run may not end at block 4
    # (80 tokens), so the scan restarts left of it
    assert hybrid.sliding_window_hit(upto(5), 16, 48, 80, 32) == 64
    # the leading run is trimmed to the alignment
    assert hybrid.sliding_window_hit(mask(0, 1, 2), 16, 64, 48, 32) == 32


def test_mamba_takes_the_last_aligned_state_within_the_cap() -> None:
    assert hybrid.mamba_hit(mask(1, 6), 16, 1000, 16) == 112
    assert hybrid.mamba_hit(mask(1, 6), 16, 100, 16) == 32
    assert hybrid.mamba_hit(mask(1, 4), 16, 1000, 32) == 32  # block 4 ends at 80: not aligned
    assert hybrid.mamba_hit(0, 16, 1000, 16) == 0


# -- the coordinator -----------------------------------------------------------------------


def test_plan_merges_equal_specs_and_puts_full_attention_first() -> None:
    steps = hybrid.plan({0: SWA, 1: FULL, 2: SWA, 3: GroupSpec("full_attention", None, 32)})
    assert [g.group_ids for g in steps.groups] == [(1,), (3,), (0, 2)]
    assert steps.alignment_tokens == 32 and not steps.unitary
    assert hybrid.plan({0: SWA}).unitary


def test_simple_hybrid_is_one_pass() -> None:
    steps = hybrid.plan({0: FULL, 1: SWA})
    # full attention holds 8 blocks; the window's last run of 3 ends at block 5
    assert hybrid.find_longest_cache_hit(steps, [upto(8), mask(3, 4, 5, 7)], 128) == 96
    # the window holds nothing at the end -> its fallback (leading run) decides
    assert hybrid.find_longest_cache_hit(steps, [upto(8), mask(0, 1)], 128) == 32
    # full attention bounds everything
    assert hybrid.find_longest_cache_hit(steps, [upto(2), upto(8)], 128) == 32


def test_three_spec_groups_iterate_to_a_fixed_point() -> None:
    wide = GroupSpec("sliding_window", 80, 16)  # 5 blocks in a row
    steps = hybrid.plan({0: FULL, 1: SWA, 2: wide})
    # pass 1: full 10 blocks; window(3) -> ends at 10; wide(5) -> run 2..6 ends at 7.
    # pass 2: window(3) with cap 7 blocks: blocks 4..6 -> 7; wide again -> 7. Fixed.
    held = [upto(10), mask(4, 5, 6, 7, 8, 9), mask(2, 3, 4, 5, 6, 9)]
    assert hybrid.find_longest_cache_hit(steps, held, 160) == 112
    # pass 2 shortens again: the window's tail below block 7 has a hole at 5
    held = [upto(10), mask(3, 4, 6, 7, 8, 9), mask(2, 3, 4, 5, 6, 9)]
    # window cap 7 blocks: 6 alone, then hole 5 -> run 3,4 ... none of 3 -> leading run 0
    assert hybrid.find_longest_cache_hit(steps, held, 160) == 0


def test_unitary_sliding_window_is_one_call() -> None:
    steps = hybrid.plan({0: SWA})
    assert hybrid.find_longest_cache_hit(steps, [mask(4, 5, 6)], 160) == 112


def test_full_attention_with_mamba() -> None:
    steps = hybrid.plan({0: FULL, 1: MAMBA})
    assert hybrid.find_longest_cache_hit(steps, [upto(8), mask(2, 5)], 128) == 96
    assert hybrid.find_longest_cache_hit(steps, [upto(4), mask(2, 5)], 128) == 48
    assert hybrid.find_longest_cache_hit(steps, [upto(8), 0], 128) == 0


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        ({0: FULL, 1: GroupSpec("chunked_local_attention", None, 16)}, "not supported"),
        ({0: FULL, 1: GroupSpec("sliding_window", None, 16)}, "without a window size"),
        ({0: FULL, 1: GroupSpec("sliding_window", 48, 0)}, "not announced its block size"),
        ({0: FULL, 1: GroupSpec("sliding_window", 48, 24)}, "not a multiple"),
        ({0: FULL, 1: GroupSpec("mamba", None, 64)}, "fine-grained"),
    ],
)
def test_layouts_kvindex_cannot_reproduce_are_named(layout: dict, reason: str) -> None:
    found = hybrid.unsupported_reason(layout, 16)
    assert found is not None and reason in found
    assert hybrid.unsupported_reason({0: FULL, 1: SWA, 2: MAMBA}, 16) is None


# -- through the ingestor and the scorer ---------------------------------------------------

TOKENS = list(range(500, 500 + 16 * 8))
KEYS = BlockHasher(HashConfig()).keys(TOKENS)
POD = StreamId("127.0.0.1:8000")


class Pipeline:
    def __init__(self) -> None:
        self.catalog = ModelCatalog()
        self.backend = MemoryBackend()
        self.ingestor = Ingestor(self.backend, self.catalog, layouts=KvLayouts())
        self.scorer = Scorer(self.backend, self.catalog, layouts=self.ingestor.layouts)
        self.seq = 0

    def send(self, *events: object) -> None:
        batch = EventBatch(0.0, list(events))
        self.ingestor.deliver([Delivery(POD, "m", self.seq, batch, 0.0)])
        self.seq += 1


def store(blocks: range, group: int, kind: str, **kw: object) -> BlockStored:
    first, last = blocks.start, blocks.stop
    parent = KEYS[first - 1] if first else None
    return BlockStored(
        KEYS[first:last],
        parent,
        TOKENS[first * 16 : last * 16],
        16,
        group_idx=group,
        kv_cache_spec_kind=kind,
        **kw,
    )


def test_scorer_reports_the_mamba_hybrid_hit_per_pod() -> None:
    p = Pipeline()
    p.send(store(range(8), 0, "full_attention"), store(range(8), 1, "mamba"))
    p.send(BlockRemoved(KEYS[3:8], group_idx=1))  # Mamba keeps states 0-2 only
    result = p.scorer.score("m", TOKENS)
    assert [(s.pod, s.matched_blocks, s.matched_tokens) for s in result.pods] == [
        (POD.member, 3, 48)
    ]
    assert result.warnings == []
    assert p.backend.member_keys(POD.member, group_model("m", 1)) == sorted(KEYS[:3])


def test_scorer_offloaded_blocks_keep_their_tier_in_a_hybrid_hit() -> None:
    p = Pipeline()
    window = {"kv_cache_spec_sliding_window": 48}
    p.send(store(range(6), 0, "full_attention"), store(range(6), 1, "sliding_window", **window))
    p.send(BlockStored(KEYS[:2], None, [], 0, medium="CPU", group_idx=0))
    p.send(BlockRemoved(KEYS[:2], medium="GPU", group_idx=0))
    [score] = p.scorer.score("m", TOKENS).pods
    assert (score.matched_blocks, score.gpu_blocks, score.cpu_blocks) == (6, 4, 2)


def test_scorer_warns_and_falls_back_when_the_layout_is_not_reproducible() -> None:
    p = Pipeline()
    p.send(store(range(8), 0, "full_attention"), store(range(2), 1, "chunked_local_attention"))
    result = p.scorer.score("m", TOKENS)
    assert [(s.pod, s.matched_blocks) for s in result.pods] == [(POD.member, 8)]
    assert "chunked_local_attention" in result.warnings[0]


def test_cap_applies_to_the_plain_path_too() -> None:
    p = Pipeline()
    p.send(BlockStored(KEYS, None, TOKENS, 16))
    assert p.scorer.score("m", TOKENS).pods[0].matched_blocks == 8
    assert p.scorer.score("m", TOKENS, max_hit_tokens=len(TOKENS) - 1).pods[0].matched_blocks == 7
    assert p.scorer.score("m", TOKENS, max_hit_tokens=0).pods == []


def test_kv_groups_survive_a_snapshot(tmp_path: Path) -> None:
    p = Pipeline()
    window = {"kv_cache_spec_sliding_window": 48}
    p.send(store(range(4), 0, "full_attention"), store(range(4), 1, "sliding_window", **window))
    write_snapshot(tmp_path / "snap", {"ingest": p.ingestor.to_state()})
    state = read_snapshot(tmp_path / "snap")["ingest"]
    restored = Ingestor(p.backend, p.catalog, layouts=KvLayouts())
    restored.from_state(state)
    assert restored.layouts.get("m") == p.ingestor.layouts.get("m")
    # a window-group removal right after the restore still reaches its namespace
    restored.deliver(
        [Delivery(POD, "m", 9, EventBatch(0.0, [BlockRemoved(KEYS[:4], group_idx=1)]), 0.0)]
    )
    assert p.backend.member_keys(POD.member, group_model("m", 1)) == []
    assert p.backend.member_keys(POD.member, "m") == sorted(KEYS[:4])

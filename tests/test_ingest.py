"""Applying event batches to the index: tiers, groups, clears, restarts, token-key mode."""

from __future__ import annotations

import msgspec
import pytest

from kvindex.api.serve.settings_derived import ConfigError, build_catalog
from kvindex.api.serve.settings_sources import from_flags
from kvindex.events.ingest.sink import Delivery
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.vllm import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from kvindex.indexer.backend import Tier
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.keys import BlockHasher, HashAlgo, HashConfig
from kvindex.indexer.kv_groups import GroupSpec
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import KeyMode, ModelCatalog, ModelKeying
from kvindex.indexer.verify import CheckState, HashVerifier
from kvindex.scoring.scorer import Scorer

TOKENS = list(range(1000, 1000 + 16 * 8))
KEYS = BlockHasher(HashConfig()).keys(TOKENS)
POD_A, POD_B = StreamId("127.0.0.1:8000"), StreamId("127.0.0.2:8000")


class Harness:
    def __init__(self, catalog: ModelCatalog | None = None) -> None:
        self.catalog = catalog or ModelCatalog()
        self.backend = MemoryBackend()
        self.verifier = HashVerifier(self.catalog.keying, self.catalog.hasher)
        self.ingestor = Ingestor(self.backend, self.catalog, self.verifier)
        self.scorer = Scorer(self.backend, self.catalog, layouts=self.ingestor.layouts)
        self.seq = 0

    def send(self, stream: StreamId, *events: object, model: str = "m") -> None:
        self.ingestor.deliver(
            [Delivery(stream, model, self.seq, EventBatch(0.0, list(events)), 0.0)]
        )
        self.seq += 1

    def matched(self, tokens: list[int] = TOKENS, model: str = "m") -> dict[str, tuple[int, tuple]]:
        result = self.scorer.score(model, tokens)
        return {
            p.pod: (p.matched_blocks, (p.gpu_blocks, p.cpu_blocks, p.storage_blocks))
            for p in result.pods
        }


@pytest.fixture
def h() -> Harness:
    return Harness()


def stored(n: int = 8, **kw: object) -> BlockStored:
    return BlockStored(KEYS[:n], None, TOKENS[: n * 16], 16, **kw)


def test_store_then_score(h: Harness) -> None:
    h.send(POD_A, stored(8))
    h.send(POD_B, stored(3))
    assert h.matched() == {POD_A.member: (8, (8, 0, 0)), POD_B.member: (3, (3, 0, 0))}
    assert h.ingestor.counts.events["BlockStored"] == 2
    assert h.ingestor.counts.blocks_stored == 11
    assert h.verifier.status(POD_A.member).state is CheckState.OK


def test_medium_selects_tier_and_remove_touches_only_that_tier(h: Harness) -> None:
    h.send(POD_A, stored(4), BlockStored(KEYS[:6], None, [], 0, medium="CPU"))
    assert h.matched()[POD_A.member] == (6, (4, 2, 0))
    h.send(POD_A, BlockRemoved(KEYS[:4], medium="GPU"))
    assert h.matched()[POD_A.member] == (6, (0, 6, 0))
    h.send(POD_A, BlockRemoved([KEYS[2]], medium="CPU"))
    assert h.matched()[POD_A.member] == (2, (0, 2, 0))


def test_remove_from_one_pod_keeps_the_block_for_others(h: Harness) -> None:
    h.send(POD_A, stored(8))
    h.send(POD_B, stored(8))
    h.send(POD_A, BlockRemoved([KEYS[0]]))
    assert h.matched() == {POD_B.member: (8, (8, 0, 0))}


def test_all_blocks_cleared_clears_only_that_pod(h: Harness) -> None:
    h.send(POD_A, stored(8), BlockStored(KEYS[:8], None, [], 0, medium="CPU"))
    h.send(POD_B, stored(5))
    h.send(POD_A, AllBlocksCleared())
    assert h.matched() == {POD_B.member: (5, (5, 0, 0))}
    assert h.ingestor.counts.events["AllBlocksCleared"] == 1


def test_restart_reset_clears_the_member(h: Harness) -> None:
    h.send(POD_A, stored(8))
    h.ingestor.reset(POD_A, "engine_restart")
    assert h.matched() == {}
    assert h.ingestor.counts.resets["engine_restart"] == 1


def test_unknown_medium_is_counted_and_skipped(h: Harness) -> None:
    h.send(POD_A, stored(2, medium="TAPE"), stored(3))
    assert h.matched()[POD_A.member] == (3, (3, 0, 0))
    assert h.ingestor.counts.skipped["unknown_medium"] == 1


def test_digest_bytes_hashes_are_indexed_as_their_uint64(h: Harness) -> None:
    digests = BlockHasher(HashConfig()).digests(TOKENS)
    h.send(POD_A, BlockStored(digests, None, TOKENS, 16))
    assert h.matched()[POD_A.member][0] == 8
    assert h.verifier.status(POD_A.member).state is CheckState.OK


def test_every_kv_group_is_indexed_in_its_own_namespace(h: Harness) -> None:
    full = stored(8, group_idx=0, kv_cache_spec_kind="full_attention")
    window = stored(
        8, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32
    )
    h.send(POD_A, full, window)
    assert h.backend.member_keys(POD_A.member, "m") == sorted(KEYS[:8])
    assert h.backend.member_keys(POD_A.member, "m#kv-group-1") == sorted(KEYS[:8])
    assert h.ingestor.layouts.get("m") == {
        0: GroupSpec("full_attention", None, 16),
        1: GroupSpec("sliding_window", 32, 16),
    }
    assert h.matched()[POD_A.member][0] == 8
    # evicting the window group's blocks 0-5 leaves its tail: still a hit (window 32 =
    # the last 2 blocks of 16), while the full-attention group keeps all 8 blocks
    h.send(POD_A, BlockRemoved(KEYS[:6], group_idx=1))
    assert h.backend.member_keys(POD_A.member, "m") == sorted(KEYS[:8])
    assert h.matched()[POD_A.member][0] == 8
    # a hole in the window's tail: the hit moves back to the last 2 consecutive blocks
    h.send(POD_A, BlockRemoved([KEYS[7]], group_idx=1))
    assert h.matched() == {}
    h.send(
        POD_A,
        stored(
            4, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32
        ),
    )
    assert h.matched()[POD_A.member] == (4, (4, 0, 0))
    assert h.ingestor.counts.skipped["other_kv_group"] == 0
    h.send(POD_A, AllBlocksCleared())
    assert h.backend.members() == []


def test_primary_group_is_the_lowest_full_attention_group_in_token_key_mode() -> None:
    h = Harness(ModelCatalog(ModelKeying(key_mode=KeyMode.TOKENS)))
    h.send(
        POD_A,
        stored(8, group_idx=0, kv_cache_spec_kind="sliding_window"),
        stored(8, group_idx=1, kv_cache_spec_kind="full_attention"),
    )
    h.send(POD_A, BlockRemoved(KEYS[:8], group_idx=0))
    assert h.matched()[POD_A.member][0] == 8
    h.send(POD_A, BlockRemoved(KEYS[:8], group_idx=1))
    assert h.matched() == {}
    assert h.ingestor.layouts.get("m") is None


def test_group_zero_is_primary_when_kinds_are_unknown(h: Harness) -> None:
    h.send(POD_A, stored(8, group_idx=0), stored(8, group_idx=1))
    h.send(POD_A, BlockRemoved(KEYS[:8], group_idx=1))
    assert h.matched()[POD_A.member][0] == 8


def test_models_are_isolated(h: Harness) -> None:
    h.send(POD_A, stored(8), model="m")
    assert h.matched(model="other") == {}


def test_data_parallel_ranks_are_separate_members(h: Harness) -> None:
    rank1 = StreamId(POD_A.pod, 1)
    h.send(POD_A, stored(8))
    h.send(rank1, stored(4))
    h.send(rank1, BlockRemoved(KEYS[:8]))
    assert h.matched() == {POD_A.member: (8, (8, 0, 0))}
    assert rank1.member == "127.0.0.1:8000/dp1"


# Token-content key mode: pods on xxhash with PYTHONHASHSEED unset have random seeds.


def tokens_harness() -> Harness:
    keying = ModelKeying(
        hash=HashConfig(algo=HashAlgo.XXHASH, seed="unused"), key_mode=KeyMode.TOKENS
    )
    return Harness(ModelCatalog(keying))


def random_seed_keys(seed: str) -> list[int]:
    return BlockHasher(HashConfig(algo=HashAlgo.XXHASH, seed=seed)).keys(TOKENS)


def test_token_mode_scores_pods_whose_hashes_differ() -> None:
    h = tokens_harness()
    a_keys, b_keys = random_seed_keys("a"), random_seed_keys("b")
    assert a_keys != b_keys
    h.send(POD_A, BlockStored(a_keys, None, TOKENS, 16))
    h.send(POD_B, BlockStored(b_keys[:4], None, TOKENS[:64], 16))
    assert h.matched() == {POD_A.member: (8, (8, 0, 0)), POD_B.member: (4, (4, 0, 0))}


def test_token_mode_resolves_children_removals_and_placeholders() -> None:
    h = tokens_harness()
    keys = random_seed_keys("a")
    h.send(POD_A, BlockStored(keys[:4], None, TOKENS[:64], 16))
    h.send(POD_A, BlockStored(keys[4:], keys[3], TOKENS[64:], 16))  # child of a known parent
    assert h.matched()[POD_A.member][0] == 8
    h.send(POD_A, BlockStored(keys[:8], None, [], 0, medium="CPU"))  # offload placeholder
    h.send(POD_A, BlockRemoved(keys[:8], medium="GPU"))
    assert h.matched()[POD_A.member] == (8, (0, 8, 0))
    h.send(POD_A, BlockRemoved(keys[6:8], medium="CPU"))
    assert h.matched()[POD_A.member] == (6, (0, 6, 0))


def test_token_mode_skips_what_it_cannot_resolve() -> None:
    h = tokens_harness()
    keys = random_seed_keys("a")
    h.send(POD_A, BlockStored(keys[4:], 12345, TOKENS[64:], 16))  # parent never seen
    h.send(POD_A, BlockStored(keys[:2], None, [], 0, medium="CPU"))  # placeholder, unknown
    assert h.matched() == {}
    assert h.ingestor.counts.skipped["unknown_parent"] == 1
    assert h.ingestor.counts.skipped["unresolved_placeholder_block"] == 2


def test_token_mode_keeps_salted_prompts_apart() -> None:
    h = tokens_harness()
    keys = random_seed_keys("a")
    h.send(POD_A, BlockStored(keys, None, TOKENS, 16, extra_keys=[["tenant"]] + [None] * 7))
    assert h.matched() == {}
    salted = h.scorer.score("m", TOKENS, cache_salt="tenant").pods
    assert [(p.pod, p.matched_blocks) for p in salted] == [(POD_A.member, 8)]


def test_member_stats_count_entries_per_tier(h: Harness) -> None:
    h.send(POD_A, stored(8), BlockStored(KEYS[:2], None, [], 0, medium="STORAGE"))
    stats = h.backend.member_stats(POD_A.member)
    assert stats is not None
    assert stats.blocks == {"m": {Tier.GPU: 8, Tier.STORAGE: 2}}


def decoded_stored(keys: list[int], token_ids: object) -> BlockStored:
    """A BlockStored as the subscriber hands it over: decoded off the wire."""
    payload = msgspec.msgpack.encode([0.0, [["BlockStored", keys, None, token_ids, 16]]])
    (event,) = BatchDecoder().decode(payload).batch.events
    return event


def test_wire_decoded_events_index_and_verify(h: Harness) -> None:
    h.send(POD_A, decoded_stored(KEYS, TOKENS))
    assert h.matched()[POD_A.member][0] == 8
    assert h.verifier.status(POD_A.member).state is CheckState.OK


def test_malformed_token_ids_cost_only_the_check(h: Harness) -> None:
    # The hashes are fine, so the blocks are indexed; the tokens can't be checked.
    h.send(POD_A, decoded_stored(KEYS, ["not", "tokens"]))
    assert h.matched()[POD_A.member][0] == 8
    assert h.verifier.status(POD_A.member).checked_events == 0


def test_malformed_token_ids_are_skipped_in_token_mode() -> None:
    h = tokens_harness()
    h.send(POD_A, decoded_stored(random_seed_keys("a"), ["not", "tokens"]))
    assert h.matched() == {}
    assert h.ingestor.counts.skipped["invalid_token_ids"] == 1


@pytest.mark.parametrize(
    ("mode", "after_one_removal"),
    [
        # incremental (vLLM's default): the second root store is a second physical copy
        ("incremental", 1),
        # full: a root store of held blocks is a re-announcement, never a copy
        ("full", 0),
    ],
)
def test_report_mode_decides_what_a_root_store_of_held_blocks_is(
    tmp_path, mode: str, after_one_removal: int
) -> None:
    config = tmp_path / "models.json"
    config.write_bytes(msgspec.json.encode({"models": {"m": {"kv_cache_report_mode": mode}}}))
    catalog = build_catalog(from_flags(model_config=str(config)))
    h = Harness(catalog)
    h.send(POD_A, stored(1))
    h.send(POD_A, stored(1))  # the same one-block chain from the root, again
    h.send(POD_A, BlockRemoved([KEYS[0]]))
    assert h.matched(TOKENS[:16]).get(POD_A.member, (0,))[0] == after_one_removal
    h.send(POD_A, BlockRemoved([KEYS[0]]))
    assert POD_A.member not in h.matched(TOKENS[:16])  # never a negative or leftover count


def test_an_unknown_report_mode_is_refused(tmp_path) -> None:
    config = tmp_path / "models.json"
    config.write_text('{"models": {"m": {"kv_cache_report_mode": "sometimes"}}}')
    with pytest.raises(ConfigError, match="kv_cache_report_mode"):
        from_flags(model_config=str(config))

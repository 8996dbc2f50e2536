"""The ingest hash check: a misconfiguration is diagnosed, a healthy pod stays ok."""

from __future__ import annotations

from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import (
    NO_EXTRAS,
    BlockExtras,
    BlockHasher,
    ExtraKeyStyle,
    HashAlgo,
    HashConfig,
    MmFeature,
)
from kvindex.indexer.models import ModelCatalog, ModelKeying
from kvindex.indexer.verify import CheckState, HashVerifier

TOKENS = list(range(100, 164))


def verifier_for(config: HashConfig, loras: dict[str, str] | None = None) -> HashVerifier:
    catalog = ModelCatalog(ModelKeying(hash=config, loras=loras or {}))
    return HashVerifier(catalog.keying, catalog.hasher)


def stored(
    engine: HashConfig, tokens: list[int] = TOKENS, extras: BlockExtras = NO_EXTRAS, **kw
) -> BlockStored:
    hashes = BlockHasher(engine).keys(tokens, extras)
    return BlockStored(hashes, None, tokens, engine.block_size, **kw)


def test_matching_configuration_is_ok() -> None:
    verifier = verifier_for(HashConfig())
    for _ in range(3):
        verifier.observe("p:1", "m", stored(HashConfig()))
    check = verifier.status("p:1")
    assert check.state is CheckState.OK
    assert check.checked_events == 3 and check.failed_events == 0
    assert verifier.mismatches_total == 0


def test_cbor_pods_diagnosed_when_kvindex_assumes_pickle() -> None:
    verifier = verifier_for(HashConfig(algo=HashAlgo.SHA256))
    pods = HashConfig(algo=HashAlgo.SHA256_CBOR)
    for _ in range(2):
        verifier.observe("p:1", "m", stored(pods))
    check = verifier.status("p:1")
    assert check.state is CheckState.MISMATCH
    assert "sha256_cbor" in check.diagnosis
    assert check.action.startswith("set hash_algo: sha256_cbor")
    assert verifier.mismatches_total == 2


def test_block_size_mismatch_names_the_setting() -> None:
    verifier = verifier_for(HashConfig(block_size=16))
    pods = HashConfig(block_size=32)
    verifier.observe("p:1", "m", stored(pods))
    check = verifier.status("p:1")
    assert check.state is CheckState.MISMATCH
    assert "block_size: 32" in check.action


def test_seed_mismatch_is_diagnosed() -> None:
    verifier = verifier_for(HashConfig(seed="7"))
    verifier.observe("p:1", "m", stored(HashConfig(seed=None)))
    verifier.observe("p:1", "m", stored(HashConfig(seed=None)))
    check = verifier.status("p:1")
    assert check.state is CheckState.MISMATCH
    assert "hash_seed: unset" in check.action


def test_unreproducible_engine_suggests_tokens_mode() -> None:
    verifier = verifier_for(HashConfig())
    random_seed_engine = HashConfig(algo=HashAlgo.XXHASH, seed="per-process-random")
    verifier.observe("p:1", "m", stored(random_seed_engine))
    check = verifier.status("p:1")
    assert check.state is CheckState.MISMATCH
    assert "key_mode: tokens" in check.action


def test_extra_key_style_mismatch_is_diagnosed() -> None:
    # Pods on vLLM <= 0.30 hash the bare salt; kvindex configured for >= 0.31.
    verifier = verifier_for(HashConfig(extra_key_style=ExtraKeyStyle.TAGGED))
    old = HashConfig(extra_key_style=ExtraKeyStyle.BARE)
    for _ in range(2):
        verifier.observe(
            "p:1",
            "m",
            stored(old, extras=BlockExtras(cache_salt="s"), extra_keys=[["s"], None, None, None]),
        )
    check = verifier.status("p:1")
    assert check.state is CheckState.MISMATCH
    assert "extra_key_style: bare" in check.action


def test_lora_with_configured_path_verifies() -> None:
    verifier = verifier_for(HashConfig(), loras={"ad": "/loras/ad"})
    extras = BlockExtras("ad", "/loras/ad")
    event = stored(HashConfig(), extras=extras, lora_name="ad", extra_keys=[["ad"]] * 4)
    verifier.observe("p:1", "m", event)
    assert verifier.status("p:1").state is CheckState.OK


def test_lora_without_path_is_skipped_not_misjudged() -> None:
    verifier = verifier_for(HashConfig())
    extras = BlockExtras("ad", "/loras/ad")
    event = stored(HashConfig(), extras=extras, lora_name="ad", extra_keys=[["ad"]] * 4)
    verifier.observe("p:1", "m", event)
    check = verifier.status("p:1")
    assert check.state is CheckState.UNVERIFIED
    assert check.skipped_events == 1 and "path" in check.skip_reason


def test_events_that_cannot_be_chained_are_not_checked() -> None:
    verifier = verifier_for(HashConfig())
    child = BlockStored([1, 2], 12345, TOKENS[:32], 16)  # uint64 parent: truncated digest
    placeholder = BlockStored([1, 2], None, [], 0, medium="CPU")
    verifier.observe("p:1", "m", child)
    verifier.observe("p:1", "m", placeholder)
    assert verifier.status("p:1").checked_events == 0


def test_one_odd_event_does_not_flip_a_healthy_pod() -> None:
    verifier = verifier_for(HashConfig())
    for _ in range(5):
        verifier.observe("p:1", "m", stored(HashConfig()))
    verifier.observe("p:1", "m", stored(HashConfig(algo=HashAlgo.SHA256_CBOR)))
    assert verifier.status("p:1").state is CheckState.OK


def test_sampling_after_the_first_events() -> None:
    catalog = ModelCatalog()
    verifier = HashVerifier(catalog.keying, catalog.hasher, full_checks=4, sample_every=10)
    for _ in range(24):
        verifier.observe("p:1", "m", stored(HashConfig()))
    # 4 full checks, then events 10 and 20 of the sampled phase.
    assert verifier.status("p:1").checked_events == 6


def test_reset_forgets_history() -> None:
    verifier = verifier_for(HashConfig())
    verifier.observe("p:1", "m", stored(HashConfig(algo=HashAlgo.SHA256_CBOR)))
    verifier.reset("p:1")
    assert verifier.status("p:1").state is CheckState.UNVERIFIED


def event_extra_keys(extras: BlockExtras, blocks: int, first: int = 0) -> list:
    """The per-block extra keys vLLM 0.33 publishes (``to_event_extra_keys``): tags
    dropped, a multimodal item as (identifier, offset - block_start)."""
    out = []
    for index in range(first, first + blocks):
        keys = extras.for_block(index, ExtraKeyStyle.TAGGED, 16)
        out.append(None if keys is None else [k[1:] if k[0] == "mm" else k[1] for k in keys])
    return out


IMAGES = (MmFeature("img-1", 5, 20), MmFeature("img-1", 25, 3), MmFeature("img-2", 40, 30))


def test_multimodal_extra_keys_are_verified() -> None:
    loras = {"ad": "/adapters/ad"}
    verifier = verifier_for(HashConfig(), loras)
    extras = BlockExtras("ad", "/adapters/ad", "salt", IMAGES)
    event = stored(
        HashConfig(), extras=extras, lora_name="ad", extra_keys=event_extra_keys(extras, 4)
    )
    verifier.observe("p:1", "m", event)
    check = verifier.status("p:1")
    assert (check.state, check.checked_events, check.skipped_events) == (CheckState.OK, 1, 0)

    # Another image in the same place: the engine's keys are not kvindex's.
    other = BlockExtras("ad", "/adapters/ad", "salt", (IMAGES[0], IMAGES[1]))
    forged = stored(HashConfig(), extras=other, lora_name="ad", extra_keys=event.extra_keys)
    verifier.observe("p:2", "m", forged)
    assert verifier.status("p:2").failed_events == 1


def test_multimodal_item_begun_before_the_event_is_verified() -> None:
    """A continuation event (its parent a full digest) whose first block holds the end
    of an image: the offset it publishes is negative."""
    verifier = verifier_for(HashConfig())
    extras = BlockExtras(mm_features=IMAGES)
    hasher = BlockHasher(HashConfig())
    digests = hasher.digests(TOKENS, extras)
    keys = hasher.keys(TOKENS, extras)
    event = BlockStored(
        keys[3:], digests[2], TOKENS[48:], 16, extra_keys=event_extra_keys(extras, 1, first=3)
    )
    assert event.extra_keys[0] == [("img-2", -8)]
    verifier.observe("p:1", "m", event)
    check = verifier.status("p:1")
    assert (check.state, check.checked_events, check.skipped_events) == (CheckState.OK, 1, 0)

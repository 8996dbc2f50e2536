"""Every vLLM release's event layout, encoded like that release and decoded back."""

from __future__ import annotations

import msgspec
import pytest

from kvindex.events.wire.layouts import (
    RELEASES,
    EngineBlockRemoved,
    EngineBlockStored,
    parse_version,
    wire_format,
)
from kvindex.events.wire.vllm import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    Layout,
    hash_to_int,
    tokens_of,
)

VERSIONS = ["0.9", "0.10.2", "0.14", "0.17", "0.20", "0.22", "0.24", "0.26", "0.29", "0.33"]

# The facts under test, written out independently of layouts.py: the fields each release
# sends, in order (array releases) or as keys (map releases).
STORED_0_9 = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"]
STORED = {
    "0.9": STORED_0_9,
    "0.10.2": [*STORED_0_9, "medium"],
    "0.14": [*STORED_0_9, "medium", "lora_name"],
    "0.17": [*STORED_0_9, "medium", "lora_name", "extra_keys"],
    "0.20": [*STORED_0_9, "medium", "lora_name", "extra_keys", "group_idx"],
}
STORED["0.22"] = [*STORED["0.20"], "kv_cache_spec_kind", "kv_cache_spec_sliding_window"]
STORED["0.24"] = STORED["0.22"]
STORED["0.26"] = [*STORED["0.24"], "locality"]
STORED["0.29"] = [*STORED["0.26"], "ownership"]
STORED["0.33"] = [*STORED["0.29"], "session_id", "lookahead_token_ids"]
REMOVED = {
    "0.9": ["block_hashes"],
    "0.10.2": ["block_hashes", "medium"],
    "0.14": ["block_hashes", "medium"],
    "0.17": ["block_hashes", "medium"],
    "0.20": ["block_hashes", "medium", "group_idx"],
    "0.22": ["block_hashes", "medium", "group_idx"],
    "0.24": ["block_hashes", "medium", "group_idx"],
    "0.26": ["block_hashes", "medium", "group_idx", "locality"],
    "0.29": ["block_hashes", "medium", "group_idx", "locality", "ownership"],
    "0.33": ["block_hashes", "medium", "group_idx", "locality", "ownership"],
}
MAP_RELEASES = {"0.24", "0.26", "0.29", "0.33"}

BIG = 2**64 - 1
FULL_STORED = EngineBlockStored(
    block_hashes=[2**63, BIG, 7],
    parent_block_hash=2**63 + 5,
    token_ids=list(range(48)),
    block_size=16,
    lora_id=3,
    medium="CPU",
    lora_name="adapter",
    extra_keys=[["adapter", "salt"], ["adapter"], ["adapter"]],
    group_idx=1,
    kv_cache_spec_kind="sliding_window",
    kv_cache_spec_sliding_window=4096,
    locality="LOCAL",
    ownership="tier2",
    session_id="sess",
    lookahead_token_ids=[[1], [2], [3]],
)
FULL_REMOVED = EngineBlockRemoved(
    block_hashes=[BIG, 1], medium="STORAGE", group_idx=2, locality="REMOTE", ownership="o"
)
DECODED_FIELDS = [f for f in STORED["0.22"]]  # the fields the decoder keeps


def raw(payload: bytes) -> list:
    return msgspec.msgpack.decode(payload)


@pytest.mark.parametrize("version", VERSIONS)
def test_field_sets_on_the_wire(version: str) -> None:
    fmt = wire_format(version)
    batch = raw(fmt.encode_batch([FULL_STORED, FULL_REMOVED, AllBlocksCleared()], 1.5, 2))
    stored, removed, cleared = batch[1]
    if version in MAP_RELEASES:
        assert stored == {"type": "BlockStored"} | {
            f: _wire_value(getattr(FULL_STORED, f)) for f in STORED[version]
        }
        assert set(removed) == {"type", *REMOVED[version]}
        assert cleared == {"type": "AllBlocksCleared"}
    else:
        assert stored == [
            "BlockStored",
            *(_wire_value(getattr(FULL_STORED, f)) for f in STORED[version]),
        ]
        assert removed == ["BlockRemoved", *(getattr(FULL_REMOVED, f) for f in REMOVED[version])]
        assert cleared == ["AllBlocksCleared"]
    if version == "0.9":
        assert len(batch) == 2  # no data_parallel_rank before data parallelism
    else:
        assert batch[0] == 1.5 and batch[2] == 2


def _wire_value(value: object) -> object:
    if isinstance(value, list):
        return [_wire_value(v) for v in value]
    if isinstance(value, tuple):
        return [_wire_value(v) for v in value]
    return value


@pytest.mark.parametrize("version", VERSIONS)
def test_every_layout_decodes(version: str) -> None:
    fmt = wire_format(version)
    payload = fmt.encode_batch([FULL_STORED, FULL_REMOVED, AllBlocksCleared()], 2.0, 1)
    for prefer in Layout:
        decoded = BatchDecoder().decode(payload, prefer)
        assert decoded.skipped == {}
        assert decoded.layout is (Layout.MAP if version in MAP_RELEASES else Layout.ARRAY)
        stored, removed, cleared = decoded.batch.events
        assert isinstance(stored, BlockStored)
        assert isinstance(removed, BlockRemoved)
        assert isinstance(cleared, AllBlocksCleared)
        for name in DECODED_FIELDS:
            expected = getattr(FULL_STORED, name) if name in STORED[version] else None
            if name == "token_ids" and expected is None:
                expected = []
            got = tokens_of(stored) if name == "token_ids" else getattr(stored, name)
            assert got == expected, name
        for name in ("block_hashes", "medium", "group_idx"):
            expected = getattr(FULL_REMOVED, name) if name in REMOVED[version] else None
            assert getattr(removed, name) == expected, name
        assert decoded.batch.ts == 2.0
        assert decoded.batch.data_parallel_rank == (None if version == "0.9" else 1)


@pytest.mark.parametrize("version", ["0.17", "0.22", "0.24", "0.33"])
def test_defaults_are_omitted_like_vllm(version: str) -> None:
    fmt = wire_format(version)
    event = BlockStored([1], None, [5] * 16, 16)
    wire = raw(fmt.encode_batch([event, BlockRemoved([1], None)], 0.0))[1]
    if version in MAP_RELEASES:
        # Fields without a default in vLLM are always sent, None included.
        assert set(wire[0]) == {"type", *STORED_0_9, "medium", "lora_name"}
        assert wire[0]["medium"] is None
        assert set(wire[1]) == {"type", "block_hashes", "medium"}
    else:
        assert wire[0] == ["BlockStored", [1], None, [5] * 16, 16, None, None, None]
        assert wire[1] == ["BlockRemoved", [1], None]
    decoded = BatchDecoder().decode(fmt.encode_batch([event], 0.0))
    assert decoded.batch.events[0].extra_keys is None
    assert decoded.batch.events[0].group_idx is None


def test_digest_bytes_hashes() -> None:
    digest = bytes(range(32))
    for version in ("0.10.2", "0.33"):
        payload = wire_format(version).encode_batch(
            [BlockStored([digest], digest, [1] * 16, 16), BlockRemoved([digest], "GPU")], 0.0
        )
        stored, removed = BatchDecoder().decode(payload).batch.events
        assert stored.block_hashes == [digest]
        assert stored.parent_block_hash == digest
        assert removed.block_hashes == [digest]
        assert hash_to_int(digest) == int.from_bytes(digest[-8:], "big")


def test_cpu_offload_placeholders() -> None:
    placeholder = BlockStored([2**63 + 1, 2], None, [], 0, medium="CPU")
    for version in ("0.10.2", "0.22", "0.24", "0.33"):
        (event,) = (
            BatchDecoder()
            .decode(wire_format(version).encode_batch([placeholder], 0.0))
            .batch.events
        )
        assert tokens_of(event) == [] and event.block_size == 0
        assert event.parent_block_hash is None and event.medium == "CPU"
        assert event.block_hashes == [2**63 + 1, 2]


def test_unknown_extra_fields_are_ignored() -> None:
    encode = msgspec.msgpack.encode
    array = encode(
        [
            1.0,
            [
                [
                    "BlockStored",
                    [1],
                    None,
                    [],
                    0,
                    None,
                    "GPU",
                    None,
                    None,
                    0,
                    None,
                    None,
                    "x",
                    {"y": 1},
                ]
            ],
            0,
            "extra",
        ]
    )
    mapped = encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [2], "medium": None, "future": [1, 2]}], 0]
    )
    for payload, cls in ((array, BlockStored), (mapped, BlockRemoved)):
        decoded = BatchDecoder().decode(payload)
        assert decoded.skipped == {}
        assert isinstance(decoded.batch.events[0], cls)


def test_batch_with_and_without_rank() -> None:
    event = BlockStored([1])
    with_rank = BatchDecoder().decode(wire_format("0.20").encode_batch([event], 0.0, 3))
    without = BatchDecoder().decode(wire_format("0.9").encode_batch([event], 0.0, 3))
    nil_rank = BatchDecoder().decode(msgspec.msgpack.encode([0.0, [], None]))
    assert with_rank.batch.data_parallel_rank == 3
    assert without.batch.data_parallel_rank is None
    assert nil_rank.batch.data_parallel_rank is None


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("0.9", "0.9"),
        ("0.9.2", "0.9"),
        ("0.10", "0.9"),
        ("0.10.2", "0.10.2"),
        ("0.11.0rc1", "0.10.2"),
        ("0.23.1", "0.22"),
        ("0.25", "0.24"),
        ("0.30.0+cu128", "0.30"),
        ("0.33", "0.33"),
        ("1.2", "0.33"),
        ("v0.26.1", "0.26"),
    ],
)
def test_version_picks_newest_release_not_after_it(version: str, release: str) -> None:
    assert wire_format(version).release == release


@pytest.mark.parametrize("bad", ["0.8", "0.8.9", "banana", "", "1"])
def test_bad_versions(bad: str) -> None:
    with pytest.raises(ValueError):
        wire_format(bad)


def test_releases_are_ordered() -> None:
    versions = [parse_version(fmt.release) for fmt in RELEASES]
    assert versions == sorted(versions)
    assert wire_format("0.25").replay_has_topic is False
    assert wire_format("0.26").replay_has_topic is True

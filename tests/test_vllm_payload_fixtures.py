"""kvindex decodes the real bytes vLLM releases' own publisher code sent.

``tests/fixtures/vllm/<release>/`` holds what ``tests/fixtures/vllm/capture.py`` captured
from that release's ``kv_events.py`` (its event structs, its ``ZmqEventPublisher``): the
live messages ``[topic, seq, payload]``, the replay ROUTER's answer from seq 0, and
``expected.json``, the inputs the events were built from. Each payload must decode into
exactly those events, and each replay reply must carry the live message's seq and
payload in the layout kvindex expects for that release.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvindex.events.ingest.replay_client import END_SEQ
from kvindex.events.wire.layouts import wire_format
from kvindex.events.wire.vllm import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    hash_to_int,
    hashes_to_ints,
    tokens_of,
)

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
RELEASES = sorted(
    (p.name for p in FIXTURES.iterdir() if (p / "expected.json").exists()),
    key=lambda v: tuple(int(x) for x in v.split(".")),
)
TYPES = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
STORED_FIELDS = (
    "lora_id", "medium", "lora_name", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)  # fmt: skip


def load(release: str) -> tuple[list, list, dict]:
    folder = FIXTURES / release
    messages = msgspec.msgpack.decode((folder / "messages.msgpack").read_bytes())
    replay = msgspec.msgpack.decode((folder / "replay.msgpack").read_bytes())
    expected = json.loads((folder / "expected.json").read_text())
    return messages, replay, expected


def test_every_supported_release_has_fixtures() -> None:
    assert RELEASES[0] == "0.9.2" and RELEASES[-1] == "0.33.0"
    assert len(RELEASES) >= 8
    for release in RELEASES:
        size = sum(f.stat().st_size for f in (FIXTURES / release).iterdir())
        assert size < 16_384, f"{release} fixtures are {size} bytes: keep them small"


@pytest.mark.parametrize("release", RELEASES)
def test_real_payloads_decode(release: str) -> None:
    messages, _, expected = load(release)
    assert len(messages) == len(expected["batches"])
    decoder = BatchDecoder()
    for seq, (frames, want) in enumerate(zip(messages, expected["batches"], strict=True)):
        topic, seq_frame, payload = frames
        assert topic.decode() == expected["topic"]
        assert int.from_bytes(seq_frame, "big") == seq
        decoded = decoder.decode(payload)
        assert decoded.skipped == {}
        assert decoded.batch.ts == want["ts"]
        assert decoded.batch.data_parallel_rank in (0, None)
        assert len(decoded.batch.events) == len(want["events"])
        for event, spec in zip(decoded.batch.events, want["events"], strict=True):
            assert isinstance(event, TYPES[spec["type"]]), (event, spec)
            if isinstance(event, BlockStored):
                _check_stored(event, spec)
            elif isinstance(event, BlockRemoved):
                assert hashes_to_ints(event.block_hashes) == spec["block_hashes"]
                assert event.medium == spec.get("medium")
                assert event.group_idx == spec.get("group_idx")


def _check_stored(event: BlockStored, spec: dict) -> None:
    assert hashes_to_ints(event.block_hashes) == spec["block_hashes"]
    parent = event.parent_block_hash
    assert (None if parent is None else hash_to_int(parent)) == spec["parent_block_hash"]
    assert tokens_of(event) == spec["token_ids"]
    assert event.block_size == spec["block_size"]
    for name in STORED_FIELDS:
        assert getattr(event, name) == spec.get(name), name
    extra = event.extra_keys
    assert (None if extra is None else [list(e) for e in extra]) == spec.get("extra_keys")


@pytest.mark.parametrize("release", RELEASES)
def test_real_replay_replies(release: str) -> None:
    """The ROUTER's answer from seq 0: every buffered batch, then the end marker, in the
    reply layout kvindex expects for this release (topic frame from vLLM 0.26)."""
    messages, replies, expected = load(release)
    with_topic = wire_format(release).replay_has_topic
    *batches, end = replies
    assert len(batches) == len(messages)
    for reply, (topic, seq_frame, payload) in zip(batches, messages, strict=True):
        assert reply == ([topic, seq_frame, payload] if with_topic else [seq_frame, payload])
    assert end == ([b"", END_SEQ, b""] if with_topic else [END_SEQ, b""])
    assert expected["topic"].encode() == messages[0][0]

"""Item 9 of issue 10: a batch envelope sent as a map, and vLLM's ``locality`` field.

Three sources of bytes: msgspec structs shaped like vLLM 0.33's (written here), bytes
that vLLM 0.33.0's own structs encoded (tests/fixtures/vllm_0_33_envelopes.txt, made by
tests/fixtures/make_vllm_0_33_envelopes.py), and a live publisher on loopback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.sink import Delivery
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink
from kvindex.events.wire.identity import StreamId, make_topic
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EnvelopeDecoder,
    EventBatch,
    Layout,
    NestedTooDeep,
    envelope_is_map,
    tokens_of,
)
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import ModelCatalog
from kvindex.scoring.scorer import Scorer

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_0_33_envelopes.txt"


# -- structs shaped like vLLM 0.33's kv_events.py (our own, field for field) -----------


class _Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class VBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VMapBatch(msgspec.Struct, omit_defaults=True):
    """The same batch as a map, with fields a future release might add."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None
    engine_id: str | None = None
    schema: int = 2


def vllm_events() -> list[Any]:
    return [
        VBlockStored([2**64 - 1, 2**63], None, list(range(32)), 16, None, "GPU", None,
                     group_idx=0, kv_cache_spec_kind="full_attention", session_id="s1"),
        VBlockStored([9], None, [], 0, None, "STORAGE", None, locality="REMOTE", ownership="fs"),
        VBlockRemoved([2**63], "GPU", locality="LOCAL"),
    ]  # fmt: skip


def check_batch(batch: EventBatch, rank: int) -> None:
    stored, remote, removed = batch.events
    assert batch.ts == 1.5 and batch.data_parallel_rank == rank
    assert isinstance(stored, BlockStored) and stored.block_hashes == [2**64 - 1, 2**63]
    assert stored.group_idx == 0 and stored.locality is None
    assert isinstance(remote, BlockStored) and remote.locality == "REMOTE"
    assert remote.medium == "STORAGE" and remote.block_hashes == [9]
    assert isinstance(removed, BlockRemoved) and removed.locality == "LOCAL"


def test_map_and_array_envelopes_decode_alike() -> None:
    encoder = msgspec.msgpack.Encoder()
    as_array = encoder.encode(VArrayBatch(1.5, vllm_events(), 3))
    as_map = encoder.encode(VMapBatch(1.5, vllm_events(), 3, engine_id="e-7"))
    assert not envelope_is_map(as_array) and envelope_is_map(as_map)
    decoder = BatchDecoder()
    for payload in (as_array, as_map):
        for prefer in Layout:  # a wrong first guess of the event layout costs nothing
            decoded = decoder.decode(payload, prefer)
            assert decoded.layout is Layout.MAP and decoded.skipped == {}
            check_batch(decoded.batch, 3)
        assert EnvelopeDecoder().decode(payload).data_parallel_rank == 3


def test_map_envelope_with_one_bad_event_costs_only_that_event() -> None:
    payload = msgspec.msgpack.encode(
        {"events": [{"type": "Teleported"}, {"type": "AllBlocksCleared"}], "ts": 2.0, "x": [1]}
    )
    decoded = BatchDecoder().decode(payload)
    assert decoded.skipped == {"unknown_event_type": 1}
    (event,) = decoded.batch.events
    assert isinstance(event, AllBlocksCleared)
    assert decoded.batch.data_parallel_rank is None


@pytest.mark.parametrize(
    "payload",
    [
        msgspec.msgpack.encode({"events": []}),  # no ts
        msgspec.msgpack.encode({"ts": 1.0, "events": [], "data_parallel_rank": -1}),
        msgspec.msgpack.encode({"ts": "now", "events": []}),
        b"\x81",  # a map cut short
    ],
)
def test_broken_map_envelopes_are_decode_errors(payload: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        EnvelopeDecoder().decode(payload)


@pytest.mark.parametrize("envelope", [b"\x92\xcb\x41\xd0" + bytes(6), b"\x82\xa2ts\x01\xa6events"])
def test_a_payload_nested_too_deep_is_a_counted_decode_error(envelope: bytes) -> None:
    """Issue 26: msgspec raises RecursionError on it, which killed the receiver thread."""
    payload = envelope + b"\x91\x92\xabBlockStored" + b"\x91" * 1000 + b"\x01"
    with pytest.raises(NestedTooDeep):
        EnvelopeDecoder().decode(payload)
    for prefer in Layout:
        with pytest.raises(DecodeError) as raised:
            BatchDecoder().decode(payload, prefer)
        assert raised.value.reason == "too_deeply_nested"


def test_real_vllm_0_33_bytes_array_and_map() -> None:
    array_hex, map_hex = FIXTURE.read_text().split()
    decoder = BatchDecoder()
    batches = []
    for payload in (bytes.fromhex(array_hex), bytes.fromhex(map_hex)):
        assert EnvelopeDecoder().decode(payload).data_parallel_rank == 2
        decoded = decoder.decode(payload)
        assert decoded.skipped == {} and decoded.layout is Layout.MAP
        batches.append(decoded.batch)
    assert envelope_is_map(bytes.fromhex(map_hex))
    array_batch, map_batch = batches
    assert array_batch == map_batch
    remote, local, removed, cleared = array_batch.events
    assert remote.block_hashes == [2**63 + 5, 7] and remote.locality == "REMOTE"
    assert remote.medium == "STORAGE" and tokens_of(remote) == list(range(32))
    assert local.block_hashes == [11] and local.locality == "LOCAL"
    assert isinstance(removed, BlockRemoved) and removed.locality == "REMOTE"
    assert isinstance(cleared, AllBlocksCleared)
    assert array_batch.ts == 1700000000.5 and array_batch.data_parallel_rank == 2


def test_map_envelope_through_a_live_bind_mode_stream() -> None:
    """The rank inside a map envelope names the stream, as it does in an array."""
    sink = RecordingSink()
    sub = Subscriber(sink, SubscriberConfig(replay_timeout_s=5.0))
    try:
        endpoint = sub.bind("tcp://127.0.0.1:0")
        sub.start()
        topic = make_topic("127.0.0.1:8000", "m")
        with EnginePublisher(endpoint, topic=topic, bind=False) as pub:
            assert pub.wait_for_subscribers(1, 5.0)
            pub.publish_payload(msgspec.msgpack.encode(VMapBatch(1.5, vllm_events(), 3)))
            assert sink.wait_for_count(1, 10.0)
    finally:
        sub.stop()
    (delivery,) = sink.deliveries
    assert delivery.stream == StreamId("127.0.0.1:8000", 3)
    check_batch(delivery.batch, 3)
    assert sub.error_counts() == {}


# -- locality: what a REMOTE store means for the pod's own hits --------------------------


def test_remote_locality_is_not_indexed() -> None:
    """vLLM 0.33's REMOTE tiers are shared network storage that never publishes removals;
    the pod's own copy shows up as a CPU store when promoted (see indexer/ingest.py)."""
    backend = MemoryBackend()
    catalog = ModelCatalog()
    ingestor = Ingestor(backend, catalog)
    scorer = Scorer(backend, catalog)
    tokens = list(range(1, 16 * 4 + 1))
    keys = catalog.hasher("m").keys(tokens)
    pod = StreamId("127.0.0.1:8000")

    def send(seq: int, *events: object) -> None:
        ingestor.deliver([Delivery(pod, "m", seq, EventBatch(1.0, list(events)), 1.0)])

    def by_tier() -> tuple[int, int, int]:
        (only,) = scorer.score("m", tokens).pods
        return only.gpu_blocks, only.cpu_blocks, only.storage_blocks

    send(0, BlockStored(keys[:2], None, tokens[:32], 16),
         BlockStored(keys, None, [], 0, medium="STORAGE", locality="LOCAL"),
         BlockStored(keys, None, [], 0, medium="STORAGE", locality="REMOTE"),
         BlockStored(keys, None, [], 0, medium="CPU", locality="REMOTE"))  # fmt: skip
    assert by_tier() == (2, 0, 2)  # 4 matched: 2 on GPU, the rest in LOCAL storage
    assert ingestor.counts.skipped["remote_locality"] == 2
    # A REMOTE removal cannot take away what LOCAL storage holds.
    send(1, BlockRemoved(keys, medium="STORAGE", locality="REMOTE"))
    assert by_tier() == (2, 0, 2)
    assert ingestor.counts.skipped["remote_locality"] == 3
    send(2, BlockRemoved(keys, medium="STORAGE", locality="LOCAL"))
    assert by_tier() == (2, 0, 0)

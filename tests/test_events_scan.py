"""The compiled payload scanner gives exactly what msgspec's decoder gives, or nothing.

``events/wire/_wire_scan.c`` must take every batch vLLM 0.9-0.33 sends (the captured real
payloads, and generated ones in every release's layout), and for each give the same
timestamp, rank, events, runs and hashes as the msgspec path
(:class:`~kvindex.events.wire.vllm.BatchDecoder` and :func:`~kvindex.events.wire.runs.runs_of`).
For anything else it must return None, never something msgspec would not have decoded
whole: hypothesis mutates valid payloads and builds odd ones to check that. End to end,
ingest through a real subscriber gives the same index with the scanner and without.

The hypothesis tests are derandomized so every run checks the same examples.
"""

from __future__ import annotations

import math
import struct
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.events.ingest import drain as drain_module
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import wait_until
from kvindex.events.wire import scanned as scanned_module
from kvindex.events.wire.layouts import RELEASES, EngineBlockRemoved, EngineBlockStored
from kvindex.events.wire.runs import Run, runs_of
from kvindex.events.wire.scanned import ScannedBatch, scan
from kvindex.events.wire.vllm import (
    BATCH_TYPES,
    MAX_DP_RANK,
    MAX_HASHES_PER_EVENT,
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    Layout,
)
from kvindex.indexer.backend import Tier
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import ModelCatalog
from kvindex.indexer.verify import HashVerifier

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
COMPILED = scanned_module.scanner is not None
needs_scanner = pytest.mark.skipif(not COMPILED, reason="events/wire/_wire_scan.c is not built")


def reference(payload: bytes):
    """What the msgspec path makes of a payload: (batch, layout, runs, hashes)."""
    decoded = BatchDecoder().decode(payload)
    runs = runs_of(decoded.batch)
    return decoded, [tuple(r) for r in runs.runs], bytes(runs.hashes)


def same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def assert_same(payload: bytes, got: ScannedBatch) -> None:
    decoded, runs, hashes = reference(payload)
    assert decoded.skipped == {}
    # a mutated payload can carry a NaN timestamp: the same NaN (release_payloads' ts
    # includes time.time(), so which mutations hit it changes from run to run)
    assert same_float(got.ts, decoded.batch.ts) and type(got.ts) is float
    assert got.data_parallel_rank == decoded.batch.data_parallel_rank
    assert [tuple(r) for r in got.runs] == runs
    assert got.hashes == hashes
    assert got.n_events == len(decoded.batch.events)
    if got.n_events:
        assert got.layout is decoded.layout
    # One event at a time (what the sampled hash check decodes), then all of them;
    # compared as msgpack too, where a NaN (in extra_keys) is equal to itself
    want = decoded.batch.events
    for events in ([got.event(i) for i in range(got.n_events)], got.events):
        assert list(map(type, events)) == list(map(type, want))
        assert events == want or msgspec.msgpack.encode(events) == msgspec.msgpack.encode(want)


def fixture_payloads() -> list[tuple[str, bytes]]:
    out = []
    for folder in sorted(FIXTURES.iterdir()):
        if (folder / "messages.msgpack").exists():
            messages = msgspec.msgpack.decode((folder / "messages.msgpack").read_bytes())
            out += [(folder.name, payload) for _, _, payload in messages]
    return out


# -- the real payloads of 11 vLLM releases ------------------------------------------------


@needs_scanner
@pytest.mark.parametrize(("release", "payload"), fixture_payloads())
def test_real_payloads_scan_exactly_as_msgspec_decodes(release: str, payload: bytes) -> None:
    got = scan(payload)
    assert got is not None, f"the scanner does not take vLLM {release}'s payload"
    assert_same(payload, got)


@needs_scanner
def test_ownership_and_origin_scan_as_msgspec_decodes() -> None:
    """``ownership`` (vLLM 0.29+, KVCR's offload events) and ``origin`` (proposed) are
    skipped by both decoders, on stores and removals (indexer/ingest.py says why)."""
    stored = {"type": "BlockStored", "block_hashes": [7, 2**63 + 1], "parent_block_hash": None}
    stored |= {"token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU"}
    stored |= {"lora_name": None, "group_idx": 0, "ownership": "kvcr", "origin": "REUSED"}
    removed = {"type": "BlockRemoved", "block_hashes": [7], "medium": "CPU"}
    removed |= {"ownership": "kvcr", "origin": "NEW"}
    payload = msgspec.msgpack.encode([1.0, [stored, removed], 0])
    got = scan(payload)
    assert got is not None and got.n_events == 2
    assert_same(payload, got)


def test_fixtures_cover_every_release() -> None:
    assert len({release for release, _ in fixture_payloads()}) >= 11


# -- generated payloads in every release's layout ------------------------------------------

u64 = st.integers(0, 2**64 - 1)
block_hash = u64 | st.binary(max_size=40)
small_int = st.integers(-(2**63), 2**64 - 1) | st.integers(0, 8)
text = st.text(max_size=6)
# Few distinct values, so consecutive events are often alike and form runs.
medium = st.sampled_from([None, "GPU", "CPU", "STORAGE"]) | text
kind = st.sampled_from([None, "full_attention", "sliding_window", "mamba"]) | text
maybe_int = st.none() | st.sampled_from([0, 1, 4096]) | small_int
locality = st.sampled_from([None, "REMOTE", "LOCAL"])
tokens = st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 200), max_size=40)
extra_keys = st.none() | st.lists(
    st.none() | st.lists(text | st.integers(-5, 2**40) | st.none(), max_size=3), max_size=3
)

stored = st.builds(
    EngineBlockStored,
    block_hashes=st.lists(block_hash, max_size=5),
    parent_block_hash=st.none() | block_hash,
    token_ids=tokens,
    block_size=st.sampled_from([16, 0]) | small_int,
    lora_id=st.none() | small_int,
    medium=medium,
    lora_name=st.none() | text,
    extra_keys=extra_keys,
    group_idx=maybe_int,
    kv_cache_spec_kind=kind,
    kv_cache_spec_sliding_window=maybe_int,
    locality=locality,
    ownership=st.none() | text,
    session_id=st.none() | text,
    lookahead_token_ids=st.none() | st.lists(tokens, max_size=2),
)
removed = st.builds(
    EngineBlockRemoved,
    block_hashes=st.lists(block_hash, max_size=5),
    medium=medium,
    group_idx=maybe_int,
    locality=locality,
    ownership=st.none() | text,
)
event = stored | removed | st.just(AllBlocksCleared())
ranks = st.none() | st.integers(0, MAX_DP_RANK + 2)


@st.composite
def release_payloads(draw: st.DrawFn) -> bytes:
    fmt = draw(st.sampled_from(RELEASES))
    events = draw(st.lists(event, max_size=8))
    ts = draw(st.floats(allow_nan=False) | st.just(time.time()))
    return fmt.encode_batch(events, ts, draw(ranks))


@needs_scanner
@settings(max_examples=400, deadline=None, derandomize=True)
@given(release_payloads())
def test_every_release_layout_scans_as_msgspec_decodes(payload: bytes) -> None:
    got = scan(payload)
    rank = BatchDecoder().decode(payload).batch.data_parallel_rank
    if rank is not None and rank > MAX_DP_RANK:
        assert got is None  # the envelope decoder refuses it, and counts it
        return
    assert got is not None, msgspec.msgpack.decode(payload)
    assert_same(payload, got)


# -- anything else: the same answer or none ----------------------------------------------


def check_never_looser(payload: bytes) -> None:
    """When the scanner takes a payload, msgspec's typed decoder takes it whole and
    agrees on everything."""
    got = scan(payload)
    if got is None:
        return
    typed = msgspec.msgpack.Decoder(BATCH_TYPES[got.layout]).decode(payload)  # must not raise
    for e in typed.events:
        assert len(getattr(e, "block_hashes", ())) <= MAX_HASHES_PER_EVENT
    assert_same(payload, got)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    payload = bytearray(draw(release_payloads()))
    for _ in range(draw(st.integers(1, 3))):
        if not payload:
            break
        at = draw(st.integers(0, len(payload) - 1))
        how = draw(st.sampled_from(["set", "insert", "delete"]))
        byte = draw(st.integers(0, 255))
        if how == "set":
            payload[at] = byte
        elif how == "insert":
            payload.insert(at, byte)
        else:
            del payload[at]
    return bytes(payload)


@needs_scanner
@settings(
    max_examples=700,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(mutated())
def test_mutated_payloads_are_refused_or_agree(payload: bytes) -> None:
    check_never_looser(payload)


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
    | st.binary(max_size=10)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
FIELD_NAMES = [
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality",
]  # fmt: skip
tag = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
odd_events = (
    st.builds(lambda t, rest: [t, *rest], tag, st.lists(values, max_size=13))
    | st.builds(
        lambda t, rest: {"type": t, **rest},
        tag,
        st.dictionaries(st.sampled_from(FIELD_NAMES) | text, values, max_size=6),
    )
    | values
)
odd_batches = st.builds(
    lambda ts, events, rest: [ts, events, *rest],
    st.floats(allow_nan=False) | values,
    st.lists(odd_events, max_size=4) | values,
    st.lists(values, max_size=2),
)


@needs_scanner
@settings(max_examples=600, deadline=None, derandomize=True)
@given(odd_batches.map(msgspec.msgpack.encode))
def test_odd_structures_are_refused_or_agree(payload: bytes) -> None:
    check_never_looser(payload)


@needs_scanner
@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.binary(max_size=120))
def test_random_bytes_are_refused_or_agree(payload: bytes) -> None:
    check_never_looser(payload)


def _stored(**fields: object) -> dict:
    return {"type": "BlockStored", "block_hashes": [1, 2], **fields}


REFUSED = {
    "map envelope": {"ts": 1.0, "events": [], "data_parallel_rank": 0},
    "int timestamp": [1, [_stored()], 0],
    "negative hash": [1.0, [_stored(block_hashes=[-1])], 0],
    "unknown tag": [1.0, [{"type": "BlockMoved", "block_hashes": [1]}], 0],
    "tag not first": [1.0, [{"block_hashes": [1], "type": "BlockStored"}], 0],
    "repeated key": None,  # built below: msgspec keeps the last value
    "missing hashes": [1.0, [{"type": "BlockStored"}], 0],
    "mixed layouts": [1.0, [_stored(), ["BlockRemoved", [1]]], 0],
    "medium of the wrong type": [1.0, [_stored(medium=3)], 0],
    "bool as int": [1.0, [_stored(block_size=True)], 0],
    "rank out of range": [1.0, [], MAX_DP_RANK + 1],
    "negative rank": [1.0, [], -1],
    "oversized event": [1.0, [_stored(block_hashes=list(range(MAX_HASHES_PER_EVENT + 1)))], 0],
    "map inside extra keys": [1.0, [_stored(extra_keys=[{"a": 1}])], 0],
}


def _payload(case: str) -> bytes:
    if case == "repeated key":
        event = b"\x83" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("BlockStored")
        event += (msgspec.msgpack.encode("block_hashes") + msgspec.msgpack.encode([1])) * 2
        return b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x91" + event + b"\x00"
    return msgspec.msgpack.encode(REFUSED[case])


@needs_scanner
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_scanner_leaves_to_msgspec(case: str) -> None:
    assert scan(_payload(case)) is None


@needs_scanner
def test_trailing_bytes_and_invalid_utf8_are_refused() -> None:
    good = msgspec.msgpack.encode([1.0, [_stored(medium="GPU")], 0])
    assert scan(good) is not None
    assert scan(good + b"\x00") is None
    assert scan(good[:-1]) is None
    assert scan(good.replace(b"GPU", b"G\xffU")) is None
    with pytest.raises(msgspec.DecodeError):  # and msgspec refuses them too
        msgspec.msgpack.Decoder(BATCH_TYPES[Layout.MAP]).decode(good + b"\x00")


@needs_scanner
def test_runs_group_consecutive_alike_events_and_hash_digests() -> None:
    digest = bytes(range(32))
    events = [
        BlockStored([1, 2], None, [1] * 32, 16, medium="GPU", group_idx=0),
        BlockStored([3, 4], None, [2] * 32, 16, medium="GPU", group_idx=0),
        BlockStored([digest], 4, [3] * 16, 16, medium="GPU", group_idx=0),
        BlockRemoved([1], medium="GPU"),
        AllBlocksCleared(),
    ]
    for fmt in RELEASES:
        payload = fmt.encode_batch(events, 5.0, 0)
        got = scan(payload)
        assert got is not None
        assert_same(payload, got)
        medium = "GPU" if "medium" in fmt.stored_fields else None
        group = 0 if "group_idx" in fmt.stored_fields else None
        last = int.from_bytes(digest[-8:], "big")
        assert got.hashes == struct.pack("=6Q", 1, 2, 3, 4, last, 1)
        assert got.runs[0] == Run(0, 0, 2, 0, 4, True, 16, medium, group, None, None, None)
        assert got.runs[1][:6] == (0, 2, 1, 4, 5, False)  # has a parent: a run of its own
        assert [r[0] for r in got.runs] == [0, 0, 1, 2]


# -- end to end: the same index with the scanner and without ----------------------------


def _ingest_through_subscriber(ctx: zmq.Context, payloads: list[bytes]) -> tuple:
    """Send seq 0 (an empty batch) until the subscription reached the publisher, then
    the payloads as seq 1..n; what the index and the ingest counters hold after."""
    backend = MemoryBackend(hash_seed=1)
    catalog = ModelCatalog()
    verifier = HashVerifier(catalog.keying, catalog.hasher)
    ingestor = Ingestor(backend, catalog, verifier)
    sub = Subscriber(ingestor, SubscriberConfig(catch_up_on_first_contact=False))
    endpoint = sub.bind("tcp://127.0.0.1:0")
    sub.start()
    pub = ctx.socket(zmq.PUB)
    pub.connect(endpoint)
    topic = b"kv@127.0.0.1:8000@m"
    first = [topic, (0).to_bytes(8, "big"), msgspec.msgpack.encode([0.5, [], 0])]

    def heard() -> bool:
        pub.send_multipart(first)
        return bool(sub.streams()) and sub.streams()[0].last_seq == 0

    try:
        assert wait_until(heard, timeout_s=10, poll_s=0.02)
        for seq, payload in enumerate(payloads, start=1):
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        assert wait_until(lambda: sub.streams()[0].last_seq == len(payloads), timeout_s=10)
    finally:
        pub.close(linger=0)
        sub.stop()
    index = {
        (member, model, tier): backend.member_keys(member, model, tier)
        for member in backend.members()
        for model in backend.models()
        for tier in Tier
    }
    counts = ingestor.counts
    check = verifier.status("127.0.0.1:8000")
    errors = {k: v for k, v in sub.error_counts().items() if k != "duplicates"}
    return (
        index,
        dict(counts.events),
        dict(counts.skipped),
        counts.blocks_stored,
        counts.blocks_removed,
        (check.state, check.checked_events, check.failed_events, check.skipped_events),
        errors,
        sub.event_counts(),
    )


def test_ingest_gives_the_same_index_with_and_without_the_scanner(
    ctx: zmq.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvindex.indexer.keys import BlockHasher, HashConfig

    hasher = BlockHasher(HashConfig())
    payloads = [payload for _, payload in fixture_payloads()]
    for fmt in RELEASES:  # real hashes, so the sampled hash check runs and passes
        for i in range(3):
            toks = [fmt.release.count(".") * 1000 + i * 100 + t for t in range(64)]
            events = [
                BlockStored(hasher.keys(toks), None, toks, 16, medium="GPU", group_idx=0),
                BlockStored(hasher.keys(toks[:32]), None, toks[:32], 16, medium="CPU"),
                BlockRemoved(hasher.keys(toks)[2:], medium="GPU", group_idx=0),
            ]
            payloads.append(fmt.encode_batch(events, 7.0 + i, 0))
    payloads.append(msgspec.msgpack.encode([8, [["BlockStored", [99], None, [], 0]], 0]))
    with_scanner = _ingest_through_subscriber(ctx, payloads)
    monkeypatch.setattr(drain_module, "_drain", None)  # the scanner, and pyzmq's receive
    with_pyzmq = _ingest_through_subscriber(ctx, payloads)
    monkeypatch.setattr(scanned_module, "scanner", None)
    without = _ingest_through_subscriber(ctx, payloads)
    assert with_scanner == with_pyzmq == without
    index = with_scanner[0]
    assert any(index.values()) and with_scanner[1]["BlockStored"] > 10

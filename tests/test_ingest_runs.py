"""Ingest a run of like events at a time gives what one event at a time gives.

The ingestor takes a batch as runs of alike events (:mod:`kvindex.events.wire.runs`) and
decides once per run where its events go; counters, the learned KV-group layouts (and
their conflicts) and the sampled hash check must still count every event. Here each
batch is ingested whole (long runs) and as one delivery per event (runs of one), and
everything the two leave behind must be equal; and the scanner's batches (the same
payload read by ``events/wire/_wire_scan.c``) must leave the same as msgspec's.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.events.ingest.sink import Delivery
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.layouts import RELEASES
from kvindex.events.wire.scanned import ScannedBatch, scan
from kvindex.events.wire.vllm import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from kvindex.indexer.backend import Tier
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.keys import BlockHasher, HashConfig
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import ModelCatalog, ModelKeying, ReportMode
from kvindex.indexer.verify import HashVerifier

POD = StreamId("127.0.0.1:8000")
HASHER = BlockHasher(HashConfig())
CHAINS = [list(range(s, s + 64)) for s in (1000, 5000, 9000)]
KEYS = [HASHER.keys(tokens) for tokens in CHAINS]  # real hashes: the hash check passes


def _catalog(full: bool) -> ModelCatalog:
    if full:
        return ModelCatalog(models={"m": ModelKeying(report_mode=ReportMode.FULL)})
    return ModelCatalog()


class Side:
    def __init__(self, full: bool) -> None:
        self.catalog = _catalog(full)
        self.backend = MemoryBackend(hash_seed=3)
        keying, hasher = self.catalog.keying, self.catalog.hasher
        self.verifier = HashVerifier(keying, hasher, full_checks=2, sample_every=3)
        self.ingestor = Ingestor(self.backend, self.catalog, self.verifier)
        self.seq = 0

    def deliver(self, batches: list) -> None:
        deliveries = []
        for batch in batches:
            deliveries.append(Delivery(POD, "m", self.seq, batch, 0.0))
            self.seq += 1
        self.ingestor.deliver(deliveries)

    def state(self) -> tuple:
        b, i = self.backend, self.ingestor
        index = {
            (model, tier): b.member_keys(POD.member, model, tier)
            for model in b.models()
            for tier in Tier
        }
        check = self.verifier.status(POD.member)
        return (
            index,
            dict(i.counts.events),
            dict(i.counts.skipped),
            i.counts.blocks_stored,
            i.counts.blocks_removed,
            i.layouts.all(),
            i.layouts.conflicts,
            (check.state, check.checked_events, check.failed_events, check.skipped_events),
        )


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    chain = draw(st.integers(0, 2))
    start = draw(st.integers(0, 2))
    stop = draw(st.integers(start, 4))
    keys = KEYS[chain][start:stop]
    if draw(st.booleans()):  # a wrong hash: the hash check must count a mismatch
        keys = [k ^ 1 for k in keys]
    return BlockStored(
        keys,
        None if start == 0 else KEYS[chain][start - 1],
        CHAINS[chain][16 * start : 16 * stop],
        draw(st.sampled_from([16, 16, 16, 8])),
        medium=draw(st.sampled_from([None, "GPU", "GPU", "CPU", "DISK"])),
        group_idx=draw(st.sampled_from([None, 0, 0, 1])),
        kv_cache_spec_kind=draw(st.sampled_from([None, "full_attention", "sliding_window"])),
        kv_cache_spec_sliding_window=draw(st.sampled_from([None, 128])),
        locality=draw(st.sampled_from([None, None, "REMOTE"])),
    )


removed = st.builds(
    lambda chain, n, medium, group: BlockRemoved(KEYS[chain][:n], medium, group),
    st.integers(0, 2),
    st.integers(0, 4),
    st.sampled_from([None, "GPU", "CPU"]),
    st.sampled_from([None, 0, 1]),
)
events = st.lists(
    stored() | stored() | removed | st.just(AllBlocksCleared()), min_size=1, max_size=12
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(events, st.booleans())
def test_whole_batches_ingest_as_one_event_at_a_time(batch: list, full: bool) -> None:
    whole, single = Side(full), Side(full)
    whole.deliver([EventBatch(1.0, batch)])
    single.deliver([EventBatch(1.0, [event]) for event in batch])
    assert whole.state() == single.state()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(events, st.sampled_from(RELEASES), st.booleans())
def test_scanned_batches_ingest_as_decoded_ones(batch: list, fmt, full: bool) -> None:
    payload = fmt.encode_batch(batch, 1.0, 0)
    scanned = scan(payload)
    if scanned is None:  # no compiled scanner: the other test covers the msgspec path
        return
    decoded = BatchDecoder().decode(payload).batch
    a, b = Side(full), Side(full)
    a.deliver([scanned])
    b.deliver([decoded])
    assert a.state() == b.state()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(events, min_size=2, max_size=5), st.sampled_from(RELEASES), st.booleans())
def test_consecutive_batches_ingest_as_one_delivery(batches: list, fmt, full: bool) -> None:
    """A delivery of several batches (the applier's runs of in-order messages) leaves
    what delivering them one by one leaves."""
    scans = [scan(fmt.encode_batch(batch, 1.0 + i, 0)) for i, batch in enumerate(batches)]
    if any(s is None for s in scans):  # no compiled scanner: nothing merges
        return
    merged = ScannedBatch.merge(scans)  # type: ignore[arg-type]
    a, b = Side(full), Side(full)
    a.ingestor.deliver([Delivery(POD, "m", 0, merged, 0.0, batches=len(scans))])
    b.deliver(scans)
    assert a.state() == b.state()


def test_a_run_of_conflicting_stores_counts_each_conflict() -> None:
    side = Side(False)
    spec = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    first = BlockStored(KEYS[0][:1], None, CHAINS[0][:16], 16, **spec)
    spec = {"group_idx": 0, "kv_cache_spec_kind": "sliding_window"}
    other = BlockStored(KEYS[1][:1], None, CHAINS[1][:16], 16, **spec)
    side.deliver([EventBatch(1.0, [first])])
    side.deliver([EventBatch(1.0, [other, other, other])])
    assert side.ingestor.layouts.conflicts == 3


def test_the_hash_check_samples_every_event_of_a_run() -> None:
    side = Side(False)  # the first 2 events checked, then one in 3
    good = BlockStored(KEYS[0][:2], None, CHAINS[0][:32], 16)
    side.deliver([EventBatch(1.0, [good] * 10)])
    check = side.verifier.status(POD.member)
    # seen 0, 1 (the full checks), then 3, 6, 9
    assert check.checked_events == 5 and check.failed_events == 0

"""Memory-backend snapshots in one process: the file format, the index's state round
trip, the gate's resume answers and marks, and consistent cuts taken while a real
subscriber applies a real ZMQ stream."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.gate import Ownership
from kvindex.events.ingest.sink import Delivery
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import wait_until
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import AllBlocksCleared, BlockStored, EventBatch
from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.snapshot import SnapshotGate, Snapshotter, StreamPosition
from kvindex.indexer.memory.snapshot_file import SnapshotError, read_snapshot, write_snapshot
from kvindex.indexer.models import KeyMode, ModelCatalog, ModelKeying

POD = "127.0.0.1:8000"
LOOPBACK = "tcp://127.0.0.1:0"


# -- the file -------------------------------------------------------------------------------


def test_file_round_trip_keeps_arrays_and_scalars(tmp_path: Path) -> None:
    tree = {
        "keys": np.arange(1000, dtype=np.uint64) * np.uint64(2**54),
        "nested": [None, {"masks": np.ones((7, 3), np.uint64), "empty": np.zeros(0, np.uint32)}],
        "shapes": [np.zeros((0, 3), np.int64), np.array(5, np.int64), np.ones((2, 0), np.uint8)],
        "scalars": {"big": 2**64 - 1, "text": "pod/dp1", "raw": b"\x00\xff", "flag": True},
    }
    path = tmp_path / "index.snap"
    size = write_snapshot(path, tree)
    assert size == path.stat().st_size
    back = read_snapshot(path)
    assert np.array_equal(back["keys"], tree["keys"]) and back["keys"].dtype == np.uint64
    assert np.array_equal(back["nested"][1]["masks"], tree["nested"][1]["masks"])
    assert back["nested"][1]["empty"].size == 0 and back["nested"][0] is None
    assert back["scalars"] == tree["scalars"]
    assert [(a.shape, a.dtype) for a in back["shapes"]] == [
        (a.shape, a.dtype) for a in tree["shapes"]
    ]
    assert int(back["shapes"][1]) == 5
    assert back["keys"].flags.writeable  # the index goes on changing restored arrays
    assert [p.name for p in tmp_path.iterdir()] == ["index.snap"]  # no temporary left
    assert oct(path.stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: b"PK\x03\x04" + b[4:], "foreign"),
        (lambda b: b[:8] + b"\x00\x00\x00\x07" + b[12:], "version"),
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: b[:-40] + bytes([b[-40] ^ 0x10]) + b[-39:], "corrupt"),  # an array byte
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "corrupt"),  # the checksum itself
        (lambda b: b + b"x", "corrupt"),
        (lambda b: b"", "truncated"),
    ],
)
def test_a_damaged_or_foreign_file_is_refused_with_its_reason(
    tmp_path: Path, damage, reason: str
) -> None:
    path = tmp_path / "index.snap"
    write_snapshot(path, {"keys": np.arange(100, dtype=np.uint64), "n": 3})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(SnapshotError) as caught:
        read_snapshot(path)
    assert caught.value.reason == reason, str(caught.value)
    assert str(path) in str(caught.value)


def test_a_missing_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError) as caught:
        read_snapshot(tmp_path / "nothing")
    assert caught.value.reason == "missing"


# -- the index's state ----------------------------------------------------------------------


def _filled_backend(capacity: int | None = None) -> MemoryBackend:
    backend = MemoryBackend(capacity)
    rng = np.random.default_rng(7)
    for i in range(70):  # more than 64 members: two mask words
        backend.apply([Change(Op.STORE, f"127.10.0.{i}:8000", "m", Tier.GPU,
                              rng.integers(1, 2**64 - 1, 500, dtype=np.uint64))])  # fmt: skip
    backend.apply(
        [
            Change(Op.STORE, "127.10.0.1:8000", "m", Tier.CPU, [0, 1, 2]),  # key 0: its own slot
            Change(Op.STORE, "127.10.0.2:8000/dp1", "other", Tier.STORAGE, [5, 6]),
            Change(Op.STORE, "127.10.0.6:8000", "m", Tier.GPU, [7, 8, 9]),  # held twice over
            Change(Op.STORE, "127.10.0.6:8000", "m", Tier.GPU, [7, 8]),
            Change(Op.CLEAR, "127.10.0.3:8000", "m", None),  # a freed member id
            Change(Op.REMOVE, "127.10.0.4:8000", "m", Tier.GPU, backend.member_keys(
                "127.10.0.4:8000", "m")[:100]),
        ]
    )  # fmt: skip
    return backend


def _contents(backend: MemoryBackend) -> dict:
    return {
        (member, model, tier): backend.member_keys(member, model, tier)
        for member in backend.members()
        for model in backend.models()
        for tier in Tier
    }


def test_backend_state_round_trip_gives_the_same_index_that_keeps_working() -> None:
    original = _filled_backend()
    restored = MemoryBackend()
    restored.from_state(original.to_state())
    assert _contents(restored) == _contents(original)
    assert restored.members() == original.members()
    before, after = original.stats(), restored.stats()
    assert (after.keys, after.members, after.blocks) == (before.keys, before.members, before.blocks)
    chain = original.member_keys("127.10.0.1:8000", "m", Tier.CPU)
    assert restored.lookup("m", chain) == original.lookup("m", chain)
    # The restored index goes on: the same changes give the same index.
    gone = original.member_keys("127.10.0.5:8000", "m")
    more = [
        Change(Op.STORE, "new:8000", "m", Tier.GPU, list(range(1, 5000))),
        Change(Op.REMOVE, "127.10.0.5:8000", "m", Tier.GPU, gone),
        Change(Op.REMOVE, "127.10.0.6:8000", "m", Tier.GPU, [7, 8, 9]),  # one removal each
    ]
    original.apply(more)
    restored.apply(more)
    assert _contents(restored) == _contents(original)


def test_state_from_a_bounded_index_restores_into_a_bounded_one_and_evicts_to_fit() -> None:
    original = _filled_backend()
    keys = original.stats().keys
    bounded = MemoryBackend(capacity_blocks=keys // 2)
    bounded.from_state(original.to_state())
    assert bounded.stats().keys <= keys // 2
    unbounded = MemoryBackend()
    unbounded.from_state(_filled_backend(capacity=10**6).to_state())  # stamps dropped
    assert _contents(unbounded) == _contents(original)


def test_a_state_that_does_not_fit_is_refused_and_leaves_the_index_alone() -> None:
    state = _filled_backend().to_state()
    state["tables"]["m"]["keys"] = state["tables"]["m"]["keys"][:-1]
    backend = MemoryBackend()
    backend.apply([Change(Op.STORE, "keep:8000", "m", Tier.GPU, [1, 2, 3])])
    with pytest.raises(ValueError, match="keys"):
        backend.from_state(state)
    assert backend.member_keys("keep:8000", "m") == [1, 2, 3]


def test_ingestor_state_keeps_what_shapes_future_events() -> None:
    """Token-key mode: removals carry only engine hashes, so the engine-hash -> own-key
    map (and whatever it counts) must survive; the same future events must then give
    the same index as in the process that never restarted."""
    catalog = ModelCatalog(ModelKeying(key_mode=KeyMode.TOKENS))
    backend = MemoryBackend()
    ingestor = Ingestor(backend, catalog)
    stream = StreamId(POD)
    tokens = list(range(64))
    past = [
        BlockStored([11, 12, 13, 14], None, tokens, 16),
        BlockStored([11, 12, 13, 14], None, tokens, 16),  # the same blocks again
        BlockStored([21, 22], None, list(range(100, 132)), 16, medium="CPU"),
    ]
    for seq, event in enumerate(past):
        ingestor.deliver([Delivery(stream, "m", seq, EventBatch(0.0, [event]), 0.0)])
    restored_backend = MemoryBackend()
    restored_backend.from_state(backend.to_state())
    restored = Ingestor(restored_backend, catalog)
    restored.from_state(ingestor.to_state())
    from kvindex.events.wire.vllm import BlockRemoved

    future = [BlockRemoved([13, 14]), BlockRemoved([21], medium="CPU"), BlockRemoved([12])]
    for seq, event in enumerate(future, len(past)):
        for sink in (ingestor, restored):
            sink.deliver([Delivery(stream, "m", seq, EventBatch(0.0, [event]), 0.0)])
    assert _contents(restored_backend) == _contents(backend)
    assert _contents(backend)  # something is left to compare


def test_copies_survive_a_round_trip_in_the_index_and_the_token_key_map() -> None:
    """Extra copies (one hash in two physical blocks) are part of the state: after a
    restore, one removal still leaves the second copy held."""
    original = _filled_backend()
    original.apply(
        [
            Change(Op.STORE, "127.10.0.1:8000", "m", Tier.GPU, [7, 8]),
            Change(Op.STORE, "127.10.0.1:8000", "m", Tier.GPU, [8]),
            Change(Op.STORE, "127.10.0.1:8000", "m", Tier.CPU, [8, 8]),
        ]
    )
    restored = MemoryBackend()
    restored.from_state(original.to_state())
    removal = [Change(Op.REMOVE, "127.10.0.1:8000", "m", t, [7, 8]) for t in (Tier.GPU, Tier.CPU)]
    restored.apply(removal)
    original.apply(removal)
    assert _contents(restored) == _contents(original)
    assert 8 in restored.member_keys("127.10.0.1:8000", "m", Tier.GPU)
    assert restored.member_keys("127.10.0.1:8000", "m", Tier.CPU) == [0, 1, 2, 8]

    catalog = ModelCatalog(ModelKeying(key_mode=KeyMode.TOKENS))
    backend = MemoryBackend()
    ingestor = Ingestor(backend, catalog)
    stream, tokens = StreamId(POD), list(range(32))
    stores = [BlockStored([11, 12], None, tokens, 16), BlockStored([12], 11, tokens[16:], 16)]
    ingestor.deliver([Delivery(stream, "m", 0, EventBatch(0.0, stores), 0.0)])
    restored_backend = MemoryBackend()
    restored_backend.from_state(backend.to_state())
    again = Ingestor(restored_backend, catalog)
    again.from_state(ingestor.to_state())
    from kvindex.events.wire.vllm import BlockRemoved

    again.deliver([Delivery(stream, "m", 1, EventBatch(0.0, [BlockRemoved([12])]), 0.0)])
    assert len(restored_backend.member_keys(POD, "m")) == 2  # the second copy of 12
    again.deliver([Delivery(stream, "m", 2, EventBatch(0.0, [BlockRemoved([12])]), 0.0)])
    assert len(restored_backend.member_keys(POD, "m")) == 1


# -- the gate -------------------------------------------------------------------------------


def test_restored_streams_resume_from_their_seq_and_digest_others_need_everything() -> None:
    gate = SnapshotGate()
    known, other = StreamId(POD), StreamId("127.0.0.9:8000", 1)
    gate.restore([(known, StreamPosition(41, b"d" * 16, "m"), False)])
    assert gate.marks()[POD].state == "restored"
    claim = gate.claim(known)
    assert (claim.ownership, claim.resume_after, claim.resume_digest) == (
        Ownership.OWNED, 41, b"d" * 16
    )  # fmt: skip
    assert gate.claim(known) is claim  # the same epoch: no second takeover
    assert POD not in gate.marks()  # heard: the subscriber's own state tells from here
    assert gate.claim(other).resume_after == -1  # not in the snapshot: history from seq 0


def test_without_a_snapshot_streams_join_as_always() -> None:
    claim = SnapshotGate().claim(StreamId(POD))
    assert claim.ownership is Ownership.OWNED and claim.resume_after is None


def test_an_incomplete_stream_stays_marked_until_its_engine_clears_or_restarts() -> None:
    gate = SnapshotGate()
    sink_calls: list[str] = []

    class Inner:
        def deliver(self, deliveries: list[Delivery]) -> None:
            sink_calls.append("deliver")

        def reset(self, stream: StreamId, reason: str) -> None:
            sink_calls.append("reset")

    a, b = StreamId(POD), StreamId("127.0.0.2:8000")
    gate.restore([(a, StreamPosition(5, None, "m"), True), (b, StreamPosition(9, None, "m"), True)])
    sink = gate.wrap(Inner())
    gate.claim(a)
    sink.deliver([Delivery(a, "m", 6, EventBatch(0.0, [BlockStored([1], None, [], 0)]), 0.0)])
    gate.committed(a, 6)
    assert gate.marks()[POD].state == "incomplete"
    sink.deliver([Delivery(a, "m", 7, EventBatch(0.0, [AllBlocksCleared()]), 0.0)])
    gate.committed(a, 7)
    assert POD not in gate.marks()
    sink.reset(b, "engine_restart")
    assert gate.marks() == {}
    _, streams = gate.cut(dict)
    assert [(s, p.seq, flag) for s, p, flag in streams] == [(a, 7, False)]


def test_a_cut_waits_for_the_delivery_in_flight_to_be_committed() -> None:
    gate = SnapshotGate()
    stream = StreamId(POD)

    class Inner:
        def deliver(self, deliveries: list[Delivery]) -> None: ...

        def reset(self, stream: StreamId, reason: str) -> None: ...

    sink = gate.wrap(Inner())
    sink.deliver([Delivery(stream, "m", 0, EventBatch(0.0, []), 0.0)])
    assert gate.cut(dict, timeout_s=0.05) is None  # delivered, not yet committed
    done = threading.Timer(0.05, gate.committed, (stream, 0, b"x"))
    done.start()
    cut = gate.cut(dict, timeout_s=5.0)
    done.join()
    assert cut is not None and cut[1][0][1] == StreamPosition(0, b"x", "m")


# -- consistent cuts under a live stream ------------------------------------------------------


def test_cuts_taken_while_a_real_stream_applies_match_their_positions_exactly(
    ctx: zmq.Context, tmp_path: Path
) -> None:
    """Batch ``s`` stores key ``s + 1``: a consistent cut holds exactly keys 1..seq + 1."""
    backend = MemoryBackend()
    ingestor = Ingestor(backend, ModelCatalog())
    gate = SnapshotGate()
    config = SubscriberConfig(replay_timeout_s=5.0, retry_initial_s=0.02, retry_max_s=0.2)
    snapshotter = Snapshotter(tmp_path / "s.snap", 0, backend, ingestor, gate)
    sub = Subscriber(gate.wrap(ingestor), config, gate=gate, context=ctx)
    pub = EnginePublisher(LOOPBACK, bind=True, replay_endpoint=LOOPBACK, context=ctx)
    sub.start()
    try:
        sub.connect(
            PodEndpoint(pub.endpoint, pod=POD, model="m", replay_endpoint=pub.replay_endpoint)
        )
        assert pub.wait_for_subscribers(1)
        total = 3000
        cuts = []

        def cut_repeatedly() -> None:
            while len(cuts) < 40:
                if snapshotter.write():
                    cuts.append(read_snapshot(tmp_path / "s.snap"))

        cutter = threading.Thread(target=cut_repeatedly)
        cutter.start()
        for seq in range(total):
            pub.publish([BlockStored([seq + 1], None, [], 0)])
            if seq % 20 == 0:
                time.sleep(0.01)  # spread the applying over many cuts
        cutter.join(timeout=60)
        assert not cutter.is_alive()
        assert wait_until(lambda: len(backend.member_keys(POD, "m")) == total, 10.0)
    finally:
        sub.stop()
        pub.close()
    positions = []
    for tree in cuts:
        index = MemoryBackend()
        index.from_state(tree["index"])
        held = index.member_keys(POD, "m")
        seq = tree["streams"][0]["seq"] if tree["streams"] else -1
        assert held == list(range(1, seq + 2)), (seq, len(held))
        positions.append(seq)
    assert len(set(positions)) > 2  # the cuts really fell between different deliveries


# -- configuration ----------------------------------------------------------------------------


def test_snapshot_settings_that_cannot_work_are_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    from kvindex.api.serve.cli import _settings_from, build_parser
    from kvindex.api.serve.service import Service
    from kvindex.api.serve.settings_derived import ConfigError
    from kvindex.api.serve.settings_sources import from_flags

    with pytest.raises(ConfigError, match="memory backend"):
        Service(from_flags(backend="redis://127.0.0.1:6379/15", snapshot=str(tmp_path / "s")))
    with pytest.raises(ConfigError, match="does not exist"):
        Service(from_flags(snapshot=str(tmp_path / "no-such-dir" / "s")))
    args = build_parser().parse_args(["serve"])
    env = {"KVINDEX_SNAPSHOT": str(tmp_path / "s"), "KVINDEX_SNAPSHOT_INTERVAL": "0.5"}
    settings = _settings_from(args, env)
    assert (settings.index.snapshot, settings.index.snapshot_interval) == (str(tmp_path / "s"), 0.5)
    with pytest.raises(ConfigError, match="not a number"):
        _settings_from(args, {"KVINDEX_SNAPSHOT_INTERVAL": "soon"})

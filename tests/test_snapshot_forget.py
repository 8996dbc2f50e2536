"""A pod restored from a snapshot and removed before any of its batches arrived.

Discovery removes a pod (deleted, finished, moved) with ``Subscriber.forget_pod``. After a
restart from a snapshot the pod's entries are in the index, but until its engine is heard
again there is no stream to remove: its entries must go all the same, or /score keeps
routing to a pod that no longer exists.
"""

from __future__ import annotations

from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.wire.identity import StreamId
from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.snapshot import SnapshotGate, StreamPosition
from kvindex.indexer.models import ModelCatalog

GONE = StreamId("127.0.0.1:8000", 0)
KEPT = StreamId("127.0.0.2:8000", 0)


def test_a_restored_pod_removed_before_it_is_heard_loses_its_entries() -> None:
    backend = MemoryBackend()
    backend.apply([Change(Op.STORE, s.member, "m", Tier.GPU, [1, 2, 3]) for s in (GONE, KEPT)])
    gate = SnapshotGate()  # as Snapshotter.restore leaves it: positions, nobody heard yet
    gate.restore([(s, StreamPosition(4, None, "m"), False) for s in (GONE, KEPT)])
    sub = Subscriber(gate.wrap(Ingestor(backend, ModelCatalog())), SubscriberConfig(), gate=gate)
    sub.start()
    try:
        sub.forget_pod(GONE.pod)  # discovery: the pod is gone
        assert backend.member_keys(GONE.member, "m") == []
        assert backend.member_keys(KEPT.member, "m") == [1, 2, 3]
        assert set(gate.marks()) == {KEPT.member}  # no "restored" mark for a removed pod
        assert gate.unheard() == [KEPT]
    finally:
        sub.stop()


def test_forgetting_a_restored_pod_needs_no_running_applier() -> None:
    backend = MemoryBackend()
    backend.apply([Change(Op.STORE, GONE.member, "m", Tier.GPU, [7])])
    gate = SnapshotGate()
    gate.restore([(GONE, StreamPosition(0, None, "m"), False)])
    sub = Subscriber(gate.wrap(Ingestor(backend, ModelCatalog())), SubscriberConfig(), gate=gate)
    try:
        sub.forget_pod(GONE.pod)  # before start: runs inline
        assert backend.member_keys(GONE.member, "m") == []
        assert gate.unheard() == []
    finally:
        sub.stop()

"""Where each client session last ran, as ingest learns it from the engines' stores:
the map's bounds and resets (:mod:`kvindex.indexer.sessions`), the session ids read off
the wire (:mod:`kvindex.events.wire.sessions`, both payload paths), and what SGLang
0.5.23's own publisher sent (the captured fixture)."""

from __future__ import annotations

import pytest

from kvindex.events.ingest.sink import Delivery
from kvindex.events.wire import scanned as scanned_module
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.layouts import EngineBlockStored, wire_format
from kvindex.events.wire.scanned import ScannedBatch, scan
from kvindex.events.wire.sessions import MAX_SESSION_ID_CHARS, stored_sessions
from kvindex.events.wire.sglang import SglangBatchDecoder
from kvindex.events.wire.vllm import AllBlocksCleared, BatchDecoder, BlockRemoved, EventBatch
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import ModelCatalog
from kvindex.indexer.sessions import SessionPods
from tests.test_sglang_events import payloads as sglang_payloads

POD_A, POD_B = StreamId("127.0.0.1:8000"), StreamId("127.0.0.2:8000")


def test_the_map_keeps_the_latest_member_per_model_and_session() -> None:
    pods = SessionPods()
    pods.stored("m", "a", ["s1", "s2"])
    pods.stored("other", "b", ["s1"])
    pods.stored("m", "b", ["s2"])  # the session's next turn was computed on b
    assert pods.member_of("m", "s1") == "a"
    assert pods.member_of("m", "s2") == "b"
    assert pods.member_of("other", "s1") == "b"
    assert pods.member_of("m", "s3") is None
    assert len(pods) == 3


def test_the_least_recently_stored_session_goes_first_past_the_bound() -> None:
    pods = SessionPods(max_sessions=3)
    pods.stored("m", "a", ["s1", "s2", "s3"])
    pods.stored("m", "a", ["s1"])  # stored again: now the newest
    pods.stored("m", "b", ["s4"])
    assert len(pods) == 3
    assert pods.member_of("m", "s2") is None
    assert [pods.member_of("m", s) for s in ("s1", "s3", "s4")] == ["a", "a", "b"]
    pods.stored("m", "b", [f"x{i}" for i in range(10)])
    assert len(pods) == 3
    assert pods.forget("a") == 0  # its sessions left with the bound, and its record
    with pytest.raises(ValueError, match="at least 1"):
        SessionPods(max_sessions=0)


def test_forgetting_a_member_drops_its_sessions_only() -> None:
    pods = SessionPods()
    pods.stored("m", "a", ["s1", "s2"])
    pods.stored("m", "b", ["s3"])
    pods.stored("m", "b", ["s2"])  # moved to b: forgetting a must not drop it
    assert pods.forget("a") == 1
    assert pods.member_of("m", "s1") is None
    assert pods.member_of("m", "s2") == "b"
    assert pods.forget("b") == 2
    assert len(pods) == 0


def stored(session: str | None, medium: str | None = "GPU", **kw: object) -> EngineBlockStored:
    return EngineBlockStored([1, 2], None, list(range(32)), 16, medium=medium,
                             session_id=session, **kw)  # fmt: skip


def payload(*events: object, release: str = "0.33") -> bytes:
    return wire_format(release).encode_batch(list(events), 1.0)


def mixed_payload() -> bytes:
    return payload(
        stored("chat-1"),
        stored("chat-2", medium=None),  # vLLM's default medium is the GPU
        stored("offloaded", medium="CPU"),
        stored("shared-pool", locality="REMOTE"),
        stored("t" * (MAX_SESSION_ID_CHARS + 1)),
        stored(None),
        BlockRemoved([1]),
    )


def test_sessions_are_read_from_gpu_stores_of_decoded_batches() -> None:
    decoded = BatchDecoder().decode(mixed_payload()).batch
    assert isinstance(decoded, EventBatch)
    assert stored_sessions(decoded) == {"chat-1", "chat-2"}
    # Releases before 0.30 (and array events) carry none.
    old = payload(stored("chat-1"), release="0.29")
    assert stored_sessions(BatchDecoder().decode(old).batch) == set()
    assert stored_sessions(BatchDecoder().decode(payload(stored(None))).batch) == set()


@pytest.mark.skipif(scanned_module.scanner is None, reason="events/wire/_wire_scan.c is not built")
def test_scanned_payloads_give_the_sessions_decoded_ones_give() -> None:
    body = mixed_payload()
    scanned = scan(body)
    assert isinstance(scanned, ScannedBatch)  # the compiled scanner took it
    assert stored_sessions(scanned) == stored_sessions(BatchDecoder().decode(body).batch)
    assert stored_sessions(scanned) == {"chat-1", "chat-2"}
    old = payload(stored("chat-1"), release="0.29")
    assert stored_sessions(scan(old) or BatchDecoder().decode(old).batch) == set()


class Ingest:
    def __init__(self) -> None:
        self.ingestor = Ingestor(MemoryBackend(), ModelCatalog())
        self.seq = 0

    def send(self, stream: StreamId, body: bytes, model: str = "m") -> None:
        batch = scan(body) or BatchDecoder().decode(body).batch
        self.ingestor.deliver([Delivery(stream, model, self.seq, batch, 0.0)])
        self.seq += 1


def test_ingest_learns_sessions_and_forgets_them_on_reset_and_clear() -> None:
    ingest = Ingest()
    sessions = ingest.ingestor.sessions
    ingest.send(POD_A, payload(stored("s1"), stored("s2")))
    ingest.send(POD_B, payload(stored("s3")))
    ingest.send(POD_B, payload(stored("s2")))  # s2's next turn was computed on B
    assert [sessions.member_of("m", s) for s in ("s1", "s2", "s3")] == [
        POD_A.member,
        POD_B.member,
        POD_B.member,
    ]
    ingest.send(POD_A, payload(AllBlocksCleared()))
    assert sessions.member_of("m", "s1") is None
    assert sessions.member_of("m", "s2") == POD_B.member
    ingest.ingestor.reset(POD_B, "pod_removed")
    assert len(sessions) == 0


def test_what_sglangs_own_publisher_sent_places_its_sessions() -> None:
    """SGLang 0.5.23 (``sglang_driver.py``'s workload): pod A stored for s1 and s2 on its
    GPU; pod B for s3, then cleared its cache, then stored for s4."""
    decoder = SglangBatchDecoder()
    ingestor = Ingestor(MemoryBackend(), ModelCatalog())
    for seq, (pod, body) in enumerate(sglang_payloads()):
        batch = decoder.decode(body).batch
        ingestor.deliver([Delivery(StreamId(pod), "sglang-model", seq, batch, 0.0)])
    found = {s: ingestor.sessions.member_of("sglang-model", s) for s in ("s1", "s2", "s3", "s4")}
    assert found == {
        "s1": "127.0.0.41:8000",
        "s2": "127.0.0.41:8000",
        "s3": None,
        "s4": "127.0.0.42:8000",
    }
    # The compiled scanner's path reads the same sessions from the same payloads.
    for _, body in sglang_payloads():
        scanned = scan(body)
        if scanned is not None:
            assert stored_sessions(scanned) == stored_sessions(decoder.decode(body).batch)

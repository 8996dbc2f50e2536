"""The subscriber under a StreamGate (several replicas, one index): real sockets, a gate
whose answers the test sets."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq

from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.gate import NOT_OWNED, UNKNOWN, Claim, Ownership
from kvindex.events.ingest.recovery import payload_digest
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink, wait_until
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored

POD = "127.0.0.1:8000"
LOOPBACK = "tcp://127.0.0.1:0"
CONFIG = {"replay_timeout_s": 5.0, "retry_initial_s": 0.02, "retry_max_s": 0.2}


class FakeGate:
    """A StreamGate whose answer the test sets; records commits and releases."""

    def __init__(self, claim: Claim) -> None:
        self._lock = threading.Lock()
        self._claim = claim
        self.commits: list[tuple[StreamId, int]] = []
        self.digests: list[bytes | None] = []
        self.released: list[StreamId] = []

    def set(self, claim: Claim) -> None:
        with self._lock:
            self._claim = claim

    def claim(self, stream: StreamId) -> Claim:
        with self._lock:
            return self._claim

    def committed(self, stream: StreamId, seq: int, digest: bytes | None = None) -> None:
        with self._lock:
            self.commits.append((stream, seq))
            self.digests.append(digest)

    def settled(self, stream: StreamId, epoch: int, model: str, state: str) -> None:
        pass

    def release(self, stream: StreamId) -> None:
        with self._lock:
            self.released.append(stream)

    def unheard(self, pod: str | None = None) -> list[StreamId]:
        return []

    def last_commit(self) -> int | None:
        with self._lock:
            return self.commits[-1][1] if self.commits else None


def owned(epoch: int, after: int | None = None) -> Claim:
    return Claim(Ownership.OWNED, epoch, after)


@pytest.fixture
def setup(ctx: zmq.Context) -> Iterator:
    made: list[Subscriber] = []
    pubs: list[EnginePublisher] = []

    def make(claim: Claim) -> tuple[Subscriber, RecordingSink, FakeGate, EnginePublisher]:
        sink, gate = RecordingSink(), FakeGate(claim)
        sub = Subscriber(sink, SubscriberConfig(**CONFIG), gate=gate)
        made.append(sub)
        sub.start()
        pub = EnginePublisher(LOOPBACK, bind=True, replay_endpoint=LOOPBACK, context=ctx)
        pubs.append(pub)
        sub.connect(
            PodEndpoint(pub.endpoint, pod=POD, model="m", replay_endpoint=pub.replay_endpoint)
        )
        assert pub.wait_for_subscribers(1)
        return sub, sink, gate, pub

    yield make
    for sub in made:
        sub.stop()
    for pub in pubs:
        pub.close()


def publish(pub: EnginePublisher, n: int) -> None:
    for i in range(n):
        pub.publish([BlockStored([pub.next_seq * 100 + i], None, [1] * 16, 16)])


def state(sub: Subscriber) -> dict:
    streams = sub.streams()
    return {"state": streams[0].state, "not_owner": streams[0].not_owner} if streams else {}


def test_streams_owned_elsewhere_are_dropped_and_counted(setup) -> None:
    sub, sink, _, pub = setup(NOT_OWNED)
    publish(pub, 3)
    assert wait_until(lambda: state(sub) == {"state": "standby", "not_owner": 3})
    assert sink.seqs() == []
    assert sub.error_counts()["not_owner"] == 3
    assert sub.totals()["not_owner"] == 3


def test_takeover_resumes_after_the_previous_owners_position_by_replay(setup) -> None:
    sub, sink, gate, pub = setup(NOT_OWNED)
    publish(pub, 5)  # seqs 0..4; the other replica applied up to 1, then died
    assert wait_until(lambda: state(sub).get("not_owner") == 5)
    gate.set(owned(1, after=1))
    # No new batch is needed: the periodic ownership check starts the replay.
    assert sink.wait_for(lambda s: s.seqs() == [2, 3, 4], timeout_s=5.0), sink.seqs()
    assert wait_until(lambda: gate.last_commit() == 4)
    assert state(sub)["state"] == "live"
    publish(pub, 1)
    assert sink.wait_for(lambda s: s.seqs() == [2, 3, 4, 5])


def test_unknown_ownership_keeps_batches_queued_until_owned(setup) -> None:
    sub, sink, gate, pub = setup(UNKNOWN)
    publish(pub, 3)
    assert wait_until(lambda: state(sub).get("state") == "resync")
    assert sink.seqs() == [] and state(sub)["not_owner"] == 0
    gate.set(owned(1))  # nothing stored yet: start from the engine's first batch
    assert sink.wait_for(lambda s: s.seqs() == [0, 1, 2]), sink.seqs()


def test_a_replica_that_loses_the_stream_stops_applying(setup) -> None:
    sub, sink, gate, pub = setup(owned(1))
    publish(pub, 2)
    assert sink.wait_for(lambda s: s.seqs() == [0, 1])
    gate.set(NOT_OWNED)
    assert wait_until(lambda: state(sub).get("state") == "standby")
    publish(pub, 2)
    assert wait_until(lambda: state(sub).get("not_owner") == 2)
    assert sink.seqs() == [0, 1]
    # Won back under a new epoch with the other owner's position: replay from there.
    gate.set(owned(2, after=2))
    assert sink.wait_for(lambda s: s.seqs() == [0, 1, 3]), sink.seqs()


def test_a_forgotten_pod_is_released(setup) -> None:
    sub, sink, gate, pub = setup(owned(1))
    publish(pub, 1)
    assert sink.wait_for_count(1)
    sub.forget_pod(POD)
    assert wait_until(lambda: gate.released == [StreamId(POD)])


# -- resuming from a stored digest (a takeover, a restored snapshot) ---------------------


def resume(epoch: int, after: int, digest: bytes) -> Claim:
    return Claim(Ownership.OWNED, epoch, after, digest)


def publish_payloads(pub: EnginePublisher, n: int) -> list[bytes]:
    payloads = [pub.encode([BlockStored([1000 + i], None, [1] * 16, 16)]) for i in range(n)]
    for payload in payloads:
        pub.publish_payload(payload)
    return payloads


def test_commits_carry_the_applied_batch_digest(setup) -> None:
    _, sink, gate, pub = setup(owned(1))
    payloads = publish_payloads(pub, 3)
    assert sink.wait_for_count(3)
    assert wait_until(lambda: gate.last_commit() == 2)
    assert gate.digests[-1] == payload_digest(payloads[2])


def test_takeover_with_a_matching_digest_resumes_live(setup) -> None:
    sub, sink, gate, pub = setup(NOT_OWNED)
    payloads = publish_payloads(pub, 5)
    assert wait_until(lambda: state(sub).get("not_owner") == 5)
    gate.set(resume(1, 2, payload_digest(payloads[2])))
    assert sink.wait_for(lambda s: s.seqs() == [3, 4]), sink.seqs()
    assert wait_until(lambda: state(sub)["state"] == "live")
    assert sink.resets == []


def test_takeover_with_another_incarnations_digest_resets(setup) -> None:
    sub, sink, gate, pub = setup(NOT_OWNED)
    publish_payloads(pub, 5)
    assert wait_until(lambda: state(sub).get("not_owner") == 5)
    # The stored position was applied from an engine that has restarted since.
    gate.set(resume(1, 2, payload_digest(b"the previous engine's batch 2")))
    assert sink.wait_for(lambda s: s.seqs() == [0, 1, 2, 3, 4]), sink.seqs()
    assert sink.log[0][0] == "reset"  # before any batch of the new incarnation
    assert sink.resets[0].reason == "engine_restart"
    assert wait_until(lambda: state(sub)["state"] == "live")


def test_takeover_the_engine_can_no_longer_verify_is_incomplete(ctx) -> None:
    sink, gate = RecordingSink(), FakeGate(NOT_OWNED)
    sub = Subscriber(sink, SubscriberConfig(**CONFIG), gate=gate)
    sub.start()
    with EnginePublisher(
        LOOPBACK, bind=True, replay_endpoint=LOOPBACK, buffer_steps=2, context=ctx
    ) as pub:
        sub.connect(
            PodEndpoint(pub.endpoint, pod=POD, model="m", replay_endpoint=pub.replay_endpoint)
        )
        assert pub.wait_for_subscribers(1)
        payloads = publish_payloads(pub, 5)  # the buffer keeps only 3 and 4
        assert wait_until(lambda: state(sub).get("not_owner") == 5)
        gate.set(resume(1, 1, payload_digest(payloads[1])))
        assert sink.wait_for(lambda s: s.seqs() == [3, 4]), sink.seqs()
        assert wait_until(lambda: state(sub)["state"] == "incomplete")
    sub.stop()
    assert sink.resets == []  # the entries are kept: not known wrong, only incomplete


def test_takeover_past_everything_the_engine_has_resets(setup) -> None:
    sub, sink, gate, pub = setup(NOT_OWNED)
    publish_payloads(pub, 3)
    assert wait_until(lambda: state(sub).get("not_owner") == 3)
    # The stored position is beyond the engine's newest seq: it restarted since.
    gate.set(resume(1, 10, payload_digest(b"batch 10 of the previous engine")))
    assert sink.wait_for(lambda s: s.seqs() == [0, 1, 2]), sink.seqs()
    assert sink.log[0][0] == "reset" and sink.resets[0].reason == "engine_restart"
    assert wait_until(lambda: state(sub)["state"] == "live")

"""Bind mode's door (issue 10 item 6a/b/d): who may speak for a pod.

Pure decisions first, then hostile senders against a real bind-mode subscriber on
loopback: each "host" is a loopback address (127.0.0.1, .2, .3, ...) that publishers
send from with ZMQ's ``tcp://SRC:0;DST`` connect syntax, so the subscriber sees it as
the message's ``Peer-Address``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.ingest.admission import (
    MODEL_CAP,
    SENDER_MISMATCH,
    SENDER_STREAM_CAP,
    SENDER_UNVERIFIABLE,
    UNDISCOVERED_POD,
    UNLISTED_POD,
    Allowlist,
    AllowlistError,
    ModelAdmission,
    sender_problem,
    stream_cap_problem,
)
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.ingest.testing import RecordingSink, wait_until
from kvindex.events.wire.endpoints import from_source
from kvindex.events.wire.identity import StreamId, make_topic
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import AllBlocksCleared, BlockStored

NOBODY = Allowlist()


# -- the pure decisions ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "peer", "problem"),
    [
        ("127.10.0.1:8000", "127.10.0.1", None),
        ("127.10.0.1:8000", "127.10.0.2", SENDER_MISMATCH),
        ("127.10.0.1:8000", "::ffff:127.10.0.1", None),  # dual-stack socket, IPv4 sender
        ("[fd00::1]:8000", "fd00::1", None),
        ("[fd00::1]:8000", "fd00::2", SENDER_MISMATCH),
        ("vllm-0.svc:8000", "127.10.0.1", SENDER_UNVERIFIABLE),
        ("127.10.0.1:8000", "garbage", SENDER_MISMATCH),
        ("127.10.0.1:8000", None, None),  # ipc/inproc: local processes only
        ("127.10.0.1:8000", "", None),
    ],
)
def test_sender_must_be_the_pods_host(pod: str, peer: str | None, problem: str | None) -> None:
    assert sender_problem(pod, peer, NOBODY, None) == problem


def test_allowlist_by_pod_and_by_network() -> None:
    allow = Allowlist.parse(["127.10.0.1", "fd00::/64", "192.168.0.0/16", "vllm-0.svc:8000"], 8000)
    assert allow.pods == {"127.10.0.1:8000", "vllm-0.svc:8000"}
    for pod in ("127.10.0.1:8000", "[fd00::7]:8000", "192.168.3.4:9000", "vllm-0.svc:8000"):
        assert sender_problem(pod, "127.0.0.9", allow, None) is None, pod
    assert sender_problem("127.10.0.1:8001", "127.0.0.9", allow, None) == SENDER_MISMATCH
    assert sender_problem("127.10.0.2:8000", "127.0.0.9", allow, None) == SENDER_MISMATCH
    for bad in ("127.10.0.0/33", "not a host", "a/b"):
        with pytest.raises(AllowlistError):
            Allowlist.parse([bad], 8000)
    with pytest.raises(ValueError):
        SubscriberConfig(bind_allow=("127.10.0.0/99",))


def test_discovery_is_asked_first_and_the_allowlist_does_not_bypass_it() -> None:
    known = KnownPods()
    allow = Allowlist.parse(["127.10.0.1:8000"], 8000)
    assert sender_problem("127.10.0.1:8000", "127.10.0.1", NOBODY, known) == UNDISCOVERED_POD
    assert sender_problem("127.10.0.1:8000", "127.19.9.9", allow, known) == UNDISCOVERED_POD
    known.learn("127.10.0.1:8000")
    assert sender_problem("127.10.0.1:8000", "127.10.0.1", NOBODY, known) is None
    assert sender_problem("127.10.0.1:8000", "127.19.9.9", NOBODY, known) == SENDER_MISMATCH
    assert sender_problem("127.10.0.1:8000", "127.19.9.9", allow, known) is None
    known.forget("127.10.0.1:8000")
    assert sender_problem("127.10.0.1:8000", "127.10.0.1", NOBODY, known) == UNDISCOVERED_POD


def test_configured_pods_and_the_allowlist_close_the_door() -> None:
    listed = frozenset({"127.10.0.1:8000"})
    allow = Allowlist.parse(["127.20.0.0/16"], 8000)
    # Nothing configured: a pod sending from its own host is enough.
    assert sender_problem("127.10.0.2:8000", "127.10.0.2", NOBODY, None) is None
    # Configured pods: only they (from their own host), or allowlisted ones.
    assert sender_problem("127.10.0.1:8000", "127.10.0.1", NOBODY, None, listed) is None
    assert sender_problem("127.10.0.2:8000", "127.10.0.2", NOBODY, None, listed) == UNLISTED_POD
    assert sender_problem("127.10.0.1:8000", "127.10.0.2", NOBODY, None, listed) == SENDER_MISMATCH
    assert sender_problem("127.20.0.5:8000", "127.0.0.1", allow, None, listed) is None
    # An allowlist alone is a roster too.
    assert sender_problem("127.10.0.2:8000", "127.10.0.2", allow, None) == UNLISTED_POD
    # With discovery, configured pods count as known.
    known = KnownPods()
    assert sender_problem("127.10.0.1:8000", "127.10.0.1", NOBODY, known, listed) is None
    assert sender_problem("127.10.0.2:8000", "127.10.0.2", NOBODY, known, listed) == (
        UNDISCOVERED_POD
    )


def test_models_are_admitted_up_to_the_cap_configured_ones_always() -> None:
    models = ModelAdmission(["configured"], max_models=2)
    assert [models.problem(m) for m in ("a", "b", "c", "a", "configured")] == [
        None,
        None,
        MODEL_CAP,
        None,
        None,
    ]
    assert len(models) == 2


def test_stream_cap() -> None:
    assert stream_cap_problem(True, 63, 64) is None
    assert stream_cap_problem(True, 64, 64) == SENDER_STREAM_CAP
    assert stream_cap_problem(False, 64, 64) is None  # a stream it already has


# -- hostile senders on loopback ---------------------------------------------------------


class Door:
    """A started bind-mode subscriber and publishers sending from chosen hosts."""

    def __init__(self, ctx: zmq.Context, known: KnownPods | None = None, **config: object):
        self.ctx = ctx
        self.sink = RecordingSink()
        self.sub = Subscriber(
            self.sink,
            SubscriberConfig(replay_timeout_s=5.0, **config),
            context=ctx,
            discovered_pods=known,
        )
        self.endpoint = self.sub.bind("tcp://127.0.0.1:0")
        self.sub.start()
        self.pubs: list[EnginePublisher] = []

    def publisher(self, host: str, pod: str, model: str = "m") -> EnginePublisher:
        pub = EnginePublisher(
            from_source(self.endpoint, host), topic=make_topic(pod, model), bind=False,
            context=self.ctx,
        )  # fmt: skip
        self.pubs.append(pub)
        assert pub.wait_for_subscribers(1, 5.0)
        return pub

    def errors(self, reason: str) -> int:
        return self.sub.error_counts().get(reason, 0)

    def close(self) -> None:
        self.sub.stop()
        for pub in self.pubs:
            pub.close()


@pytest.fixture
def door(ctx: zmq.Context) -> Iterator[type[Door]]:
    made: list[Door] = []

    def make(*args: object, **kw: object) -> Door:
        made.append(Door(ctx, *args, **kw))
        return made[-1]

    yield make  # type: ignore[misc]
    for d in made:
        d.close()


def stored(*hashes: int) -> list[BlockStored]:
    return [BlockStored(list(hashes), None, [1] * 16 * len(hashes), 16)]


def delivered_hashes(sink: RecordingSink, stream: StreamId) -> list[int]:
    return [
        h
        for d in sink.deliveries
        if d.stream == stream
        for e in d.batch.events
        for h in getattr(e, "block_hashes", [])
    ]


def test_a_spoofed_topic_can_neither_wipe_nor_inject(door) -> None:
    d = door()
    victim = "127.0.0.1:8000"
    real = d.publisher("127.0.0.1", victim)
    real.publish(stored(1, 2, 3))
    assert d.sink.wait_for_count(1, 5.0)

    spoof = d.publisher("127.0.0.2", victim)  # another host naming the victim
    spoof.publish([AllBlocksCleared()])
    spoof.publish(stored(666))
    spoof.publish(stored(667))
    # ...and trying to open a new pod on a host that is not its own
    d.publisher("127.0.0.2", "127.0.0.1:9000").publish(stored(668))
    assert wait_until(lambda: d.errors(SENDER_MISMATCH) == 4, 5.0), d.sub.error_counts()

    real.publish(stored(4))
    assert d.sink.wait_for_count(2, 5.0)
    assert delivered_hashes(d.sink, StreamId(victim)) == [1, 2, 3, 4]
    assert [
        e for dl in d.sink.deliveries for e in dl.batch.events if isinstance(e, AllBlocksCleared)
    ] == []
    assert [s.pod for s in d.sub.streams()] == [victim]
    (status,) = d.sub.streams()
    # The spoofed seqs 0..2 never reached the stream: no restart, no gap, no replay.
    assert (status.last_seq, status.restarts, status.gaps) == (1, 0, 0)
    assert d.sink.resets == []


def test_a_flood_of_fake_pods_from_one_sender_is_capped(door) -> None:
    d = door(max_streams_per_sender=8)
    flooder = [d.publisher("127.0.0.3", f"127.0.0.3:{10_000 + i}") for i in range(30)]
    for i, pub in enumerate(flooder):
        pub.publish(stored(i))
    assert wait_until(lambda: d.errors(SENDER_STREAM_CAP) == 22, 10.0), d.sub.error_counts()
    assert d.sink.wait_for_count(8, 5.0)
    # The streams it has keep working; a real pod on another host is not locked out.
    flooder[0].publish(stored(100))
    d.publisher("127.0.0.4", "127.0.0.4:8000").publish(stored(7))
    assert d.sink.wait_for_count(10, 5.0)
    hosts = sorted({s.pod.split(":")[0] for s in d.sub.streams()})
    assert hosts == ["127.0.0.3", "127.0.0.4"]
    assert sum(1 for s in d.sub.streams() if s.pod.startswith("127.0.0.3:")) == 8
    assert delivered_hashes(d.sink, StreamId("127.0.0.4:8000")) == [7]
    # Forgetting a pod frees its place under the cap.
    d.sub.forget_pod("127.0.0.3:10000")
    late = d.publisher("127.0.0.3", "127.0.0.3:20000")
    late.publish(stored(9))
    assert wait_until(lambda: StreamId("127.0.0.3:20000") in {d.stream for d in d.sink.deliveries})


def test_streams_kvindex_evicted_leave_their_senders_cap(door) -> None:
    """Engines on one host come and go (new ports, restarts): once kvindex evicted their
    silent streams, the host may open new ones. The cap counts streams that exist, not
    every stream the host ever opened (which locked it out for good)."""
    d = door(max_streams_per_sender=2, stream_idle_s=0.2, stream_evict_idle_s=0.2)
    for generation in range(3):
        pods = [f"127.0.0.5:{9000 + 10 * generation + i}" for i in range(2)]
        for i, pod in enumerate(pods):
            d.publisher("127.0.0.5", pod).publish(stored(100 * generation + i))
        assert wait_until(
            lambda pods=pods: {StreamId(p) for p in pods} <= {x.stream for x in d.sink.deliveries},
            5.0,
        ), (generation, d.sub.error_counts())
        # Silent, they are evicted (and their entries reset) after stream_idle_s.
        assert wait_until(lambda: d.sub.streams() == [], 5.0), d.sub.streams()
    assert d.errors(SENDER_STREAM_CAP) == 0
    assert d.errors("stream_evicted") == 6


def test_data_parallel_ranks_count_as_streams(door) -> None:
    d = door(max_streams_per_sender=2)
    pub = d.publisher("127.0.0.1", "127.0.0.1:8000")
    for rank in range(3):  # the rank inside the batch names the stream in bind mode
        pub.publish_payload(pub.format.encode_batch(stored(rank), 1.0, rank))
    assert wait_until(lambda: d.errors(SENDER_STREAM_CAP) == 1, 5.0)
    # The cap is counted on the receiver thread, the streams made on the applier's: wait.
    assert wait_until(lambda: sorted(s.rank for s in d.sub.streams()) == [0, 1], 5.0)


def test_with_discovery_only_discovered_pods_are_accepted(door) -> None:
    known = KnownPods()
    known.learn("127.0.0.1:8000")
    d = door(known)
    d.publisher("127.0.0.1", "127.0.0.1:8000").publish(stored(1))
    stranger = d.publisher("127.0.0.1", "127.0.0.1:8001")  # right host, never discovered
    stranger.publish(stored(2))
    assert wait_until(lambda: d.errors(UNDISCOVERED_POD) == 1, 5.0)
    assert d.sink.wait_for_count(1, 5.0)
    known.learn("127.0.0.1:8001")
    stranger.publish(stored(3))
    assert wait_until(lambda: StreamId("127.0.0.1:8001") in {x.stream for x in d.sink.deliveries})
    known.forget("127.0.0.1:8001")
    stranger.publish(stored(4))
    assert wait_until(lambda: d.errors(UNDISCOVERED_POD) == 2, 5.0)
    # The stream's second seq was refused: its hashes stop at 3. (Its seq 0 was lost
    # before discovery: caught up by replay when a replay endpoint exists.)
    assert delivered_hashes(d.sink, StreamId("127.0.0.1:8001")) == [3]


def test_allowlisted_pod_may_send_from_elsewhere(door) -> None:
    d = door(bind_allow=("127.10.0.9:8000",), default_serving_port=8000)
    d.publisher("127.0.0.1", "127.10.0.9").publish(stored(5))
    d.publisher("127.0.0.1", "127.10.0.8").publish(stored(6))
    assert d.sink.wait_for_count(1, 5.0)
    assert wait_until(lambda: d.errors(SENDER_MISMATCH) == 1, 5.0)
    assert [x.stream for x in d.sink.deliveries] == [StreamId("127.10.0.9:8000")]

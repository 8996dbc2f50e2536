"""The engine-side publisher: vLLM's socket rules, framing, seqs, replay service."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvindex.events.ingest.replay_client import END_SEQ
from kvindex.events.wire.endpoints import is_bind_endpoint, offset_endpoint_port
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BatchDecoder, BlockStored

TIMEOUT_MS = 5000


def sub_socket(
    ctx: zmq.Context, *, bind: bool, endpoint: str = "tcp://127.0.0.1:0"
) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    if bind:
        sock.bind(endpoint)
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    else:
        sock.connect(endpoint)
    return sock, endpoint


def recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(TIMEOUT_MS, zmq.POLLIN), "nothing arrived"
    return sock.recv_multipart()


def replay_frames(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Replies to one raw DEALER replay request, up to and including the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies = []
    for _ in range(1000):
        frames = recv(dealer)
        replies.append(frames)
        if END_SEQ in frames:
            break
    dealer.close()
    return replies


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/kv.sock", True),
        ("inproc://kv", True),
        ("tcp://127.10.0.1:5557", False),
        ("tcp://kvindex.default.svc:5557", False),
    ],
)
def test_vllm_bind_rule(endpoint: str, binds: bool) -> None:
    assert is_bind_endpoint(endpoint) is binds


def test_offset_endpoint_port() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://127.10.0.1:5557", 1) == "tcp://127.10.0.1:5558"
    assert offset_endpoint_port("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint_port("inproc://kv", 2) == "inproc://kv_dp2"
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///tmp/kv", 1)


def test_frames_and_seq_from_zero(ctx: zmq.Context) -> None:
    with EnginePublisher(
        "tcp://127.0.0.1:0", bind=True, topic="kv@127.10.0.1:8000@m", context=ctx
    ) as pub:
        assert not pub.endpoint.endswith(":0")  # the real port was discovered
        sub, _ = sub_socket(ctx, bind=False, endpoint=pub.endpoint)
        assert pub.wait_for_subscribers(1)
        seqs = [pub.publish([BlockStored([i])], ts=10.0 + i) for i in range(3)]
        assert seqs == [0, 1, 2]
        for i in range(3):
            topic, seq, payload = recv(sub)
            assert topic == b"kv@127.10.0.1:8000@m"
            assert seq == i.to_bytes(8, "big")
            batch = BatchDecoder().decode(payload).batch
            assert batch.ts == 10.0 + i
            assert batch.events[0].block_hashes == [i]
            assert batch.data_parallel_rank == 0
        sub.close()


def test_connects_by_vllm_rule_with_rank_offset(ctx: zmq.Context) -> None:
    sub, endpoint = sub_socket(ctx, bind=True)
    port = int(endpoint.rsplit(":", 1)[1])
    # A non-wildcard endpoint connects; rank 2 publishes on the base port + 2.
    with EnginePublisher(
        f"tcp://127.0.0.1:{port - 2}", data_parallel_rank=2, vllm_version="0.20", context=ctx
    ) as pub:
        assert pub.endpoint == endpoint
        # A bound SUB attaches an accepted connection (and sends its subscription) only
        # when its owner calls into it: keep poking it while waiting.
        for _ in range(200):
            sub.getsockopt(zmq.EVENTS)
            if pub.wait_for_subscribers(1, timeout_s=0.025):
                break
        assert pub.wait_for_subscribers(1, timeout_s=0)
        pub.publish([BlockStored([1])])
        _, _, payload = recv(sub)
        assert msgspec.msgpack.decode(payload)[2] == 2
    sub.close()


def test_unsent_batch_is_replayable_and_restart_resets(ctx: zmq.Context) -> None:
    with EnginePublisher(
        "tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0", context=ctx
    ) as pub:
        sub, _ = sub_socket(ctx, bind=False, endpoint=pub.endpoint)
        assert pub.wait_for_subscribers(1)
        pub.publish([BlockStored([0])])
        pub.publish([BlockStored([1])], send=False)
        pub.publish([BlockStored([2])])
        assert [int.from_bytes(recv(sub)[1], "big") for _ in range(2)] == [0, 2]
        replies = replay_frames(ctx, pub.replay_endpoint, 1)
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [1, 2]

        pub.restart()
        assert pub.publish([BlockStored([9])]) == 0
        assert recv(sub)[1] == (0).to_bytes(8, "big")
        replies = replay_frames(ctx, pub.replay_endpoint, 0)
        assert len(replies) == 2  # only the new engine's batch, then the end marker
        sub.close()


@pytest.mark.parametrize("version", ["0.9", "0.25", "0.26", "0.33"])
def test_replay_reply_layouts(ctx: zmq.Context, version: str) -> None:
    with EnginePublisher(
        "tcp://127.0.0.1:0",
        bind=True,
        replay_endpoint="tcp://127.0.0.1:0",
        topic="kv@p:1@m",
        vllm_version=version,
        buffer_steps=3,
        context=ctx,
    ) as pub:
        payloads = {pub.publish([BlockStored([i])], send=False): None for i in range(5)}
        assert list(payloads) == [0, 1, 2, 3, 4]
        replies = replay_frames(ctx, pub.replay_endpoint, 0)
    with_topic = version in ("0.26", "0.33")
    *batches, end = replies
    # Only the last buffer_steps batches are kept.
    seq_index = 2 if with_topic else 1
    assert [int.from_bytes(r[seq_index], "big") for r in batches] == [2, 3, 4]
    for reply in batches:
        assert reply[0] == b""
        assert len(reply) == (4 if with_topic else 3)
        if with_topic:
            assert reply[1] == b"kv@p:1@m"
    assert end == ([b"", b"", END_SEQ, b""] if with_topic else [b"", END_SEQ, b""])


def test_raw_frames(ctx: zmq.Context) -> None:
    with EnginePublisher("tcp://127.0.0.1:0", bind=True, context=ctx) as pub:
        sub, _ = sub_socket(ctx, bind=False, endpoint=pub.endpoint)
        assert pub.wait_for_subscribers(1)
        pub.send_frames([b"a", b"b"])
        assert recv(sub) == [b"a", b"b"]
        assert pub.next_seq == 0
        sub.close()

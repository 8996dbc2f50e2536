"""The replay client: both reply layouts, bounded waits, bad replies."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from kvindex.api.testing import free_port
from kvindex.events.ingest.replay_client import END_SEQ, fetch_replay
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored


@pytest.mark.parametrize("version", ["0.22", "0.25", "0.26", "0.33"])
def test_fetches_from_start_seq(ctx: zmq.Context, version: str) -> None:
    with EnginePublisher(
        "tcp://127.0.0.1:0",
        bind=True,
        replay_endpoint="tcp://127.0.0.1:0",
        vllm_version=version,
        context=ctx,
    ) as pub:
        payloads = [pub.encode([BlockStored([i])], ts=float(i)) for i in range(6)]
        for payload in payloads:
            pub.publish_payload(payload, send=False)
        result = fetch_replay(pub.replay_endpoint, 2, timeout_s=5.0, context=ctx)
    assert result.complete and result.reason == "complete"
    assert result.batches == [(i, payloads[i]) for i in range(2, 6)]


def test_max_batches_bounds_the_fetch(ctx: zmq.Context) -> None:
    with EnginePublisher(
        "tcp://127.0.0.1:0", bind=True, replay_endpoint="tcp://127.0.0.1:0", context=ctx
    ) as pub:
        for i in range(10):
            pub.publish([BlockStored([i])], send=False)
        result = fetch_replay(pub.replay_endpoint, 0, timeout_s=5.0, max_batches=4, context=ctx)
    assert not result.complete and result.reason == "max_batches"
    assert [seq for seq, _ in result.batches] == [0, 1, 2, 3]


def test_router_that_never_answers_times_out(ctx: zmq.Context) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    result = fetch_replay(endpoint, 0, timeout_s=0.3, context=ctx)
    assert not result.complete and result.reason == "timeout" and result.batches == []
    router.close()


def test_nothing_listening_times_out(ctx: zmq.Context) -> None:
    result = fetch_replay(f"tcp://127.0.0.1:{free_port()}", 0, timeout_s=0.3, context=ctx)
    assert not result.complete and result.reason == "timeout"


def test_bad_endpoint_is_an_error_not_an_exception(ctx: zmq.Context) -> None:
    result = fetch_replay("tcp://127.0.0.1:notaport", 0, timeout_s=0.3, context=ctx)
    assert result.reason == "error" and not result.complete


def test_bad_replies_are_skipped_and_layouts_mix(ctx: zmq.Context) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(fetch_replay, endpoint, 5, timeout_s=5.0, context=ctx)
        assert router.poll(5000, zmq.POLLIN)
        client, empty, start = router.recv_multipart()
        assert empty == b"" and int.from_bytes(start, "big") == 5
        seq = (5).to_bytes(8, "big")
        router.send_multipart([client, b"", seq, b"old-layout"])
        router.send_multipart([client, b"x", seq, b"no delimiter"])
        router.send_multipart([client, b"", b"short", b"bad seq"])
        router.send_multipart([client, b"", b"a", b"b", b"c", b"d"])
        router.send_multipart([client, b"", b"topic", (6).to_bytes(8, "big"), b"new-layout"])
        router.send_multipart([client, b"", b"", END_SEQ, b""])
        result = future.result(timeout=10)
    router.close()
    assert result.complete
    assert result.batches == [(5, b"old-layout"), (6, b"new-layout")]
    assert result.bad_replies == 3

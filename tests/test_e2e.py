"""End to end: `kvindex serve` as a real process, three pods publishing over real ZMQ.

Pods A and B publish to kvindex's bound socket (bind mode, topic kv@<pod>@<model>);
pod C binds its own PUB socket and kvindex connects to it (connect mode). All three
serve replay on the same port of their own loopback address, as vLLM pods would.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port, publisher_into
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockRemoved, BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig

pytestmark = pytest.mark.slow

MODEL = "acme/chat-7b"
TOKENS = list(range(7, 7 + 16 * 64))
OTHER = list(range(50_000, 50_000 + 16 * 8))
HASHER = BlockHasher(HashConfig())
KEYS, OTHER_KEYS = HASHER.keys(TOKENS), HASHER.keys(OTHER)
POD_A, POD_B, POD_C = "127.0.0.1:8000", "127.0.0.2:8000", "127.0.0.3:8000"


@pytest.fixture
def cluster() -> Iterator[dict]:
    bind, replay, c_port = free_port(), free_port(), free_port()
    env = {**os.environ, "KVINDEX_ADMIN_TOKEN": "t0ken", "KVINDEX_REPLAY_PORT": str(replay)}
    server = ServeProcess(
        "--zmq-bind", f"tcp://127.0.0.1:{bind}",
        "--zmq-connect", f"{POD_C}@{MODEL}=tcp://127.0.0.3:{c_port}",
        # Configured pods close bind mode's door to others: A and B are named too.
        "--pod-role", f"{POD_A}=both", "--pod-role", f"{POD_B}=both",
        "--log-format", "json",
        env=env,
    )  # fmt: skip
    pubs: list[EnginePublisher] = []
    try:
        server.wait_ready(20.0)
        for pod in (POD_A, POD_B):
            host = pod.split(":")[0]
            replay_endpoint = f"tcp://{host}:{replay}"
            pubs.append(
                publisher_into(
                    f"tcp://127.0.0.1:{bind}",
                    pod,
                    MODEL,
                    replay_endpoint=replay_endpoint,
                    vllm_version="0.22",
                )
            )
        pubs.append(
            EnginePublisher(
                f"tcp://127.0.0.3:{c_port}",
                replay_endpoint=f"tcp://127.0.0.3:{replay}",
                vllm_version="0.33",
                bind=True,
            )
        )
        assert pubs[-1].wait_for_subscribers(1, 10.0)
        yield {"url": server.url, "a": pubs[0], "b": pubs[1], "c": pubs[2], "server": server}
    finally:
        for pub in pubs:
            pub.close()
        server.stop()


def scores(url: str, tokens: list[int] = TOKENS) -> dict[str, int]:
    answer = httpx.post(
        f"{url}/score", json={"model": MODEL, "token_ids": tokens}, timeout=5
    ).json()
    return {p["pod"]: p["matched_blocks"] for p in answer["pods"]}


def pod(url: str, pod_id: str) -> dict:
    return httpx.get(f"{url}/index/pods/{pod_id}", timeout=5).json()


def stored(keys: list[int], tokens: list[int], n: int) -> BlockStored:
    return BlockStored(keys[:n], None, tokens[: n * 16], 16)


def test_three_pods_restart_gap_and_purge(cluster: dict) -> None:
    url, a, b, c = cluster["url"], cluster["a"], cluster["b"], cluster["c"]
    a.publish([stored(KEYS, TOKENS, 64)])
    b.publish([stored(KEYS, TOKENS, 32)])
    c.publish([stored(KEYS, TOKENS, 16)])
    eventually(lambda: scores(url) == {POD_A: 64, POD_B: 32, POD_C: 16}, what="three pods indexed")

    answer = httpx.post(
        f"{url}/score",
        json={"model": MODEL, "token_ids": TOKENS, "pods": [POD_C, "127.0.0.4:8000"]},
    ).json()
    assert answer["prompt_blocks"] == 64
    assert [(p["pod"], p["matched_blocks"]) for p in answer["pods"]] == [
        (POD_C, 16),
        ("127.0.0.4:8000", 0),
    ]

    # Pod B's engine restarts: seq back to 0, its old cache is gone.
    b.restart()
    b.publish([stored(OTHER_KEYS, OTHER, 8)])
    eventually(lambda: POD_B not in scores(url), what="pod B's pre-restart blocks dropped")
    assert scores(url, OTHER) == {POD_B: 8}
    assert pod(url, POD_B)["restarts"] == 1

    # Pod C (connect mode, map layout) loses a message: replay fills the gap. Counted
    # from here: a configured pod still silent after verify_after_reconnect_s gets a
    # first-contact replay, which a loaded machine may reach before C's first batch.
    before = pod(url, POD_C)
    c.publish([BlockRemoved(KEYS[8:16])], send=False)
    c.publish([stored(OTHER_KEYS, OTHER, 4)])
    eventually(lambda: scores(url).get(POD_C) == 8, what="pod C's gap replayed")
    report = pod(url, POD_C)
    assert report["gaps"] == before["gaps"] + 1 == 1
    assert report["replays"] == {"ok": before["replays"]["ok"] + 1, "failed": 0}
    assert report["stream_state"] == "live"

    # An operator purges pod A.
    denied = httpx.delete(f"{url}/index/pods/{POD_A}")
    assert denied.status_code == 401
    purged = httpx.delete(f"{url}/index/pods/{POD_A}", headers={"Authorization": "Bearer t0ken"})
    assert purged.json()["entries_removed"] == 64
    assert scores(url) == {POD_C: 8}

    pods = httpx.get(f"{url}/index/pods").json()["pods"]
    assert {p["pod"] for p in pods} == {POD_A, POD_B, POD_C}
    assert {p["pod"]: p["blocks"]["gpu"] for p in pods} == {POD_A: 0, POD_B: 8, POD_C: 12}

    metrics = httpx.get(f"{url}/metrics").text
    for line in [
        "kvindex_pod_restarts_total 1.0",
        "kvindex_seq_gaps_total 1.0",
        'kvindex_replays_total{result="ok"} 1.0',
        'kvindex_events_total{type="BlockStored"} 5.0',
        'kvindex_events_total{type="BlockRemoved"} 1.0',
        'kvindex_index_blocks{tier="gpu"} 20.0',
        "kvindex_pods 3.0",
        'kvindex_pod_blocks{pod="127.0.0.3:8000",tier="gpu"} 12.0',
    ]:
        assert line in metrics, line

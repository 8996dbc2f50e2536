"""Restarting without a snapshot: configured pods that have not published since kvindex
started are ``unheard``, never silently empty (issue 26 item 9).

Real processes: ``kvindex serve`` connecting to :class:`EnginePublisher` engines bound
on loopback, one with a replay ROUTER and one without, and a ``--pod-role`` pod that
never publishes. Every engine publishes its batches before kvindex starts, so only a
replay can tell what it holds.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored

pytestmark = pytest.mark.slow

MODEL = "acme/chat-7b"
SILENT_POD = "127.0.0.43:8000"  # --pod-role only: configured, never publishes


class Engine:
    """A connect-mode engine and the blocks it published (what the index must equal)."""

    def __init__(self, host: str, replay: bool, seed: int) -> None:
        self.pod = f"{host}:8000"
        self.pub = EnginePublisher(
            f"tcp://{host}:{free_port()}",
            replay_endpoint=f"tcp://{host}:{free_port()}" if replay else None,
            bind=True,
        )
        self.held: list[int] = []
        self._rng = random.Random(seed)

    @property
    def connect(self) -> str:
        spec = f"{self.pod}@{MODEL}={self.pub.endpoint}"
        return (
            spec
            if self.pub.replay_endpoint is None
            else f"{spec};replay={self.pub.replay_endpoint}"
        )

    def step(self) -> None:
        blocks = [self._rng.getrandbits(64) for _ in range(8)]
        self.held.extend(blocks)
        self.pub.publish([BlockStored(blocks, None, [], 16)])


@pytest.fixture
def engines() -> Iterator[tuple[Engine, Engine]]:
    proving = Engine("127.0.0.41", replay=True, seed=1)
    mute = Engine("127.0.0.42", replay=False, seed=2)
    yield proving, mute
    proving.pub.close()
    mute.pub.close()


def _pod(server: ServeProcess, pod: str) -> dict:
    return httpx.get(f"{server.url}/index/pods/{pod}", timeout=5).json()


def _blocks(server: ServeProcess, pod: str) -> list[int] | None:
    answer = httpx.get(f"{server.url}/index/pods/{pod}/blocks", params={"model": MODEL}, timeout=5)
    return answer.json()["blocks"].get(pod) if answer.status_code == 200 else None


def _score(server: ServeProcess, pods: list[str], block: int) -> dict:
    body = {"model": MODEL, "block_hashes": [block], "pods": pods}
    answer = httpx.post(f"{server.url}/score", json=body, timeout=5)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _route(server: ServeProcess, pods: list[str], block: int) -> dict:
    body = {"model": MODEL, "block_hashes": [block], "pods": pods}
    answer = httpx.post(f"{server.url}/route", json=body, timeout=5)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_idle_pods_are_recovered_by_replay_or_said_unheard_until_they_publish(
    engines: tuple[Engine, Engine], tmp_path
) -> None:
    proving, mute = engines
    for _ in range(5):  # before kvindex starts: nobody subscribed, only buffers keep them
        proving.step()
        mute.step()
    server = ServeProcess(
        "--zmq-connect", proving.connect,
        "--zmq-connect", mute.connect,
        "--pod-role", f"{SILENT_POD}=both",
        log_path=tmp_path / "serve.log",
    )  # fmt: skip
    with server:
        server.wait_ready(30.0)
        # The engine with a replay endpoint proves what it holds without publishing.
        eventually(lambda: _blocks(server, proving.pod) == sorted(proving.held), "replayed")
        eventually(lambda: _pod(server, proving.pod)["stream_state"] == "live", "proven: live")
        # The one without stays unheard, and every answer says so.
        for pod in (mute.pod, SILENT_POD):
            assert _pod(server, pod)["stream_state"] == "unheard"
        assert [s["state"] for s in _pod(server, mute.pod)["streams"]] == ["unheard"]
        candidates = [proving.pod, mute.pod, SILENT_POD]
        first = proving.held[0]
        eventually(
            lambda: len(_score(server, candidates, first)["warnings"]) == 2, "two unheard warned"
        )
        scored = _score(server, candidates, first)  # stream_state null: live
        assert all("not heard from since kvindex started" in w for w in scored["warnings"])
        assert {p["pod"]: p["stream_state"] for p in scored["pods"]} == {
            proving.pod: None, mute.pod: "unheard", SILENT_POD: "unheard",
        }  # fmt: skip
        assert scored["pods"][0]["pod"] == proving.pod and scored["pods"][0]["matched_blocks"] == 1
        routed = _route(server, candidates, first)
        assert {c["pod"]: c["stream_state"] for c in routed["candidates"]} == {
            proving.pod: None, mute.pod: "unheard", SILENT_POD: "unheard",
        }  # fmt: skip
        assert {c["pod"]: c["doubt"] for c in routed["candidates"]} == {
            proving.pod: None, mute.pod: "unheard", SILENT_POD: "unheard",
        }  # fmt: skip
        assert sum(mute.pod in w or SILENT_POD in w for w in routed["warnings"]) == 2
        metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
        for pod in (mute.pod, SILENT_POD):
            assert f'kvindex_pod_stream_state{{pod="{pod}",state="unheard"}} 1.0' in metrics
        # Once it publishes it is heard: its history before kvindex joined cannot be
        # fetched (no replay endpoint), which is said as such, not as unheard.
        assert mute.pub.wait_for_subscribers(1, 10.0)
        mute.step()
        eventually(lambda: _pod(server, mute.pod)["stream_state"] == "incomplete", "heard")
        eventually(
            lambda: (
                not any(
                    "not heard from" in w and mute.pod in w
                    for w in _score(server, candidates, first)["warnings"]
                )
            ),
            "no unheard warning once it published",
        )

"""Who may fill the index, through a running ``kvindex serve`` in bind mode (issue 26
items 5 and 10): model names are bounded, and a configured roster closes the door.

Publishers are real ZMQ PUB sockets on loopback; each plays a host by sending from its
own 127.0.0.x address (``from_source``), which kvindex sees as the ``Peer-Address``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port, publisher_into
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig

pytestmark = pytest.mark.slow

MODEL = "acme/chat-7b"
TOKENS = list(range(7, 7 + 16 * 4))
KEYS = BlockHasher(HashConfig()).keys(TOKENS)
STORED = [BlockStored(KEYS, None, TOKENS, 16)]
POD_A, POD_B = "127.0.0.1:8000", "127.0.0.2:8000"
WARNING = "bind mode accepts KV events from ANY sender"


class Bind:
    """A ``kvindex serve`` bound on loopback, and publishers sending from chosen hosts."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.server = ServeProcess("--zmq-bind", self.endpoint, "--model", MODEL, *flags)
        self.pubs: list[EnginePublisher] = []

    def publisher(self, pod: str, model: str = MODEL) -> EnginePublisher:
        pub = publisher_into(self.endpoint, pod, model, bind=False)
        self.pubs.append(pub)
        return pub

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.server.url}{path}", timeout=5.0)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.server.url}{path}", json=body, timeout=5.0)

    def errors(self, reason: str) -> float:
        found = re.search(
            rf'^kvindex_event_errors_total{{reason="{reason}"}} (\S+)$',
            self.get("/metrics").text,
            re.MULTILINE,
        )
        return float(found.group(1)) if found else 0.0

    def matched(self, model: str = MODEL) -> dict[str, int]:
        answer = self.post("/score", {"model": model, "token_ids": TOKENS}).json()
        return {p["pod"]: p["matched_blocks"] for p in answer["pods"]}

    def pods(self) -> set[str]:
        return {p["pod"] for p in self.get("/index/pods").json()["pods"]}

    def close(self) -> None:
        for pub in self.pubs:
            pub.close()
        self.server.stop()


@pytest.fixture
def bind() -> Iterator[type[Bind]]:
    made: list[Bind] = []

    def make(*flags: str) -> Bind:
        service = Bind(*flags)
        made.append(service)
        service.server.wait_ready(30.0)
        return service

    yield make  # type: ignore[misc]
    for service in made:
        service.close()


def made_up(n: int) -> str:
    return f"made-up-{n}-" + "x" * 300  # long names too: the error must stay small


def test_one_sender_inventing_model_names_is_bounded(bind) -> None:
    service = bind()  # the default --max-models, 256
    flooder = service.publisher(POD_B, "made-up")
    payload = flooder.encode(STORED)
    for seq in range(5_000):
        flooder.send_frames(
            [f"kv@{POD_B}@{made_up(seq)}".encode(), seq.to_bytes(8, "big"), payload]
        )
    eventually(lambda: service.errors("model_cap") == 5_000 - 256, "the refusals counted")
    assert "max_models (256)" in service.server.log_tail(20_000)  # names the setting
    assert "--max-models" in service.server.log_tail(20_000)

    # The configured model is always admitted.
    service.publisher(POD_A).publish(STORED)
    eventually(lambda: service.matched().get(POD_A) == len(KEYS), "the configured model indexed")

    unknown = service.post("/score", {"model": "nope", "token_ids": TOKENS})
    assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_model"
    assert len(unknown.content) < 2048, len(unknown.content)
    # The bound holds: 256 made-up names and the configured one, no more.
    assert unknown.json()["detail"].endswith(" and 237 more")
    assert service.post("/score", {"model": made_up(255), "token_ids": TOKENS}).status_code == 200
    assert service.post("/score", {"model": made_up(256), "token_ids": TOKENS}).status_code == 404


def test_max_models_is_a_setting(bind) -> None:
    service = bind("--max-models", "2")
    flooder = service.publisher(POD_B, "made-up")
    payload = flooder.encode(STORED)
    for seq in range(5):
        flooder.send_frames([f"kv@{POD_B}@made-up-{seq}".encode(), seq.to_bytes(8, "big"), payload])
    eventually(lambda: service.errors("model_cap") == 3, "the refusals counted")


def test_with_pods_configured_an_unlisted_pod_is_refused(bind) -> None:
    service = bind("--pod-role", f"{POD_A}=both")
    assert WARNING not in service.server.log_tail(20_000)
    assert "ANY sender" not in service.server.log_tail(20_000)
    stranger = service.publisher(POD_B)  # sends from its own host: only the roster is wrong
    stranger.publish(STORED)
    eventually(lambda: service.errors("unlisted_pod") == 1, "the stranger refused")
    assert "--pod-role" in service.server.log_tail(20_000)
    service.publisher(POD_A).publish(STORED)
    eventually(lambda: service.matched().get(POD_A) == len(KEYS), "pod A indexed")
    stranger.publish(STORED)
    eventually(lambda: service.errors("unlisted_pod") == 2, "the stranger refused again")

    assert service.pods() == {POD_A}
    assert POD_B not in service.matched()
    for _ in range(5):
        answer = service.post("/route", {"model": MODEL, "token_ids": TOKENS}).json()
        assert answer["pod"] == POD_A
        assert {c["pod"] for c in answer["candidates"]} == {POD_A}


def test_bind_allow_admits_a_pod_outside_the_roster(bind) -> None:
    service = bind("--pod-role", f"{POD_A}=both", "--bind-allow", "127.0.0.0/8")
    service.publisher(POD_B).publish(STORED)
    eventually(lambda: service.matched().get(POD_B) == len(KEYS), "pod B indexed")
    assert POD_B in service.pods()
    assert service.errors("unlisted_pod") == 0


def test_with_nothing_configured_the_start_warns_that_any_sender_is_accepted(bind) -> None:
    service = bind()
    eventually(lambda: WARNING in service.server.log_tail(20_000), "the warning")
    assert f"events=bind {service.endpoint} (ANY sender accepted)" in service.server.log_tail()
    assert "--bind-allow" in service.server.log_tail(20_000)
    service.publisher(POD_B).publish(STORED)  # accepted, as warned
    eventually(lambda: service.matched().get(POD_B) == len(KEYS), "pod B indexed")

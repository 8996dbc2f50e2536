"""SGLang 0.5.23's own load publisher feeding a composed kvindex: the pushed load decides
``/route`` before any scrape shows it.

The pod is ``tests/conformance/sglang_driver.py --load``, under the SGLang venv's
interpreter: one ``SchedulerLoadPublisher`` per data-parallel rank, built and driven as
SGLang's scheduler builds and drives it (its own ``LoadStat``, encoder, throttle and
one-second heartbeat, its PUB sockets bound where ``--load-publish-endpoint`` puts them);
its ``/server_info`` serves the ``kv_events`` block the driver prints (from the resolver
SGLang's own ``/server_info`` calls) and its ``/metrics`` an SGLang page that never
changes. kvindex is a whole Service behind its ASGI app. Without an SGLang interpreter
the test skips, except in CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvindex.api.http.app import create_app
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from kvindex.api.testing import eventually, free_port
from kvindex.scoring.load import PodLoad
from tests.support.sglang import require_sglang_python
from tests.test_load import SGLANG_DP2
from tests.test_load_push import Pod
from tests.test_route_live import two_free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

DRIVER = Path(__file__).parent / "conformance" / "sglang_driver.py"
MODEL = "sglang/m"
TOKENS = list(range(100, 164))


def sglang_page(waiting: dict[str, int]) -> str:
    """SGLANG_DP2 (two ranks) with each rank's sglang:num_queue_reqs set."""
    page = SGLANG_DP2
    for rank, value in waiting.items():
        pattern = rf'^(sglang:num_queue_reqs\{{dp_rank="{rank}",[^}}]*\}}) \S+$'
        page, count = re.subn(pattern, rf"\g<1> {float(value)}", page, flags=re.M)
        assert count == 1
    return page


class SglangPod:
    """The driver: one SGLang pod's load topic, two ranks."""

    def __init__(self, python: str, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        with open(log, "wb") as err:
            self.process = subprocess.Popen(
                [python, str(DRIVER), "--load", str(two_free_ports()), "2"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True,
            )  # fmt: skip
        self.log = log
        self.server_info = self.answer()

    def answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, self.log.read_text()[-3000:]
        return json.loads(line)

    def command(self, text: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()
        return self.answer()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)


@pytest.fixture
def sglang(tmp_path: Path) -> Iterator[SglangPod]:
    python = require_sglang_python()
    pod = SglangPod(python, tmp_path / "driver.log")
    yield pod
    pod.close()


def test_sglangs_pushed_load_decides_route_before_any_scrape_shows_it(
    sglang: SglangPod, tmp_path: Path
) -> None:
    pushing = Pod(sglang_page({"0": 0, "1": 0}), json.dumps(sglang.server_info).encode())
    scraped = Pod(sglang_page({"0": 1, "1": 1}), None)  # an SGLang pod without a load topic
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": {MODEL: {"block_size": 16, "engines": ["sglang"]}}}))
    service = Service(
        from_flags(
            zmq_bind=[f"tcp://127.0.0.1:{free_port()}"],
            model_config=str(config),
            pod_role=[f"{pushing.pod}=both", f"{scraped.pod}=both"],
            load_interval=0.5,
            load_timeout=2.0,
            load_stale_after=3.0,  # three of SGLang's one-second heartbeats
        ),
        route_seed=0,
    )
    client = TestClient(create_app(service))
    client.__enter__()
    try:

        def load(pod: str) -> Any:
            return service.load.snapshot([pod])[pod]

        def route() -> dict[str, Any]:
            answer = client.post("/route", json={"model": MODEL, "token_ids": TOKENS})
            assert answer.status_code == 200, answer.text
            routed = answer.json()
            # done at once: no route in flight weighs on the next decision
            assert client.post(f"/route/{routed['route_id']}/done").status_code == 200
            return routed

        def pushed(waiting: int) -> bool:
            now = load(pushing.pod)
            return isinstance(now, PodLoad) and now.source == "push" and now.waiting == waiting

        # Both pods scraped; the pushing one's idle heartbeats take over its load.
        eventually(lambda: isinstance(load(scraped.pod), PodLoad), "the other pod scraped")
        eventually(lambda: pushed(0), "the pod's heartbeats (idle) followed")
        idle = load(pushing.pod)
        assert (idle.running, idle.kv_usage, sorted(idle.engines)) == (0, 0.0, ["0", "1"])
        assert route()["pod"] == pushing.pod  # idle beats one waiting request per rank
        metrics = client.get("/metrics").text
        assert f'kvindex_load_source{{pod="{pushing.pod}",source="push"}} 1.0' in metrics
        assert f'kvindex_load_source{{pod="{scraped.pod}",source="scrape"}} 1.0' in metrics
        assert f'kvindex_load_push_ranks{{pod="{pushing.pod}"}} 2.0' in metrics
        assert f'kvindex_load_push_ranks{{pod="{scraped.pod}"}} 0.0' in metrics

        # A burst: 30 requests queue on each rank. Its /metrics page never says so.
        for rank in (0, 1):
            assert sglang.command(f"load {rank} 8 30 12000 16384") == {"load": rank}
        eventually(lambda: pushed(60), "the burst pushed")
        busy = load(pushing.pod)
        assert (busy.running, busy.kv_usage) == (16, 12000 / 16384)
        answer = route()
        assert answer["pod"] == scraped.pod and answer["reason"] == "load"
        rows = [c for c in answer["candidates"] if c["pod"] == pushing.pod]
        assert [(c["rank"], c["waiting"]) for c in rows] == [(0, 30), (1, 30)]
        assert "sglang:num_queue_reqs" in pushing.metrics and "30" not in pushing.metrics

        # Garbage on rank 0's own socket is counted; the rank's next stat applies.
        assert sglang.command("garbage 0") == {"garbage": 0}
        assert sglang.command("load 0 0 0 0 16384") == {"load": 0}
        assert sglang.command("load 1 0 0 0 16384") == {"load": 1}
        eventually(lambda: pushed(0), "the stats after the garbage")
        assert service.load.pushes is not None
        assert service.load.pushes.errors() == {pushing.pod: {"invalid_load": 2}}
        assert route()["pod"] == pushing.pod
        metrics = client.get("/metrics").text
        assert (
            f'kvindex_load_push_errors_total{{pod="{pushing.pod}",reason="invalid_load"}} 2.0'
            in metrics
        )

        # The pod's pushes stop: once they are stale, its scrape is its load again.
        assert sglang.command("stop") == {"stopped": True}
        eventually(
            lambda: isinstance(now := load(pushing.pod), PodLoad) and now.source == "scrape",
            "the pod's load back on its scrape",
        )
        assert route()["pod"] == pushing.pod
    finally:
        client.__exit__(None, None, None)
        pushing.close()
        scraped.close()

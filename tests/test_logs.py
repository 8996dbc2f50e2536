"""What ``kvindex serve`` logs: one line per real event, in JSON with ``--log-format
json``; no per-request or lifecycle chatter from the libraries it uses (httpx logged
every pod /metrics scrape at info: nearly every line of a day's log) unless
``--log-level debug``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvindex.api.testing import ServeProcess, eventually, free_port
from tests.test_load import DP1_IDLE, MetricsServer


def scraped_log(tmp_path: Path, *flags: str) -> tuple[list[str], MetricsServer]:
    """The log of a kvindex serve that scraped a pod's /metrics a few times."""
    pod = MetricsServer(DP1_IDLE)
    server = ServeProcess(
        "--zmq-bind", f"tcp://127.0.0.1:{free_port()}",
        "--model", "m",
        "--pod-role", f"{pod.pod}=both",  # configured: scraped, though nothing publishes
        "--load-interval", "0.1",
        *flags,
        env={**os.environ},
        log_path=tmp_path / "serve.log",
    )  # fmt: skip
    try:
        server.wait_ready(30.0, path="/healthz")
        eventually(lambda: pod.requests >= 5, "five scrapes of the pod's /metrics")
    finally:
        server.stop()
        pod.close()
    return server.log_path.read_text().splitlines(), pod


def test_scrapes_are_not_logged_and_every_line_is_json(tmp_path: Path) -> None:
    lines, pod = scraped_log(tmp_path, "--log-format", "json")
    entries = [json.loads(line) for line in lines if line.strip()]
    assert entries, "kvindex serve logged nothing"
    for entry in entries:
        assert {"ts", "level", "logger", "msg"} <= set(entry), entry
    chatter = [
        e
        for e in entries
        if e["logger"].split(".")[0] in ("httpx", "httpcore", "uvicorn") and e["level"] == "info"
    ]
    assert chatter == [], chatter[:3]
    said = [entry["msg"] for entry in entries]
    assert len(said) == len(set(said)), said  # nothing said twice
    assert not [e for e in entries if f"{pod.pod}/metrics" in e["msg"]]
    assert any(e["msg"].startswith("kvindex ") and " started:" in e["msg"] for e in entries)


def test_debug_shows_each_scrape(tmp_path: Path) -> None:
    lines, pod = scraped_log(tmp_path, "--log-level", "debug")
    assert any(f"{pod.pod}/metrics" in line and " httpx: " in line for line in lines)

"""bench/bench_gateway_soak.py runs through every phase in a few seconds and prints its
table (issue 27): without this the soak would break unnoticed when the gateway or the
fake pods change. The figures themselves are the bench's (bench/README.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.lazy import installed

pytestmark = pytest.mark.skipif(
    not installed("openai"), reason="the gateway soak needs the test extra (openai)"
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_short_gateway_soak_prints_every_phase() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}
    done = subprocess.run(
        [sys.executable, "bench/bench_gateway_soak.py", "--duration", "9",
         "--conversations", "6", "--first-byte-timeout", "0.5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = next(line.split() for line in lines if line.startswith("phase"))
    assert "bad_share" in header and "gw_5xx" in header and "follow_on_pod" in header
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1]}
    for phase in ("healthy", "killed", "blackholed", "frozen", "http_500", "restart"):
        assert int(rows[phase][header.index("requests")]) > 0, done.stdout
    assert rows["healthy"][header.index("gw_5xx")] == "0", done.stdout

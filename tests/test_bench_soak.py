"""bench/soak.py runs and passes for a few seconds (issue 14: the soak reproduces engine
churn under /score and /route load and ends exact). Without this the soak broke
unnoticed when bind mode began checking the sender's address."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_short_soak_is_exact_and_calls_score_and_route() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}
    short = ["--seconds", "4", "--report-every", "2", "--pods", "3", "--rate", "300"]
    churn = ["--restart-p", "0.005", "--partition-p", "0.01"]
    done = subprocess.run(
        [sys.executable, "bench/soak.py", *short, *churn],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    header = next(line for line in out.splitlines() if line.lstrip().startswith("t_s"))
    assert "score_p99_ms" in header and "route_p50_ms" in header and "route_p99_ms" in header
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    columns = header.split()
    assert rows and all(int(row[columns.index("routes")]) > 0 for row in rows)
    assert "exactness: 3/3 pods exact" in out
    assert "/score errors: 0 {}; /route errors: 0 {}" in out
    assert "'pods_with_known_load': 3" in out

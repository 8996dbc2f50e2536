"""``python -m bench.sim --quick`` end to end: every study through a real ``kvindex
serve``. A file of its own, so the test workers run it beside the rest of the simulator's
tests (the suite hands out whole files)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# bench/ is not an installed package; pyproject's pytest `pythonpath = ["."]` puts the
# repository root on sys.path, and this keeps the test runnable without it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.sim.__main__ import main


@pytest.mark.slow
# About a minute on an idle 2-core machine; the suite-wide 120 s is too close when busy.
@pytest.mark.timeout(300)
def test_quick_mode_runs_every_study_end_to_end(tmp_path: Path) -> None:
    """The issue's CI smoke: ``--quick`` runs all four studies (the standard table, the
    load sweeps, the replica and fault studies) through a real kvindex, prints every
    claim, and the index agrees block for block with the pods after every run."""
    # Half --quick's populations: a smoke run of every study, not figures.
    args = ["--quick", "--scale", "0.5", "--no-png", "--no-progress", "--out", str(tmp_path)]
    code = main(args)
    assert code == 0
    report = (tmp_path / "routing.md").read_text()
    for heading in (
        "**docqa:",
        "**chat-load: load sweep",
        "**shared-load: load sweep",
        "**agent-load: load sweep",
        "**replicas study:",
        "**faults study:",
    ):
        assert heading in report, heading
    claims = json.loads((tmp_path / "routing.json").read_text())["claims"]
    assert [c["name"][:1] for c in claims[:4]] == ["1", "2", "3", "4"]
    agreement = claims[-1]
    assert agreement["passed"], agreement["detail"]
    assert "no sync timed out" in agreement["detail"]

"""How the simulator's claims compare policies over seeds (bench/sim/sweep.py,
bench/sim/claims.py): runs of one seed share their arrivals, so a difference is judged
seed by seed, and its interval is the difference's, not the two policies' side by side."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.sim.claims import _paired
from bench.sim.plan import Cell
from bench.sim.sweep import paired, point


def runs(goodput: dict[str, list[float]], load: float = 1.0) -> dict[Cell, SimpleNamespace]:
    """Sweep results with one figure per (policy, seed): only what the metric reads."""
    return {
        Cell("sweep", "chat-load", policy, load, 2, seed=seed): SimpleNamespace(goodput=value)
        for policy, values in goodput.items()
        for seed, value in enumerate(values)
    }


def test_a_difference_every_seed_shares_is_judged_by_its_own_spread() -> None:
    # Seeds differ a lot between themselves (1 to 4 req/s), but "a" is 10% above "b" on
    # every one: side by side the two intervals overlap, paired the difference is exact.
    results = runs({"a": [1.1, 2.2, 3.3, 4.4], "b": [1.0, 2.0, 3.0, 4.0]})
    a, b = (point(results, "sweep", "chat-load", p, 1.0, "goodput_req_s") for p in "ab")
    assert a.mean - a.half_width < b.mean + b.half_width  # indistinguishable side by side
    diff = paired(results, "chat-load", "a", "b", 1.0, "goodput_req_s")
    assert diff.n == 4
    assert diff.mean == pytest.approx(0.10)
    assert diff.half_width == pytest.approx(0.0, abs=1e-12)
    assert _paired(diff) == " (paired +10.0%±0.0% over 4 seeds)"


def test_paired_uses_only_the_seeds_both_policies_ran_and_says_nothing_for_one() -> None:
    results = runs({"a": [2.0, 3.0, 5.0], "b": [1.0, 3.0]})
    diff = paired(results, "chat-load", "a", "b", 1.0, "goodput_req_s")
    assert diff.n == 2 and diff.mean == pytest.approx(0.5)  # seeds 0 and 1: +100%, 0%
    one = paired(runs({"a": [2.0], "b": [1.0]}), "chat-load", "a", "b", 1.0, "goodput_req_s")
    assert one.n == 1 and _paired(one) == ""
    other_load = paired(results, "chat-load", "a", "b", 2.0, "goodput_req_s")
    assert other_load.n == 0

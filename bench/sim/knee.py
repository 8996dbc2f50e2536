"""Is a run long enough for its knee? The cache-oblivious knee, interpolated between
swept loads, at two run lengths.

:func:`bench.sim.sweep.saturation` reads the knee off the swept loads (the first one
past the SLO), which hides how far it moved between two runs within a step of the grid.
Here the knee is where least-loaded's TTFT p90 crosses the SLO's TTFT, linearly
interpolated between the two swept loads around the crossing. A run is long enough
when doubling its population moves that load by less than :data:`STABLE`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from bench.sim.sweep import Results, axes, point

STABLE = 0.10
REFERENCE = "least-loaded"


def crossing(points: Sequence[tuple[float, float]], slo_ttft_s: float) -> float | None:
    """The load where TTFT p90 first exceeds ``slo_ttft_s``, interpolated between the
    (load, TTFT p90) points around it; the lowest load if it is already past; None if
    no point is."""
    ordered = sorted(points)
    for i, (load, ttft) in enumerate(ordered):
        if ttft > slo_ttft_s:
            if i == 0:
                return load
            low, low_ttft = ordered[i - 1]
            return low + (slo_ttft_s - low_ttft) / (ttft - low_ttft) * (load - low)
    return None


def knee(results: Results, scenario: str, slo_ttft_s: float) -> float | None:
    """:func:`crossing` of least-loaded's mean TTFT p90 over the seeds, per swept load."""
    _, loads = axes(results, "sweep", scenario)
    points = [
        (load, point(results, "sweep", scenario, REFERENCE, load, "ttft_p90_s").mean)
        for load in loads
    ]
    return crossing([(x, y) for x, y in points if not math.isnan(y)], slo_ttft_s)


def knee_check(by_scale: Mapping[float, Results], slo_ttft_s: float) -> list[str]:
    """One line per scenario: its knee at each scale and whether it moved < 10%."""
    scales = sorted(by_scale)
    scenarios = sorted({c.scenario for r in by_scale.values() for c in r if c.study == "sweep"})
    lines = []
    for scenario in scenarios:
        knees = [knee(by_scale[s], scenario, slo_ttft_s) for s in scales]
        shown = ", ".join(
            f"scale {s:g}: " + ("never crossed" if k is None else f"x{k:.3g}")
            for s, k in zip(scales, knees, strict=True)
        )
        first, last = knees[0], knees[-1]
        if first is None or last is None:
            verdict = "not judged (no crossing at some scale)"
        else:
            move = abs(last - first) / first
            verdict = f"moved {move:.1%}: " + ("stable" if move < STABLE else "NOT stable")
        lines.append(f"{scenario}: {REFERENCE}'s TTFT p90 crosses the SLO at {shown}; {verdict}")
    return lines

"""PNGs: the standard comparison (hit ratio and TTFT p90 per scenario and policy) and,
per swept scenario, TTFT p90 and goodput against offered load with each policy's knee
marked (an open circle) and 95% CIs when several seeds ran. Nothing is written when
matplotlib is missing (the ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.sim.plan import Cell
from bench.sim.results import RunResult
from bench.sim.sweep import axes, knee, point

Results = Mapping[Cell, RunResult]


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_standard(results: Results, path: Path) -> list[Path]:
    plt = _pyplot()
    runs: dict[tuple[str, str], list[RunResult]] = {}
    for c, r in results.items():
        if c.study == "standard":
            runs.setdefault((c.scenario, c.policy), []).append(r)
    if plt is None or not runs:
        return []
    names = list(dict.fromkeys(s for s, _ in runs))
    policies = list(dict.fromkeys(p for _, p in runs))
    fig, (ax_hit, ax_ttft) = plt.subplots(2, 1, figsize=(max(8, 2.2 * len(names)), 8))
    width = 0.8 / max(len(policies), 1)
    cmap = plt.get_cmap("tab10")
    for j, policy in enumerate(policies):
        xs, hits, ttfts = [], [], []
        for i, name in enumerate(names):
            group = runs.get((name, policy))
            if not group:
                continue
            xs.append(i + (j - (len(policies) - 1) / 2) * width)
            hits.append(sum(r.hit_ratio for r in group) / len(group) * 100)
            ttfts.append(max(sum(r.ttft(90) for r in group) / len(group), 1e-3))
        ax_hit.bar(xs, hits, width, label=policy, color=cmap(j % 10))
        ax_ttft.bar(xs, ttfts, width, label=policy, color=cmap(j % 10))
    for ax in (ax_hit, ax_ttft):
        ax.set_xticks(range(len(names)), names)
        ax.grid(axis="y", alpha=0.3)
    ax_hit.set_ylabel("prefix-cache hit ratio (%)")
    ax_hit.set_ylim(0, 100)
    ax_ttft.set_ylabel("TTFT p90 (s, log)")
    ax_ttft.set_yscale("log")
    ax_hit.set_title(
        "Routing policies at each scenario's own load, mean over seeds "
        "(kvindex policies: real kvindex)"
    )
    handles, labels = ax_hit.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(policies), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def plot_sweeps(results: Results, out_dir: Path, slo_ttft_s: float) -> list[Path]:
    plt = _pyplot()
    if plt is None:
        return []
    written = []
    cmap = plt.get_cmap("tab10")
    for name in dict.fromkeys(c.scenario for c in results if c.study == "sweep"):
        policies, loads = axes(results, "sweep", name)
        fig, (ax_t, ax_g) = plt.subplots(1, 2, figsize=(13, 5))
        for j, policy in enumerate(policies):
            color = cmap(j % 10)
            style = "--" if policy == "greedy-perfect" else "-"
            for ax, metric in ((ax_t, "ttft_p90_s"), (ax_g, "goodput_req_s")):
                est = [point(results, "sweep", name, policy, x, metric) for x in loads]
                ys = [max(e.mean, 1e-3) if metric == "ttft_p90_s" else e.mean for e in est]
                errs = [e.half_width for e in est]
                ax.errorbar(loads, ys, yerr=errs if any(errs) else None, color=color,
                            linestyle=style, marker=".", label=policy, capsize=2)  # fmt: skip
                k = knee(results, name, policy, slo_ttft_s)
                if k is not None:
                    y = ys[loads.index(k)]
                    ax.plot([k], [y], "o", mfc="none", mec=color, ms=11, mew=1.5)
        ax_t.axhline(slo_ttft_s, color="grey", linestyle=":", label="TTFT SLO")
        ax_t.set_yscale("log")
        ax_t.set_ylabel("TTFT p90 (s, log)")
        ax_g.set_ylabel("goodput (requests/s within the SLO)")
        for ax in (ax_t, ax_g):
            ax.set_xlabel("offered load (x the scenario's base)")
            ax.grid(alpha=0.3)
        ax_t.set_title(f"{name}: TTFT p90 (open circle = knee)")
        ax_g.set_title(f"{name}: goodput")
        ax_g.legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = out_dir / f"sweep-{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written

"""The comparison as a terminal table, markdown, JSON and a PNG.

Columns: hit ratio (reused / prompt tokens), prefill tokens computed and their ratio to
the ideal (one pod with an unbounded cache), modelled TTFT p50/p90/p99 in seconds, load
imbalance (busiest pod's requests / mean), rejected requests, evicted blocks, and the
pods' prefill utilisation. Definitions are in ``results``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.sim.claims import Claim
from bench.sim.results import RunResult
from bench.sim.scenarios import Scenario

HEADER = (
    "policy",
    "hit",
    "prefill tok",
    "x ideal",
    "TTFT p50",
    "p90",
    "p99",
    "imbal",
    "rej",
    "evicted",
    "util",
)


@dataclass(slots=True)
class ScenarioRuns:
    scenario: Scenario
    runs: list[RunResult]
    requests: int
    ideal_prefill_tokens: int


def _row(r: RunResult) -> tuple[str, ...]:
    ideal = r.prefill_tokens / r.ideal_prefill_tokens if r.ideal_prefill_tokens else math.nan
    return (
        r.policy,
        f"{r.hit_ratio:.1%}",
        f"{r.prefill_tokens:,}",
        f"{ideal:.2f}",
        f"{r.ttft(50):.3f}",
        f"{r.ttft(90):.3f}",
        f"{r.ttft(99):.3f}",
        f"{r.imbalance:.2f}",
        str(r.rejected),
        f"{r.evicted_blocks:,}",
        f"{r.prefill_utilization:.0%}",
    )


def _index_note(r: RunResult) -> str | None:
    if r.index is None:
        return None
    i = r.index
    a = i["agreement"]
    verdict = "agrees" if a["agrees"] else "DISAGREES"
    return (
        f"precise via kvindex: {i['score_calls']:,} /score calls, {i['syncs']:,} syncs "
        f"({i['sync_waits']:,} found the index behind, {i['sync_timeouts']} timed out, "
        f"{i['sync_wait_s']:.1f} s), {i['score_mismatches']} score mismatches; index "
        f"{verdict} with the pods (key sets compared block for block; "
        f"{a['probed_chains']:,}/{a['chains']:,} chains probed)"
    )


def _header_line(s: ScenarioRuns) -> str:
    c = s.scenario.cluster
    return (
        f"{s.scenario.name}: {s.requests:,} requests, {c.pods} pods x {c.blocks_per_pod:,} "
        f"blocks, ideal prefill {s.ideal_prefill_tokens:,} tokens"
    )


def table(results: Sequence[ScenarioRuns]) -> str:
    lines = []
    for s in results:
        rows = [HEADER, *(_row(r) for r in s.runs)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
        lines.append(_header_line(s))
        for row in rows:
            lines.append(
                "  "
                + "  ".join(
                    cell.ljust(w) if i == 0 else cell.rjust(w)
                    for i, (cell, w) in enumerate(zip(row, widths, strict=True))
                )
            )
        lines.extend(f"  {n}" for n in (_index_note(r) for r in s.runs) if n)
        lines.append("")
    return "\n".join(lines)


def markdown(results: Sequence[ScenarioRuns], claims: Sequence[Claim], meta: dict[str, Any]) -> str:
    out = [
        f"Command: `{meta['command']}`  ",
        f"Wall time {meta['wall_s']:.0f} s; seed {meta['seed']}; block size "
        f"{meta['block_size']}; prefill {meta['costs']['prefill_tokens_per_s']:,.0f} tok/s, "
        f"decode {meta['costs']['decode_s_per_token'] * 1000:.0f} ms/token, batch limit "
        f"{meta['costs']['batch_limit']}; events as vLLM {meta['vllm_version']}.",
        "",
    ]
    for s in results:
        out.append(f"**{_header_line(s)}** - {s.scenario.about}")
        out.append("")
        out.append("| " + " | ".join(HEADER) + " |")
        out.append("|" + "|".join(["---"] + ["---:"] * (len(HEADER) - 1)) + "|")
        for r in s.runs:
            out.append("| " + " | ".join(_row(r)) + " |")
        notes = [n for n in (_index_note(r) for r in s.runs) if n]
        if notes:
            out.append("")
            out.extend(f"_{n}_" for n in notes)
        out.append("")
    out.append("Claims:")
    out.append("")
    out.extend(f"- {c.line()}" for c in claims)
    out.append("")
    return "\n".join(out)


def to_json(
    results: Sequence[ScenarioRuns], claims: Sequence[Claim], meta: dict[str, Any]
) -> dict[str, Any]:
    return {
        "meta": meta,
        "scenarios": [
            {
                "name": s.scenario.name,
                "about": s.scenario.about,
                "workload": {"kind": s.scenario.spec.kind, **s.scenario.spec.params()},
                "cluster": {
                    "pods": s.scenario.cluster.pods,
                    "blocks_per_pod": s.scenario.cluster.blocks_per_pod,
                },
                "requests": s.requests,
                "ideal_prefill_tokens": s.ideal_prefill_tokens,
                "runs": [r.summary() for r in s.runs],
            }
            for s in results
        ],
        "claims": [c.as_dict() for c in claims],
    }


def plot(results: Sequence[ScenarioRuns], path: Path) -> bool:
    """Hit ratio and TTFT p90 per scenario and policy; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    policies: list[str] = []
    for s in results:
        for r in s.runs:
            if r.policy not in policies:
                policies.append(r.policy)
    names = [s.scenario.name for s in results]
    fig, (ax_hit, ax_ttft) = plt.subplots(2, 1, figsize=(max(8, 2 * len(names)), 8))
    width = 0.8 / max(len(policies), 1)
    cmap = plt.get_cmap("tab10")
    for p_index, policy in enumerate(policies):
        xs, hits, ttfts = [], [], []
        for s_index, s in enumerate(results):
            run = next((r for r in s.runs if r.policy == policy), None)
            if run is None:
                continue
            xs.append(s_index + (p_index - (len(policies) - 1) / 2) * width)
            hits.append(run.hit_ratio * 100)
            ttfts.append(max(run.ttft(90), 1e-3))
        color = cmap(p_index % 10)
        ax_hit.bar(xs, hits, width, label=policy, color=color)
        ax_ttft.bar(xs, ttfts, width, label=policy, color=color)
    for ax in (ax_hit, ax_ttft):
        ax.set_xticks(range(len(names)), names)
        ax.grid(axis="y", alpha=0.3)
    ax_hit.set_ylabel("prefix-cache hit ratio (%)")
    ax_hit.set_ylim(0, 100)
    ax_ttft.set_ylabel("TTFT p90 (s, log)")
    ax_ttft.set_yscale("log")
    ax_hit.set_title("Routing policies on a simulated vLLM cluster (precise = real kvindex)")
    handles, labels = ax_hit.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(policies), 9), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(
    out_dir: Path,
    results: Sequence[ScenarioRuns],
    claims: Sequence[Claim],
    meta: dict[str, Any],
    *,
    png: bool = True,
) -> list[Path]:
    """Write routing.md, routing.json and (if possible) routing.png; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    md = out_dir / "routing.md"
    md.write_text(markdown(results, claims, meta), encoding="utf-8")
    written.append(md)
    js = out_dir / "routing.json"
    js.write_text(json.dumps(to_json(results, claims, meta), indent=2), encoding="utf-8")
    written.append(js)
    if png:
        image = out_dir / "routing.png"
        if plot(results, image):
            written.append(image)
    return written

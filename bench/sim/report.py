"""The comparison as a terminal table, markdown and JSON (PNGs: :mod:`bench.sim.plots`).

Standard table columns: hit ratio, prefill tokens and their ratio to the ideal (every
distinct block computed once - the prefill bound), TTFT p50/p90/p99, ITL p50, e2e
p90 (seconds), output throughput (tokens/s), goodput (requests/s within the SLO) and
the fraction of requests within it, imbalance, preemptions, evicted blocks. The sweep
tables give TTFT p90 and goodput per load (mean±95% CI over seeds), with each policy's
knee. Definitions are in :mod:`bench.sim.results` and :mod:`bench.sim.sweep`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.sim.claims import Claim
from bench.sim.plan import Cell
from bench.sim.plots import plot_standard, plot_sweeps
from bench.sim.results import RunResult
from bench.sim.scenarios import Scenario
from bench.sim.sweep import METRICS, Estimate, axes, estimate, knee, point, saturation

Results = Mapping[Cell, RunResult]
HEADER = (
    "policy", "hit", "prefill tok", "x ideal", "x bound", "TTFT p50", "p90", "p99",
    "ITL p50", "e2e p90", "tok/s", "goodput", "good", "imbal", "preempt", "evicted",
)  # fmt: skip


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}" if b else "-"


def _mean(runs: Sequence[RunResult], get: Callable[[RunResult], float]) -> Estimate:
    return estimate([get(r) for r in runs])


def _row(runs: Sequence[RunResult]) -> tuple[str, ...]:
    """One policy's figures: means over its seeds, with 95% CIs on hit ratio, TTFT p90
    and goodput when several seeds ran."""

    def m(get: Callable[[RunResult], float]) -> float:
        return _mean(runs, get).mean

    r0 = runs[0]
    hit = _mean(runs, lambda r: r.hit_ratio * 100)
    return (
        r0.policy, hit.text(".1f") + "%", f"{m(lambda r: r.prefill_tokens):,.0f}",
        f"{m(lambda r: r.prefill_tokens / max(r.ideal_prefill_tokens, 1)):.2f}",
        f"{m(lambda r: r.prefill_tokens / max(r.capacity_bound_tokens, 1)):.2f}",
        f"{m(lambda r: r.ttft(50)):.3f}", _mean(runs, lambda r: r.ttft(90)).text(),
        f"{m(lambda r: r.ttft(99)):.3f}", f"{m(lambda r: r.itl(50)) * 1e3:.0f}ms",
        f"{m(lambda r: r.e2e(90)):.2f}", f"{m(lambda r: r.throughput):,.0f}",
        _mean(runs, lambda r: r.goodput).text(".2f"), f"{m(lambda r: r.good_fraction):.0%}",
        f"{m(lambda r: r.imbalance):.2f}", f"{m(lambda r: r.preemptions):.0f}",
        f"{m(lambda r: r.evicted_blocks):,.0f}",
    )  # fmt: skip


def _by_policy(runs: Sequence[tuple[Cell, RunResult]]) -> dict[str, list[RunResult]]:
    out: dict[str, list[RunResult]] = {}
    for c, r in runs:
        out.setdefault(c.policy, []).append(r)
    return out


def _bound_rows(runs: Sequence[RunResult]) -> list[tuple[str, ...]]:
    """The ideal prefill (unbounded cache), and the capacity bound and TTFT floor, which
    hold per run on its own arrival order (closed-loop sessions arrive as their answers
    come): the bound's range over the runs, the largest floor."""
    r0 = runs[0]
    nocache = r0.no_cache_prefill_tokens

    def hit(tokens: int) -> str:
        return f"{1 - tokens / nocache:.1%}" if nocache else "-"

    bounds = sorted({r.capacity_bound_tokens for r in runs})
    span = f"{bounds[0]:,}" + (f"-{bounds[-1]:,}" if len(bounds) > 1 else "")
    floor = [max(r.ttft_floor(q) for r in runs) for q in (50, 90, 99)]
    blank = ("",) * 8
    return [
        ("ideal prefill (bound)", hit(r0.ideal_prefill_tokens), f"{r0.ideal_prefill_tokens:,}",
         "1.00", "", "", "", "", *blank),
        ("capacity bound / TTFT floor", hit(bounds[-1]), span,
         _ratio(bounds[-1], r0.ideal_prefill_tokens), "1.00",
         *(f"{x:.3f}" for x in floor), *blank),
    ]  # fmt: skip


def _trace_rows(stats: dict[str, Any]) -> list[tuple[str, ...]]:
    if "measured" not in stats:
        return []
    from bench.sim.mooncake import stats_table  # only traces report statistics

    rows = stats_table(stats["measured"])
    return [("statistic", "generated (as sent)", "counting earlier turns", "Mooncake trace"), *rows]


def _grid(rows: Sequence[Sequence[str]], md: bool) -> list[str]:
    if md:
        out = [
            "| " + " | ".join(rows[0]) + " |",
            "|" + "|".join(["---"] + ["---:"] * (len(rows[0]) - 1)) + "|",
        ]
        return out + ["| " + " | ".join(r) + " |" for r in rows[1:]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  "
        + "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]


def _index_note(r: RunResult) -> str | None:
    if r.index is None:
        return None
    i, a = r.index, r.index["agreement"]
    stale = (
        ""
        if i["stale_decisions"] is None
        else f", {i['stale_decisions']:,} decisions on a lagging index"
    )
    scrapes = (
        ""
        if i.get("scrape_waits") is None
        else f", {i['scrape_waits']:,} scrape ticks waited for ({i['scrape_timeouts']} timed out)"
    )
    return (
        f"{r.policy} via kvindex: {i['score_calls']:,} /score calls, {i['syncs']:,} syncs "
        f"({i['sync_timeouts']} timed out){stale}{scrapes}; index "
        f"{'agrees' if a['agrees'] else 'DISAGREES'} with the pods "
        f"({a['probed_chains']:,}/{a['chains']:,} chains probed)"
    )


def sections(
    results: Results,
    scenarios: Mapping[str, Scenario],
    md: bool,
    slo_ttft_s: float,
    workload_stats: Mapping[str, dict[str, Any]] | None = None,
) -> list[str]:
    workload_stats = workload_stats or {}
    out: list[str] = []
    bold = (lambda s: f"**{s}**") if md else (lambda s: s)
    for name in dict.fromkeys(c.scenario for c in results if c.study == "standard"):
        cells = [(c, r) for c, r in results.items() if c.study == "standard" and c.scenario == name]
        runs = [r for _, r in cells]
        seeds = len({c.seed for c, _ in cells})
        s, r0 = scenarios[name], runs[0]
        cl = s.cluster
        out.append(
            bold(
                f"{name}: {r0.requests + r0.rejected:,} requests, "
                f"{cl.pods} pods x {cl.blocks_per_pod:,} blocks"
            )
            + f" - {s.about}"
            + (f" (means over {seeds} seeds, ± their 95% CI)" if seeds > 1 else "")
        )
        out.append("")
        rows = [_row(group) for group in _by_policy(cells).values()]
        out.extend(_grid([HEADER, *rows, *_bound_rows(runs)], md))
        out.extend(f"  {n}" for n in (_index_note(r) for c, r in cells if c.seed == 0) if n)
        out.append("")
        trace = _trace_rows(workload_stats.get(name, {}))
        if trace:
            out.append(f"{name}: the generated trace next to the trace it imitates (seed 0)")
            out.append("")
            out.extend(_grid(trace, md))
            out.append("")
    for name in dict.fromkeys(c.scenario for c in results if c.study == "sweep"):
        policies, loads = axes(results, "sweep", name)
        sat, ref = saturation(results, name, slo_ttft_s)
        reps = next(c.replicas for c in results if c.study == "sweep")
        out.append(
            bold(f"{name}: load sweep, {reps} gateway replicas")
            + f" - {scenarios[name].about}; saturation (knee of {ref}): "
            + (f"x{sat:g}" if sat else "not reached")
        )
        out.append("")
        for metric, title, fmt in (
            ("ttft_p90_s", "TTFT p90 (s)", ".3f"),
            ("goodput_req_s", "goodput (req/s)", ".2f"),
            ("hit_ratio", "hit ratio", ".3f"),
        ):
            rows = [(title, *(f"x{x:g}" for x in loads), "knee")]
            for p in policies:
                k = knee(results, name, p, slo_ttft_s)
                rows.append(
                    (
                        p,
                        *(point(results, "sweep", name, p, x, metric).text(fmt) for x in loads),
                        f"x{k:g}" if k else "-",
                    )
                )
            out.extend(_grid(rows, md))
            out.append("")
    for study, column in (("replicas", "replicas"), ("faults", "faults")):
        cells = [c for c in results if c.study == study]
        if not cells:
            continue
        c0 = cells[0]
        out.append(
            bold(
                f"{study} study: {c0.scenario} x{c0.load:g}"
                + (", 2 replicas" if study == "faults" else "")
            )
        )
        out.append("")
        rows = [("policy", column, "hit", "TTFT p90", "goodput", "good", "retried", "direct")]
        groups: dict[tuple[str, str], list[RunResult]] = {}
        for c in cells:
            what = str(c.replicas) if study == "replicas" else c.faults.label()
            groups.setdefault((c.policy, what), []).append(results[c])
        for (policy, what), runs in groups.items():
            rows.append(
                (
                    policy,
                    what,
                    _mean(runs, lambda r: r.hit_ratio * 100).text(".1f") + "%",
                    _mean(runs, lambda r: r.ttft(90)).text(),
                    _mean(runs, lambda r: r.goodput).text(".2f"),
                    f"{_mean(runs, lambda r: r.good_fraction).mean:.0%}",
                    f"{_mean(runs, lambda r: r.retried).mean:.0f}",
                    f"{_mean(runs, lambda r: r.direct).mean:.0f}",
                )
            )
        out.extend(_grid(rows, md))
        out.append("")
    return out


def markdown(
    results: Results,
    scenarios: Mapping[str, Scenario],
    claims: Sequence[Claim],
    meta: dict[str, Any],
) -> str:
    e = meta["engine"]
    head = [
        f"Command: `{meta['command']}`  ",
        f"Wall time {meta['wall_s']:.0f} s; block size {meta['block_size']}; engine: "
        f"{e['max_num_batched_tokens']:,} batched tokens, {e['max_num_seqs']} seqs, step = "
        f"{e['overhead_ms']:g} ms + {e['token_us']:g} us/token + {e['kv_token_ns']:g} ns/context "
        f"token; {meta['lag']}; SLO TTFT <= {meta['slo']['ttft_s']:g} s and ITL <= "
        f"{meta['slo']['itl_s'] * 1e3:g} ms; events as vLLM {meta['vllm_version']}.",
        "",
    ]
    body = sections(results, scenarios, True, meta["slo"]["ttft_s"], meta.get("workload_stats"))
    tail = ["Claims:", "", *(f"- {c.line()}" for c in claims), ""]
    return "\n".join(head + body + tail)


def aggregates(results: Results) -> list[dict[str, Any]]:
    """Every metric's mean and 95% CI over the seeds of each run configuration."""
    groups: dict[tuple[Any, ...], list[RunResult]] = {}
    keys: dict[tuple[Any, ...], Cell] = {}
    for c, r in results.items():
        key = (c.study, c.scenario, c.policy, c.load, c.replicas, c.faults.label())
        groups.setdefault(key, []).append(r)
        keys.setdefault(key, c)
    out = []
    for key, runs in groups.items():
        c = keys[key]
        entry: dict[str, Any] = {
            "study": c.study, "scenario": c.scenario, "policy": c.policy, "load": c.load,
            "replicas": c.replicas, "faults": c.faults.label(), "seeds": len(runs),
        }  # fmt: skip
        for name, get in METRICS.items():
            e = estimate([get(r) for r in runs])
            entry[name] = {"mean": _json_float(e.mean), "ci95": _json_float(e.half_width)}
        out.append(entry)
    return out


def _json_float(x: float) -> float | None:
    return None if x != x else round(x, 6)


def to_json(
    results: Results,
    scenarios: Mapping[str, Scenario],
    claims: Sequence[Claim],
    meta: dict[str, Any],
) -> dict[str, Any]:
    return {
        "meta": meta,
        "scenarios": {
            name: {
                "about": s.about,
                "workload": {"kind": s.spec.kind, **s.spec.params()},
                "cluster": {"pods": s.cluster.pods, "blocks_per_pod": s.cluster.blocks_per_pod},
            }
            for name, s in scenarios.items()
        },
        "runs": [{"study": c.study, "seed": c.seed, **r.summary()} for c, r in results.items()],
        "aggregates": aggregates(results),
        "claims": [c.as_dict() for c in claims],
    }


def write(
    out_dir: Path,
    results: Results,
    scenarios: Mapping[str, Scenario],
    claims: Sequence[Claim],
    meta: dict[str, Any],
    *,
    png: bool = True,
) -> list[Path]:
    """Print the tables and claims; write routing.md, routing.json and the PNGs."""
    stats = meta.get("workload_stats")
    print("\n".join(sections(results, scenarios, False, meta["slo"]["ttft_s"], stats)))
    print("\n".join(c.line() for c in claims))
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "routing.md"
    md.write_text(markdown(results, scenarios, claims, meta), encoding="utf-8")
    js = out_dir / "routing.json"
    js.write_text(json.dumps(to_json(results, scenarios, claims, meta), indent=1), encoding="utf-8")
    written = [md, js]
    if png:
        written += plot_standard(results, out_dir / "routing.png")
        written += plot_sweeps(results, out_dir, meta["slo"]["ttft_s"])
    return written

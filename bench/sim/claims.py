"""The issue's "what it must show", checked against a comparison's results.

Each claim is evaluated only when the runs it needs are present (a partial comparison
skips the rest) and states its numbers whether it passes or not, so the README can quote
them as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bench.sim.results import RunResult

Runs = Mapping[tuple[str, str], RunResult]  # (scenario, policy) -> result


@dataclass(frozen=True, slots=True)
class Claim:
    name: str
    passed: bool | None  # None: not evaluated (runs missing) or informational
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}

    def line(self) -> str:
        mark = {True: "PASS", False: "FAIL", None: "----"}[self.passed]
        return f"[{mark}] {self.name}: {self.detail}"


def evaluate(runs: Runs, doc_tokens: Mapping[str, int] | None = None) -> list[Claim]:
    """``doc_tokens``: document length per document-QA scenario."""
    claims = [_chat(runs)]
    for scenario, tokens in (doc_tokens or {}).items():
        claims.append(_docqa(runs, scenario, tokens))
    claims.extend(_approximate(runs))
    claims.append(_ordering(runs))
    claims.append(_agreement(runs))
    return claims


def _chat(runs: Runs, scenario: str = "chat") -> Claim:
    name = f"{scenario}: precise >= 90% of oracle's hit ratio and >= 2.5x round-robin's"
    precise, oracle, rr = (runs.get((scenario, p)) for p in ("precise", "oracle", "round-robin"))
    if precise is None or oracle is None or rr is None:
        return Claim(name, None, "needs precise, oracle and round-robin runs")
    of_oracle = precise.hit_ratio / oracle.hit_ratio if oracle.hit_ratio else 0.0
    of_rr = precise.hit_ratio / rr.hit_ratio if rr.hit_ratio else float("inf")
    return Claim(
        name,
        of_oracle >= 0.9 and of_rr >= 2.5,
        f"precise {precise.hit_ratio:.1%}, oracle {oracle.hit_ratio:.1%} "
        f"({of_oracle:.1%} of it), round-robin {rr.hit_ratio:.1%} ({of_rr:.2f}x)",
    )


def context_prefills(result: RunResult, doc_tokens: int) -> tuple[float, float]:
    """Per document: how many times its tokens were prefilled, and on how many pods it
    was served (means over documents)."""
    groups = list(result.groups.values())
    if not groups or doc_tokens <= 0:
        return 0.0, 0.0
    prefills = [(g.computed_tokens - g.fresh_tokens) / doc_tokens for g in groups]
    return sum(prefills) / len(groups), sum(len(g.pods) for g in groups) / len(groups)


def _docqa(runs: Runs, scenario: str, doc_tokens: int) -> Claim:
    name = (
        f"{scenario}: precise prefill within 15% of the ideal and >= 85% below recomputing "
        "the document every time; round-robin pays a document once per pod or more"
    )
    precise, rr = runs.get((scenario, "precise")), runs.get((scenario, "round-robin"))
    if precise is None or rr is None:
        return Claim(name, None, "needs precise and round-robin runs")
    over_ideal = precise.prefill_tokens / precise.ideal_prefill_tokens - 1
    cut = 1 - precise.prefill_tokens / precise.no_cache_prefill_tokens
    p_docs, _ = context_prefills(precise, doc_tokens)
    rr_docs, rr_pods = context_prefills(rr, doc_tokens)
    return Claim(
        name,
        over_ideal <= 0.15 and cut >= 0.85 and rr_docs >= rr_pods * 0.95,
        f"precise {precise.prefill_tokens:,} prefill tokens vs ideal "
        f"{precise.ideal_prefill_tokens:,} ({over_ideal:+.1%}), {cut:.1%} below "
        f"{precise.no_cache_prefill_tokens:,} (no reuse); {p_docs:.2f} prefills per "
        f"document; round-robin {rr.prefill_tokens:,} tokens, {rr_docs:.2f} prefills per "
        f"document over {rr_pods:.2f} pods per document",
    )


def _approximate(runs: Runs) -> list[Claim]:
    """Where approximate falls behind precise: every scenario where it does, by how much."""
    out = []
    scenarios = sorted({s for s, _ in runs})
    for scenario in scenarios:
        precise = runs.get((scenario, "precise"))
        if precise is None:
            continue
        for (s, policy), approx in sorted(runs.items()):
            if s != scenario or not policy.startswith("approximate"):
                continue
            if precise.evicted_blocks == 0 and approx.evicted_blocks == 0:
                continue  # no eviction pressure: nothing for an estimate to miss
            gap = precise.hit_ratio - approx.hit_ratio
            extra = approx.prefill_tokens / precise.prefill_tokens - 1
            out.append(
                Claim(
                    f"{scenario}: {policy} vs precise under eviction",
                    None,
                    f"hit ratio {approx.hit_ratio:.1%} vs {precise.hit_ratio:.1%} "
                    f"({gap * 100:+.1f} points for precise), {extra:+.0%} prefill tokens, "
                    f"TTFT p50 {approx.ttft(50):.3f} vs {precise.ttft(50):.3f} s, "
                    f"p90 {approx.ttft(90):.3f} vs {precise.ttft(90):.3f} s",
                )
            )
    return out


def _ordering(runs: Runs) -> Claim:
    name = "every scenario: oracle >= precise > round-robin on hit ratio"
    checked, failed = 0, []
    for scenario in sorted({s for s, _ in runs}):
        got = [runs.get((scenario, p)) for p in ("oracle", "precise", "round-robin")]
        if any(r is None for r in got):
            continue
        oracle, precise, rr = got
        assert oracle is not None and precise is not None and rr is not None
        checked += 1
        if not (oracle.hit_ratio >= precise.hit_ratio - 1e-9 > rr.hit_ratio - 1e-9):
            failed.append(
                f"{scenario} ({oracle.hit_ratio:.3f} / {precise.hit_ratio:.3f} / "
                f"{rr.hit_ratio:.3f})"
            )
    if not checked:
        return Claim(name, None, "needs oracle, precise and round-robin runs")
    if failed:
        return Claim(name, False, "fails on " + ", ".join(failed))
    return Claim(name, True, f"holds on all {checked} scenarios")


def _agreement(runs: Runs) -> Claim:
    name = "index agrees block for block with every pod after each precise run"
    checked, problems = 0, []
    for (scenario, _), result in sorted(runs.items()):
        if result.index is None:
            continue
        checked += 1
        info = result.index
        agreement = info["agreement"]
        if not agreement["agrees"]:
            problems.append(f"{scenario}: {agreement['mismatches'][:3]}")
        if info["score_mismatches"]:
            problems.append(f"{scenario}: {info['score_mismatches']} score mismatches")
        if info["sync_timeouts"]:
            problems.append(f"{scenario}: {info['sync_timeouts']} sync timeouts")
    if not checked:
        return Claim(name, None, "no precise run")
    if problems:
        return Claim(name, False, "; ".join(problems))
    return Claim(
        name,
        True,
        f"{checked} runs: key sets equal block for block, block counts equal, every probed "
        "chain matched, no score at "
        "decision time differed from the pods' true caches, no sync timed out",
    )

"""A synthetic trace with the statistics of Mooncake's public conversation trace.

Source: ``FAST25-release/traces/conversation_trace.jsonl`` in kvcache-ai/Mooncake (the
trace of the FAST'25 paper "Mooncake: Trading More Storage for Less Computation"; the
release README gives 12,031 requests, average input 12,035 and output 343 tokens). Each
line is ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, one id
per 512-token block, equal ids meaning a reusable prefix. Every number below was
measured from that file (read at Mooncake commit 3b5a594) by linking each request to the
latest earlier one sharing its longest prefix of ids (a continuation) - nothing of the
trace is copied here but these summary figures:

* 12,031 requests in 3,537 s (3.40/s); 7,373 start a conversation (2.08/s, 61%), 3,959
  extend the previous turn (its whole prompt but at most its last block is reused) and
  699 (15% of continuations) fork: they keep only part of the earlier prompt;
* every request's first block is the same (a 512-token system prompt);
* arrivals come in 3 s ticks (all timestamps are multiples of ~3,000 ms), ~10.2 per
  tick with variance/mean 1.10: Poisson arrivals quantised to the tick;
* the time between a turn and the next is 123 s at the median (arrival to arrival);
* with an unbounded cache and 512-token blocks, 37.4% of input tokens are a reusable
  prefix; input p50 6,909, p90 27,367, p99 85,401 tokens; output p50 350, p90 597.

The generator draws each quantity from the measured quantiles (log-linear interpolation
between them, so the heavy tails stay heavy): conversations start as a Poisson process;
each has a number of turns from the measured distribution; the first prompt is the
shared system prompt plus new content; a continuation arrives one measured gap after
its parent (open loop, as a trace replay sends it: the answer may not be finished) and
either extends the parent's prompt by the measured growth (the parent's answer, then new
content) or forks (keeps a measured fraction of the parent's prompt, then new content).
To be stationary from the first second, conversations start ``warmup_s`` before the
window and only requests arriving inside it are sent; a continuation whose parent came
before the window carries that history, which no pod has seen (a cold start).
:func:`trace_stats` measures a generated trace the same way, next to :data:`TARGETS`.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from bench.sim.workloads import SimRequest, Workload, WorkloadSpec, _Source
from kvindex.indexer.keys import BlockHasher, HashConfig

#: Quantile levels (percent) of the tables below.
LEVELS = (0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95,
          97.5, 99, 99.5, 100)  # fmt: skip
#: Input tokens of a conversation's first request.
FIRST_INPUT = (891, 897, 905, 943, 1092, 1336, 1756, 2767, 3914, 4587, 5264, 6191, 7417,
               8828, 10775, 13056, 15871, 19453, 25561, 38538, 58648, 89869, 111800,
               126195)  # fmt: skip
#: Input growth of an extending continuation over its parent's input (3.3% are < 1).
GROWTH = (-392, 20, 63, 123, 192, 260, 313, 357, 395, 433, 471, 508, 553, 608, 684, 831,
          1291, 2856, 4605, 7390, 10724, 17031, 22493, 91918)  # fmt: skip
#: Seconds from a request's arrival to its continuation's.
GAP_S = (0, 30, 42, 51, 60, 66, 75, 84, 96, 108, 123, 138, 162, 189, 222, 264, 318, 390,
         483, 618, 915, 1482, 1908, 3030)  # fmt: skip
#: A fork keeps this fraction of its parent's prompt blocks ...
FORK_KEEP = (0.015, 0.053, 0.068, 0.081, 0.097, 0.111, 0.129, 0.15, 0.167, 0.185, 0.214,
             0.25, 0.29, 0.342, 0.4, 0.453, 0.524, 0.686, 0.833, 0.906, 0.929, 0.957,
             0.967, 0.986)  # fmt: skip
#: ... and adds this many new tokens.
FORK_NEW = (10, 894, 1707, 3726, 4969, 5790, 7013, 7918, 8540, 8939, 9567, 10178, 10946,
            11986, 13687, 14851, 15907, 17379, 19913, 26597, 30241, 43120, 48383,
            94968)  # fmt: skip
#: Output tokens of any request.
OUTPUT = (1, 10, 24, 46, 100, 156, 213, 256, 291, 322, 350, 375, 399, 423, 447, 472, 504,
          543, 597, 698, 836, 1120, 1570, 2000)  # fmt: skip
#: (requests in the conversation, conversations) - 7,373 conversations.
TURNS = ((1, 5114), (2, 1311), (3, 464), (4, 200), (5, 117), (6, 55), (7, 27), (8, 26),
         (9, 10), (10, 16), (11, 5), (12, 2), (13, 4), (14, 2), (15, 5), (16, 4), (17, 4),
         (18, 1), (19, 1), (21, 1), (22, 1), (25, 1), (27, 1), (43, 1))  # fmt: skip
FORK_SHARE = 699 / (699 + 3959)

#: The trace's own figures, as :func:`trace_stats` measures a generated trace.
TARGETS: dict[str, float] = {
    "requests_per_s": 3.40,
    "conversations_per_s": 2.08,
    "per_tick_mean": 10.2,
    "per_tick_var_over_mean": 1.10,
    "continuation_share": 0.387,
    "reuse_ratio": 0.374,
    "input_mean": 12035,
    "input_p50": 6909,
    "input_p90": 27367,
    "input_p99": 85401,
    "output_mean": 343,
    "output_p50": 350,
    "output_p90": 597,
}
TRACE_BLOCK = 512  # the trace's hash_ids block size


def _sampler(table: Sequence[float], rng: random.Random, log: bool = True) -> float:
    """One draw from the distribution with these quantiles at :data:`LEVELS`."""
    u = rng.random() * 100
    k = min(bisect.bisect_right(LEVELS, u) - 1, len(LEVELS) - 2)
    frac = (u - LEVELS[k]) / (LEVELS[k + 1] - LEVELS[k])
    lo, hi = table[k], table[k + 1]
    if log and lo > 0 and hi > 0:
        return lo * (hi / lo) ** frac
    return lo + (hi - lo) * frac


def _turns(rng: random.Random) -> int:
    counts = [c for _, c in TURNS]
    return rng.choices([t for t, _ in TURNS], weights=counts)[0]


@dataclass(slots=True)
class MooncakeSpec(WorkloadSpec):
    kind: ClassVar[str] = "mooncake"
    help: ClassVar[str] = "synthetic trace with the statistics of Mooncake's conversation trace"
    duration_s: float = 600.0
    conversations_per_s: float = 2.08
    warmup_s: float = 3600.0
    tick_s: float = 3.0
    system_tokens: int = 512
    max_input_tokens: int = 128_000

    def build(self, seed: int, name: str | None = None) -> Workload:
        src = _Source(seed)
        system = src.tokens(self.system_tokens)
        drafts: list[_Draft] = []
        t = -self.warmup_s
        conversation = 0
        while True:
            t += src.gap(self.conversations_per_s)
            if t >= self.duration_s:
                break
            self._conversation(src, system, conversation, self._tick(t), drafts)
            conversation += 1
        drafts.sort(key=lambda d: (d.arrival, d.session, d.turn))
        reqs = [
            SimRequest(rid, d.session, "mooncake", d.prompt, d.output, d.fresh, d.arrival)
            for rid, d in enumerate(drafts)
        ]
        workload = Workload(name or self.kind, self.kind, self.params(), reqs, conversation)
        workload.stats = {
            "turn": [d.turn for d in drafts],
            "reusable": [d.reusable for d in drafts],
        }
        return workload

    def describe_trace(self, workload: Workload) -> dict[str, Any]:
        """The generated trace's statistics and the real trace's (see the module doc)."""
        measured = trace_stats(workload, self.duration_s, self.tick_s)
        return {"measured": {k: round(v, 4) for k, v in measured.items()}, "targets": TARGETS}

    def _tick(self, t: float) -> float:
        return math.floor(t / self.tick_s) * self.tick_s if self.tick_s > 0 else t

    def _conversation(
        self, src: _Source, system: list[int], session: int, start: float, out: list[_Draft]
    ) -> None:
        """Plan the turns (arrivals and lengths) first; draw their tokens only if one of
        them arrives inside the window (the warm-up's conversations mostly do not)."""
        rng = src.rng
        plan: list[_Turn] = []
        arrival = start
        for turn in range(_turns(rng)):
            if not turn:
                step = _Turn(arrival, "first", _sampler(FIRST_INPUT, rng))
            else:
                arrival = self._tick(arrival + _sampler(GAP_S, rng))
                if rng.random() < FORK_SHARE:
                    keep = _sampler(FORK_KEEP, rng, log=False)
                    step = _Turn(arrival, "fork", keep, round(_sampler(FORK_NEW, rng)))
                else:
                    step = _Turn(arrival, "extend", _sampler(GROWTH, rng, log=False))
            step.output = max(round(_sampler(OUTPUT, rng)), 1)
            plan.append(step)
        if not any(0 <= p.arrival < self.duration_s for p in plan):
            return
        prompt: list[int] = []
        output: list[int] = []
        for turn, step in enumerate(plan):
            if step.kind == "first":
                fresh = max(round(step.size), self.system_tokens + 1) - self.system_tokens
                reusable = self.system_tokens
                prompt = system + src.tokens(fresh)
            elif step.kind == "fork":
                keep = max(int(len(prompt) * step.size), self.system_tokens)
                fresh = max(step.new, 1)
                reusable = keep
                prompt = prompt[:keep] + src.tokens(fresh)
            else:
                growth = round(step.size)
                answer = output[: max(min(growth - 1, len(output)), 0)]
                fresh = max(growth - len(answer), 1)
                reusable = len(prompt)
                prompt = prompt + answer + src.tokens(fresh)
            if len(prompt) > self.max_input_tokens:
                return
            output = src.tokens(step.output)
            if 0 <= step.arrival < self.duration_s:
                reusable = reusable // TRACE_BLOCK * TRACE_BLOCK
                out.append(_Draft(step.arrival, session, turn, prompt, output, fresh, reusable))


@dataclass(slots=True)
class _Turn:
    """One planned request: when, how its prompt relates to the last one, its output."""

    arrival: float
    kind: str  # first, extend (grow by ``size`` tokens), fork (keep ``size`` of it)
    size: float
    new: int = 0  # a fork's new tokens
    output: int = 1


@dataclass(slots=True)
class _Draft:
    arrival: float
    session: int
    turn: int
    prompt: list[int]
    output: list[int]
    fresh: int
    reusable: int  # tokens an earlier prompt held, counting turns before the window


def trace_stats(workload: Workload, duration_s: float, tick_s: float) -> dict[str, float]:
    """A generated trace measured as the Mooncake trace was (see :data:`TARGETS`).

    ``reuse_ratio`` counts a prefix reusable only if an earlier request *in the trace*
    holds it (512-token blocks, unbounded cache), as the real trace's figure does."""
    reqs = workload.requests
    if not reqs or duration_s <= 0:
        return {}
    ticks = max(int(duration_s / tick_s), 1) if tick_s > 0 else 1
    per_tick = [0] * ticks
    for r in reqs:
        per_tick[min(int(r.start_s / tick_s), ticks - 1) if tick_s > 0 else 0] += 1
    mean_tick = statistics.fmean(per_tick)
    hasher = BlockHasher(HashConfig(block_size=TRACE_BLOCK))
    seen: set[int] = set()
    reused = 0
    firsts: set[int] = set()
    sessions_seen: set[int] = set()
    for r in reqs:
        keys = hasher.keys(r.prompt)
        hit = 0
        for key in keys:
            if key not in seen:
                break
            hit += 1
        reused += min(hit * TRACE_BLOCK, len(r.prompt))
        seen.update(keys)
        if r.session not in sessions_seen:
            sessions_seen.add(r.session)
            firsts.add(r.rid)
    inputs = [len(r.prompt) for r in reqs]
    outputs = [len(r.output) for r in reqs]
    continuations = sum(1 for r in reqs if r.rid not in firsts)
    turns = workload.stats.get("turn", [])
    reusable = workload.stats.get("reusable", [])

    def q(values: list[int], p: float) -> float:
        ordered = sorted(values)
        return ordered[max(math.ceil(p / 100 * len(ordered)), 1) - 1]

    return {
        "requests_per_s": len(reqs) / duration_s,
        "conversations_per_s": len(firsts) / duration_s,
        "per_tick_mean": mean_tick,
        "per_tick_var_over_mean": statistics.pvariance(per_tick) / mean_tick if mean_tick else 0,
        "continuation_share": continuations / len(reqs),
        "reuse_ratio": reused / sum(inputs),
        "stationary_conversations_per_s": sum(1 for t in turns if t == 0) / duration_s,
        "stationary_continuation_share": sum(1 for t in turns if t) / len(reqs),
        "stationary_reuse_ratio": sum(reusable) / sum(inputs),
        "input_mean": statistics.fmean(inputs),
        "input_p50": q(inputs, 50),
        "input_p90": q(inputs, 90),
        "input_p99": q(inputs, 99),
        "output_mean": statistics.fmean(outputs),
        "output_p50": q(outputs, 50),
        "output_p90": q(outputs, 90),
    }


#: Statistics measured over the stationary stream (turns before the window counted).
STATIONARY = ("conversations_per_s", "continuation_share", "reuse_ratio")


def stats_table(measured: dict[str, float]) -> list[tuple[str, str, str, str]]:
    """(statistic, generated as sent, generated counting turns before the window,
    Mooncake trace) rows for the report."""
    rows = []
    for name, target in TARGETS.items():
        fmt = ".3f" if target < 20 else ",.0f"
        value = format(measured.get(name, math.nan), fmt)
        steady = measured.get(f"stationary_{name}") if name in STATIONARY else None
        rows.append(
            (name, value, "" if steady is None else format(steady, fmt), format(target, fmt))
        )
    return rows

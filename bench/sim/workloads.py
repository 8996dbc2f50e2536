"""Traffic: who sends which prompt when, reproducible from a seed.

Four shapes, each a spec whose fields are command-line parameters (see ``__main__``):

* :class:`ChatSpec` - users hold multi-turn conversations; every turn resends the shared
  system prompt, the conversation's own context (inference-perf's "dynamic system
  prompt") and the whole history (earlier user turns and the model's answers);
* :class:`SharedPrefixSpec` - groups of prompts that share a long system prompt, each
  with its own question, arriving shuffled;
* :class:`DocQASpec` - documents each asked several questions (prompt = document +
  question);
* :class:`AgentSpec` - agent tasks: a fixed system prompt and tool definitions, then a
  history that grows by the model's tool call and the tool's result at every step.

Arrivals: independent requests (shared prefix) form a Poisson process at ``rate``
requests/s. Sessions (a conversation, a document's questions, an agent task) start as a
Poisson process at ``sessions_per_s``, and each later request of a session is sent a
think time (exponential, mean ``think_s``) after the previous answer is complete - its
prompt contains that answer. So load is set by how many sessions overlap, and a slow
cluster slows its users down as real users would be slowed; the report gives the
request rate each run achieved.

Token ids are random, so two prompts share a block only where the workload says they
share content. Chat templates' role tokens are not modelled (they are constant
per-turn overhead). Outputs are fixed by the seed: the tokens a pod "generates" are the
ones the next turn resends, as when a client returns the model's answer verbatim.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from kvindex.indexer.keys import BlockHasher


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request. ``after`` is the request whose answer this one waits for (same
    session); the first request of a session arrives at ``start_s``."""

    rid: int
    session: int
    group: str  # the reusable context: a system prompt group, a document, ...
    prompt: list[int]
    output: list[int]
    fresh_tokens: int  # new content in this prompt (question, user turn, tool result)
    start_s: float = 0.0
    after: int | None = None
    think_s: float = 0.0
    #: The ``max_tokens`` field the client sends (None: none), not the output length.
    max_tokens: int | None = None


class Tokens:
    """A request's prompt followed by its output, sliced without building the whole list
    (a long-context trace would otherwise hold every prompt twice)."""

    __slots__ = ("output", "prompt")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, span: slice) -> list[int]:
        start, stop, _ = span.indices(len(self))
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        if start >= p:
            return self.output[start - p : stop - p]
        return self.prompt[start:] + self.output[: stop - p]


@dataclass(frozen=True, slots=True)
class KeyedRequest:
    """A request with its block keys, computed once and shared by every policy's run.

    ``keys`` are the keys of every full block the request will ever cache: its prompt
    and its output except the last token (whose KV is never computed). A pod may reuse
    at most ``hit_limit`` blocks: vLLM recomputes the last prompt token to get logits,
    so a fully cached prompt still computes its last block.
    """

    request: SimRequest
    keys: list[int]
    prompt_blocks: int
    hit_limit: int
    total_blocks: int  # blocks allocated for prompt + output
    tokens: Tokens = field(default_factory=lambda: Tokens([], []))  # for BlockStored

    @property
    def prompt_keys(self) -> list[int]:
        return self.keys[: self.prompt_blocks]


@dataclass(slots=True)
class Workload:
    name: str
    kind: str
    params: dict[str, Any]
    requests: list[SimRequest]
    sessions: int
    stats: dict[str, Any] = field(default_factory=dict)  # generator facts (trace stats)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)


@dataclass(slots=True)
class PreparedWorkload:
    """A workload with its keys and reference figures.

    ``ideal_prefill_tokens``: what one pod with an unbounded cache computes, in
    generation order (every shared context once, plus everything new); the target a
    router can at best approach. ``prompt_tokens``: what no prefix cache computes.
    """

    workload: Workload
    requests: list[KeyedRequest]
    block_size: int
    ideal_prefill_tokens: int = 0
    prompt_tokens: int = 0
    by_rid: dict[int, KeyedRequest] = field(default_factory=dict)


def prepare(workload: Workload, hasher: BlockHasher) -> PreparedWorkload:
    """Hash every request once (vLLM's chain, the index's own key function)."""
    size = hasher.config.block_size
    keyed = []
    for req in workload.requests:
        plen, olen = len(req.prompt), len(req.output)
        cached_tokens = plen + max(olen - 1, 0)
        keys = hasher.keys(req.prompt + req.output[: max(olen - 1, 0)])
        keyed.append(
            KeyedRequest(
                req,
                keys[: cached_tokens // size],
                plen // size,
                (plen - 1) // size,
                math.ceil((plen + olen) / size),
                Tokens(req.prompt, req.output),
            )
        )
    prepared = PreparedWorkload(workload, keyed, size)
    prepared.by_rid = {k.request.rid: k for k in keyed}
    prepared.prompt_tokens = workload.prompt_tokens
    prepared.ideal_prefill_tokens = _ideal_prefill(keyed, size)
    return prepared


def _ideal_prefill(keyed: list[KeyedRequest], block_size: int) -> int:
    seen: set[int] = set()
    total = 0
    for k in keyed:
        hit = 0
        for key in k.keys[: k.hit_limit]:
            if key not in seen:
                break
            hit += 1
        total += len(k.request.prompt) - hit * block_size
        seen.update(k.keys)
    return total


#: What a turn is assumed to take when a workload's clock is read without running it
#: (a session's next request arrives after its think time and this).
NOMINAL_SERVICE_S = 1.0


def working_set(prepared: PreparedWorkload) -> tuple[int, float]:
    """The blocks a cache must hold to miss no reuse: (peak, mean over the arrivals).

    A prompt block is *live* from its first use to its last; at a moment, the live
    blocks are those some request used and some later request uses again. A cache
    smaller than that set must drop reusable content however it is placed. Times are
    nominal (a session's request arrives its think time plus ``NOMINAL_SERVICE_S``
    after the previous one), since the real ones depend on the run.
    """
    at: dict[int, float] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for k in prepared.requests:  # a session's requests come after the one they follow
        r = k.request
        t = r.start_s if r.after is None else at[r.after] + r.think_s + NOMINAL_SERVICE_S
        at[r.rid] = t
        for key in k.prompt_keys:
            first.setdefault(key, t)
            first[key] = min(first[key], t)
            last[key] = max(last.get(key, t), t)
    changes = sorted(
        [(first[key], 1) for key in first if last[key] > first[key]]
        + [(last[key], -1) for key in first if last[key] > first[key]]
    )
    live = peak = 0
    samples: list[int] = []
    times = sorted(at.values())
    i = 0
    for t in times:
        while i < len(changes) and changes[i][0] <= t:
            live += changes[i][1]
            i += 1
        samples.append(live)
        peak = max(peak, live)
    return peak, (sum(samples) / len(samples) if samples else 0.0)


# -- generators ---------------------------------------------------------------------


#: Token ids a workload draws from. One list of int objects shared by every prompt: a
#: prompt then costs a pointer per token, not an int object per token (long-context
#: traces hold tens of millions of tokens).
VOCAB = list(range(100, 32_000))


class _Source:
    """Seeded randomness for one workload: token content, lengths, gaps."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def tokens(self, count: int) -> list[int]:
        return self.rng.choices(VOCAB, k=count)

    def around(self, mean: int) -> int:
        """A length uniform in [mean/2, 3*mean/2] (at least 1)."""
        if mean <= 1:
            return max(mean, 1)
        return self.rng.randint(max(mean // 2, 1), mean + mean // 2)

    def gap(self, rate: float) -> float:
        return self.rng.expovariate(rate) if rate > 0 else 0.0

    def think(self, mean_s: float) -> float:
        return self.rng.expovariate(1.0 / mean_s) if mean_s > 0 else 0.0


def zipf_weights(n: int, exponent: float) -> list[float]:
    """Popularity of ``n`` items ranked 1..n: rank r drawn with weight 1 / r^exponent
    (0 = uniform)."""
    return [1.0 / (rank**exponent) for rank in range(1, n + 1)]


def bursty_starts(src: _Source, count: int, rate: float, burst: int, gap_s: float) -> list[float]:
    """``count`` arrival times at a mean ``rate``/s that come in bursts of ``burst``:
    bursts start as a Poisson process at ``rate / burst``, and a burst's arrivals follow
    each other at exponential gaps of mean ``gap_s`` (``burst`` 1: plain Poisson)."""
    out: list[float] = []
    t = 0.0
    burst = max(burst, 1)
    while len(out) < count:
        t += src.gap(rate / burst)
        at = t
        for _ in range(min(burst, count - len(out))):
            out.append(at)
            at += src.gap(1.0 / gap_s) if gap_s > 0 else 0.0
    return sorted(out)


class WorkloadSpec:
    """Base of the specs: a name, a kind, and ``build(seed)``."""

    kind: ClassVar[str]
    help: ClassVar[str]

    def build(self, seed: int, name: str | None = None) -> Workload:
        raise NotImplementedError

    def params(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    def _sessions(
        self,
        src: _Source,
        count: int,
        rate: float,
        make: Callable[[int, float, list[SimRequest]], None],
    ) -> list[SimRequest]:
        out: list[SimRequest] = []
        start = 0.0
        for session in range(count):
            start += src.gap(rate)
            make(session, start, out)
        return out


@dataclass(slots=True)
class ChatSpec(WorkloadSpec):
    kind: ClassVar[str] = "chat"
    help: ClassVar[str] = "multi-turn chat: users x turns, shared system prompt, full history"
    users: int = 120
    turns: int = 8
    system_tokens: int = 500
    context_tokens: int = 0  # per conversation, after the shared system prompt
    user_tokens: int = 150
    output_tokens: int = 250
    think_s: float = 10.0
    sessions_per_s: float = 1.0

    def build(self, seed: int, name: str | None = None) -> Workload:
        src = _Source(seed)
        system = src.tokens(self.system_tokens)
        rid = iter(range(1 << 62))

        def conversation(session: int, start: float, out: list[SimRequest]) -> None:
            context = src.tokens(src.around(self.context_tokens)) if self.context_tokens else []
            history = system + context
            prev: int | None = None
            for _ in range(self.turns):
                user = src.tokens(src.around(self.user_tokens))
                prompt = history + user
                answer = src.tokens(src.around(self.output_tokens))
                req = SimRequest(
                    rid=next(rid),
                    session=session,
                    group="chat",
                    prompt=prompt,
                    output=answer,
                    fresh_tokens=len(user),
                    start_s=start,
                    after=prev,
                    think_s=src.think(self.think_s) if prev is not None else 0.0,
                )
                out.append(req)
                prev, history = req.rid, prompt + answer

        reqs = self._sessions(src, self.users, self.sessions_per_s, conversation)
        return Workload(name or self.kind, self.kind, self.params(), reqs, self.users)


@dataclass(slots=True)
class SharedPrefixSpec(WorkloadSpec):
    """inference-perf's ``shared_prefix`` data: ``groups`` system prompts, ``prompts``
    questions each. With ``exact`` every question and answer has exactly its length, as
    inference-perf generates them (``ignore_eos``); otherwise lengths vary 0.5-1.5x.
    inference-perf builds the groups x prompts prompts once, shuffles them, and request i
    sends prompt i mod their number: ``passes`` is how many times the list is sent."""

    kind: ClassVar[str] = "shared"
    help: ClassVar[str] = "groups of prompts sharing a long system prompt, shuffled arrivals"
    groups: int = 150
    prompts: int = 5
    system_tokens: int = 6000
    question_tokens: int = 1200
    output_tokens: int = 100
    rate: float = 3.0
    passes: int = 1
    exact: bool = False

    def build(self, seed: int, name: str | None = None) -> Workload:
        src = _Source(seed)
        length = (lambda n: n) if self.exact else src.around
        systems = [src.tokens(self.system_tokens) for _ in range(self.groups)]
        order = [g for g in range(self.groups) for _ in range(self.prompts)]
        src.rng.shuffle(order)
        prompts = [
            (group, systems[group] + src.tokens(length(self.question_tokens))) for group in order
        ]
        answers = [src.tokens(length(self.output_tokens)) for _ in prompts]
        reqs = []
        t = 0.0
        for rid in range(len(prompts) * max(self.passes, 1)):
            t += src.gap(self.rate)
            i = rid % len(prompts)
            group, prompt = prompts[i]
            fresh = len(prompt) - self.system_tokens
            # inference-perf asks for exactly its output length (max_tokens with
            # ignore_eos); a client of the varying-length shape sets no cap.
            cap = len(answers[i]) if self.exact else None
            reqs.append(
                SimRequest(rid, i, f"g{group}", prompt, answers[i], fresh, t, max_tokens=cap)
            )
        return Workload(name or self.kind, self.kind, self.params(), reqs, len(prompts))


@dataclass(slots=True)
class DocQASpec(WorkloadSpec):
    kind: ClassVar[str] = "docqa"
    help: ClassVar[str] = "long-document QA: each document asked several questions in turn"
    docs: int = 60
    questions: int = 10
    doc_tokens: int = 4000
    question_tokens: int = 60
    output_tokens: int = 150
    think_s: float = 5.0
    sessions_per_s: float = 0.4

    def build(self, seed: int, name: str | None = None) -> Workload:
        src = _Source(seed)
        rid = iter(range(1 << 62))

        def document(session: int, start: float, out: list[SimRequest]) -> None:
            doc = src.tokens(self.doc_tokens)
            prev: int | None = None
            for _ in range(self.questions):
                question = src.tokens(src.around(self.question_tokens))
                req = SimRequest(
                    rid=next(rid),
                    session=session,
                    group=f"doc{session}",
                    prompt=doc + question,
                    output=src.tokens(src.around(self.output_tokens)),
                    fresh_tokens=len(question),
                    start_s=start,
                    after=prev,
                    think_s=src.think(self.think_s) if prev is not None else 0.0,
                )
                out.append(req)
                prev = req.rid

        reqs = self._sessions(src, self.docs, self.sessions_per_s, document)
        return Workload(name or self.kind, self.kind, self.params(), reqs, self.docs)


@dataclass(slots=True)
class AgentSpec(WorkloadSpec):
    kind: ClassVar[str] = "agent"
    help: ClassVar[str] = "agent loop: system prompt + tool definitions + growing history"
    tasks: int = 40
    steps: int = 20
    system_tokens: int = 1500
    tools_tokens: int = 3000
    task_tokens: int = 200
    output_tokens: int = 120
    observation_tokens: int = 400
    think_s: float = 1.0
    sessions_per_s: float = 0.2

    def build(self, seed: int, name: str | None = None) -> Workload:
        src = _Source(seed)
        preamble = src.tokens(self.system_tokens) + src.tokens(self.tools_tokens)
        rid = iter(range(1 << 62))

        def task(session: int, start: float, out: list[SimRequest]) -> None:
            fresh = src.tokens(src.around(self.task_tokens))
            history = preamble + fresh
            prev: int | None = None
            for _ in range(self.steps):
                call = src.tokens(src.around(self.output_tokens))
                req = SimRequest(
                    rid=next(rid),
                    session=session,
                    group="agent",
                    prompt=history,
                    output=call,
                    fresh_tokens=len(fresh),
                    start_s=start,
                    after=prev,
                    think_s=src.think(self.think_s) if prev is not None else 0.0,
                )
                out.append(req)
                fresh = src.tokens(src.around(self.observation_tokens))
                prev, history = req.rid, history + call + fresh

        reqs = self._sessions(src, self.tasks, self.sessions_per_s, task)
        return Workload(name or self.kind, self.kind, self.params(), reqs, self.tasks)


def spec_fields(spec: type[WorkloadSpec]) -> list[tuple[str, type, Any]]:
    """(name, type, default) of a spec's parameters, for the command line."""
    out = []
    for f in fields(spec):  # type: ignore[arg-type]
        out.append((f.name, type(f.default), f.default))
    return out


def workload_stats(spec: WorkloadSpec, workload: Workload) -> dict[str, Any]:
    """What a generator reports about what it generated (a trace: its statistics next to
    the ones it imitates); empty for the synthetic shapes."""
    describe = getattr(spec, "describe_trace", None)
    return describe(workload) if describe is not None else {}

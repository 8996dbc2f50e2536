"""The standard comparison: which workloads on which clusters.

Every policy runs on every scenario, precise through a real kvindex; the whole
comparison takes a few minutes on two cores. The shared-prefix scenarios have the
issue's sizes; chat, document QA and agent populations are chosen so a run has
thousands of requests, not tens of thousands. Load is *moderate*: round-robin's pods
are busy (prefill 20-40% of the time, KV cache full) but no policy's queues collapse,
so differences in TTFT come from cache hits, not from overload.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from bench.sim.cluster import ClusterSpec
from bench.sim.workloads import AgentSpec, ChatSpec, DocQASpec, SharedPrefixSpec, WorkloadSpec

#: Blocks per pod when the cache is not the point: 16,384 blocks of 16 tokens = 262k
#: tokens, what an 8B model leaves free on an 80 GB GPU (~128 KiB of KV per token).
ROOMY = 16_384


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    spec: WorkloadSpec
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    about: str = ""
    #: Policies run on this scenario besides the standard ones.
    extra_policies: tuple[str, ...] = ()


def standard() -> list[Scenario]:
    chat = ChatSpec(
        users=600,
        turns=8,
        system_tokens=200,
        user_tokens=150,
        output_tokens=300,
        think_s=15.0,
        sessions_per_s=1.5,
    )
    return [
        Scenario(
            "chat",
            chat,
            ClusterSpec(pods=4, blocks_per_pod=8_192),
            "600 users x 8 turns, 200-token shared system prompt, ~150-token user turns, "
            "~300-token answers, 15 s think time, 1.5 new conversations/s (~250 in "
            "flight); 4 pods of 8,192 blocks (131k tokens): the conversations in flight "
            "fit the cluster once, not once per pod",
        ),
        Scenario(
            "chat-evict",
            chat,
            ClusterSpec(pods=4, blocks_per_pod=4_096),
            "the same chat traffic on pods half that size (4,096 blocks): eviction "
            "pressure for every policy",
            extra_policies=("approximate:1", "approximate:2"),
        ),
        Scenario(
            "shared-150x5",
            SharedPrefixSpec(
                groups=150,
                prompts=5,
                system_tokens=6000,
                question_tokens=1200,
                output_tokens=100,
                rate=2.5,
            ),
            ClusterSpec(pods=4, blocks_per_pod=ROOMY),
            "150 groups x 5 prompts, 6,000-token system prompt + ~1,200-token question, "
            "2.5 requests/s (the issue's size); the system prompts alone are 86% of the "
            "cluster's blocks",
        ),
        Scenario(
            "shared-6x1000",
            SharedPrefixSpec(
                groups=6,
                prompts=1000,
                system_tokens=1000,
                question_tokens=60,
                output_tokens=100,
                rate=16.0,
            ),
            ClusterSpec(pods=4, blocks_per_pod=ROOMY),
            "6 groups x 1,000 prompts, 1,000-token system prompt, ~60-token questions, "
            "16 requests/s (the issue's size): every pod can hold every group, so "
            "balance decides",
        ),
        Scenario(
            "docqa",
            DocQASpec(
                docs=60,
                questions=10,
                doc_tokens=4000,
                question_tokens=60,
                output_tokens=150,
                think_s=5.0,
                sessions_per_s=0.4,
            ),
            ClusterSpec(pods=4, blocks_per_pod=ROOMY),
            "60 documents of 4,000 tokens, each asked 10 ~60-token questions in turn "
            "(5 s think time, a new document every 2.5 s)",
        ),
        Scenario(
            "agent",
            AgentSpec(tasks=40, steps=20, sessions_per_s=0.2),
            ClusterSpec(pods=4, blocks_per_pod=ROOMY),
            "40 tasks x 20 steps: 1,500-token system prompt + 3,000 tokens of tool "
            "definitions shared by all tasks, then ~120-token tool calls and ~400-token "
            "tool results (1 s tool latency)",
        ),
    ]


def load_study() -> list[Scenario]:
    """The scenarios swept from light load to past saturation (load factor 1 is about
    where round-robin's TTFT p90 leaves the SLO on the default engine model), each small
    enough that a run through kvindex takes seconds."""
    return [
        Scenario(
            "chat-load",
            ChatSpec(
                users=300,
                turns=4,
                system_tokens=200,
                user_tokens=150,
                output_tokens=300,
                think_s=3.0,
                sessions_per_s=5.0,
            ),
            ClusterSpec(pods=4, blocks_per_pod=8_192),
            "300 users x 4 turns, 200-token system prompt, ~150-token turns, ~300-token "
            "answers, 3 s think time, 5 new conversations/s; 4 pods x 8,192 blocks",
        ),
        Scenario(
            "shared-load",
            SharedPrefixSpec(
                groups=60,
                prompts=5,
                system_tokens=6000,
                question_tokens=1200,
                output_tokens=100,
                rate=2.5,
            ),
            ClusterSpec(pods=4, blocks_per_pod=ROOMY),
            "inference-perf's shared-prefix shape (6,000-token system prompts, ~1,200-token "
            "questions, 100-token answers), 60 groups x 5 prompts at 2.5 requests/s",
        ),
        Scenario(
            "agent-load",
            AgentSpec(tasks=80, steps=10, think_s=1.0, sessions_per_s=2.0),
            ClusterSpec(pods=4, blocks_per_pod=ROOMY),
            "80 agent tasks x 10 steps, 4,500-token shared preamble, ~120-token tool calls, "
            "~400-token tool results, 1 s tool latency, 2 new tasks/s",
        ),
    ]


def by_name(names: list[str] | None = None) -> list[Scenario]:
    scenarios = standard()
    if not names:
        return scenarios
    known = {s.name: s for s in [*scenarios, *load_study()]}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in names]


def scaled(scenario: Scenario, factor: float) -> Scenario:
    """The scenario with its population (users, groups, documents, tasks) scaled."""
    if factor == 1.0:
        return scenario
    spec = scenario.spec

    def n(value: int) -> int:
        return max(1, round(value * factor))

    if isinstance(spec, ChatSpec):
        spec = replace(spec, users=n(spec.users))
    elif isinstance(spec, DocQASpec):
        spec = replace(spec, docs=n(spec.docs))
    elif isinstance(spec, AgentSpec):
        spec = replace(spec, tasks=n(spec.tasks))
    elif isinstance(spec, SharedPrefixSpec):
        if spec.groups >= spec.prompts:
            spec = replace(spec, groups=n(spec.groups))
        else:
            spec = replace(spec, prompts=n(spec.prompts))
    return replace(scenario, spec=spec)


def loaded(scenario: Scenario, factor: float) -> Scenario:
    """The scenario with its offered load multiplied by ``factor``.

    Open-loop traffic (shared prefix): the arrival rate x factor. Sessions (chat, document
    QA, agent tasks): factor x as many, starting factor x as often, each behaving as
    before (same turns, same think time) - more users, the usual meaning of offered
    load. Sessions are closed loops (a turn waits for the previous answer), so past
    saturation they slow down with the cluster, as real users do.
    """
    if factor == 1.0:
        return scenario
    if factor <= 0:
        raise ValueError(f"load factor must be > 0, got {factor}")
    spec = scenario.spec

    def more(n: int) -> int:
        return max(1, round(n * factor))

    if isinstance(spec, SharedPrefixSpec):
        spec = replace(spec, rate=spec.rate * factor)
    elif isinstance(spec, AgentSpec):
        spec = replace(spec, tasks=more(spec.tasks), sessions_per_s=spec.sessions_per_s * factor)
    elif isinstance(spec, ChatSpec):
        spec = replace(spec, users=more(spec.users), sessions_per_s=spec.sessions_per_s * factor)
    elif isinstance(spec, DocQASpec):
        spec = replace(spec, docs=more(spec.docs), sessions_per_s=spec.sessions_per_s * factor)
    return replace(scenario, spec=spec)

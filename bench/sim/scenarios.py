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

from bench.sim.catalog import CatalogSpec
from bench.sim.cluster import ClusterSpec
from bench.sim.mooncake import MooncakeSpec
from bench.sim.tenants import TenantChatSpec
from bench.sim.workloads import AgentSpec, ChatSpec, DocQASpec, SharedPrefixSpec, WorkloadSpec

SPECS: dict[str, type[WorkloadSpec]] = {
    spec.kind: spec
    for spec in (
        ChatSpec,
        SharedPrefixSpec,
        DocQASpec,
        AgentSpec,
        MooncakeSpec,
        TenantChatSpec,
        CatalogSpec,
    )
}

#: llm-d's precise-prefix benchmark cluster: 8 pods of 307,328 KV tokens (Qwen3-32B).
LLMD_BLOCKS = 307_328 // 16

#: ip-llmd-6k's request rate: where its decode-heavy load (1,000-token answers) keeps
#: this engine model's 8 pods busy without saturating them.
LLMD_RATE = 6.0

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
    #: "eviction": its working set is more than one pod's cache (the eviction study).
    regime: str = ""


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
            "ip-example",
            SharedPrefixSpec(
                groups=10,
                prompts=10,
                system_tokens=100,
                question_tokens=50,
                output_tokens=50,
                rate=2.0,
                exact=True,
            ),
            ClusterSpec(pods=4, blocks_per_pod=ROOMY),
            "inference-perf's own shared_prefix example (examples/vllm/config-shared-"
            "prefix.yml): 10 system prompts x 10 questions, 100 + 50 tokens, 50-token "
            "answers, at its second stage's 2 requests/s; light load, everything fits",
        ),
        Scenario(
            "ip-llmd-6k",
            SharedPrefixSpec(
                groups=150,
                prompts=5,
                system_tokens=6000,
                question_tokens=1200,
                output_tokens=1000,
                rate=LLMD_RATE,
                passes=2,
                exact=True,
            ),
            ClusterSpec(pods=8, blocks_per_pod=LLMD_BLOCKS),
            "inference-perf shared_prefix at the size of llm-d's precise-prefix benchmark "
            "(150 groups x 5, 6,000-token system prompts, 1,200-token questions, "
            "1,000-token answers, 8 pods x 307,328 KV tokens): the 750 prompts sent twice "
            f"(its warm-up pass, then the same prompts again) at {LLMD_RATE:g} requests/s",
        ),
        Scenario(
            "mooncake",
            MooncakeSpec(),
            ClusterSpec(pods=8, blocks_per_pod=LLMD_BLOCKS),
            "a synthetic trace with the statistics of Mooncake's FAST'25 conversation "
            "trace (sim/mooncake.py): 10 minutes at the trace's 3.4 requests/s, 12k-token "
            "mean prompts, 2-minute gaps between turns, 3 s arrival ticks; on ip-llmd-6k's "
            "8 pods (4 pods cannot keep up with the trace's ~40k prefill tokens/s)",
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
    """The scenarios swept from light load to past saturation. Their base load (factor 1)
    is set so that least-loaded's knee falls between x1 and x2 on the default engine
    model, and each session population spans at least twice a session's lifetime even
    at ``--scale 0.25``, so the cluster reaches its steady load (a shorter burst of
    users would never overlap enough to saturate it)."""
    return [
        Scenario(
            "chat-load",
            ChatSpec(
                users=700,
                turns=4,
                system_tokens=1000,
                context_tokens=4000,
                user_tokens=50,
                output_tokens=300,
                think_s=3.0,
                sessions_per_s=2.0,
            ),
            ClusterSpec(pods=4, blocks_per_pod=ROOMY),
            "inference-perf's interactive-chat shape (workload-catalog/interactive-chat: a "
            "1,000-token shared system prompt, a ~4,000-token system prompt of the "
            "conversation's own, ~50-token turns, ~300-token answers, 4 turns), 3 s think "
            "time, 700 users at 2 new conversations/s; 4 pods x 16,384 blocks",
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
            AgentSpec(
                tasks=150,
                steps=6,
                task_tokens=4000,
                output_tokens=150,
                observation_tokens=1500,
                think_s=1.0,
                sessions_per_s=0.45,
            ),
            ClusterSpec(pods=4, blocks_per_pod=ROOMY),
            "150 coding-agent tasks x 6 steps: a 4,500-token shared preamble (system prompt "
            "+ tools), ~4,000 tokens of task context, ~150-token tool calls, ~1,500-token "
            "tool results (inference-perf's code-generation catalog has 1,500-token turns), "
            "1 s tool latency, 0.45 new tasks/s",
        ),
    ]


#: The eviction study's pods: 4,096 blocks of 16 tokens (65k tokens, e.g. a 70B model
#: on one 80 GB GPU). Small pods keep the working sets small enough to simulate fast.
EVICTION_POD = ClusterSpec(pods=4, blocks_per_pod=4_096)


def eviction_study() -> list[Scenario]:
    """Scenarios whose working set (:func:`bench.sim.workloads.working_set`, the blocks
    live between their first and last use) is 1.5-3x one pod's cache and fits the
    cluster's 4 pods: a router that spreads every prefix over every pod thrashes, one
    that partitions them can keep them. Each is swept from light load to past the
    cache-oblivious knee; ``python -m bench.sim --study eviction --list`` computes
    their working sets. Base loads (factor 1) put least-loaded's TTFT p90 past the SLO
    just below x1 (``--knee-check`` crossings at the previous bases, x1.03-x1.28 with
    every rate 0.73-0.79x these, moved < 10% between 1x and 2x the run length), so the
    swept grid's knee is x1 and 2x the knee is swept."""
    tenants = TenantChatSpec(
        tenants=40,
        zipf=0.8,
        system_tokens=3000,
        users=720,
        turns=4,
        user_tokens=100,
        output_tokens=150,
        think_s=5.0,
        sessions_per_s=2.9,
    )
    return [
        Scenario(
            "tenants",
            tenants,
            EVICTION_POD,
            "40 tenants (Zipf 0.8) with 3,000-token system prompts, 720 users x 4 turns "
            "(~100-token turns, ~150-token answers, 5 s think time) at 2.9 new "
            "conversations/s, with session ids; working set ~2x one pod's cache",
            regime="eviction",
        ),
        Scenario(
            "tenants-anon-forks",
            replace(tenants, session_ids=False, fork_p=0.3, burst=4, users=700, sessions_per_s=2.2),
            EVICTION_POD,
            "the tenants traffic with no session ids (the client sends none), 30% of "
            "conversations forking an earlier conversation of their tenant at one of its "
            "turns, 700 conversations starting 4 at a time, 2.2 a second; working set "
            "~2.5x one pod's cache (forks keep more histories live)",
            regime="eviction",
        ),
        Scenario(
            "catalog-burst",
            CatalogSpec(
                items=112,
                item_tokens=1500,
                zipf=1.1,
                question_tokens=200,
                output_tokens=100,
                requests=2400,
                rate=28.0,
                burst=8,
            ),
            EVICTION_POD,
            "112 shared 1,500-token system prompts by Zipf 1.1 popularity, ~200-token "
            "questions, 100-token answers, 28 requests/s arriving in bursts of 8; working "
            "set ~2x one pod's cache",
            regime="eviction",
        ),
        Scenario(
            "docqa-library",
            CatalogSpec(
                items=40,
                item_tokens=4000,
                zipf=0.6,
                question_tokens=60,
                output_tokens=150,
                requests=2400,
                rate=8.7,
            ),
            EVICTION_POD,
            "document QA over 40 documents of 4,000 tokens (2.4x the documents one pod "
            "holds), Zipf 0.6 popularity, ~60-token questions, ~150-token answers, 8.7 "
            "requests/s; working set ~2.4x one pod's cache",
            regime="eviction",
        ),
    ]


def by_name(names: list[str] | None = None) -> list[Scenario]:
    scenarios = standard()
    if not names:
        return scenarios
    known = {s.name: s for s in [*scenarios, *load_study(), *eviction_study()]}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in names]


def scaled(scenario: Scenario, factor: float) -> Scenario:
    """The scenario with its population (users, groups, documents, tasks; a trace's
    duration) scaled."""
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
    elif isinstance(spec, MooncakeSpec):
        spec = replace(spec, duration_s=spec.duration_s * factor)
    elif isinstance(spec, TenantChatSpec):
        spec = replace(spec, users=n(spec.users))
    elif isinstance(spec, CatalogSpec):
        spec = replace(spec, requests=n(spec.requests))
    return replace(scenario, spec=spec)


def loaded(scenario: Scenario, factor: float) -> Scenario:
    """The scenario with its offered load multiplied by ``factor``.

    Open-loop traffic (shared prefix, the Mooncake-like trace): the arrival rate (of
    requests, of conversations) x factor. Sessions (chat, document
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
    elif isinstance(spec, MooncakeSpec):
        spec = replace(spec, conversations_per_s=spec.conversations_per_s * factor)
    elif isinstance(spec, TenantChatSpec):
        spec = replace(spec, users=more(spec.users), sessions_per_s=spec.sessions_per_s * factor)
    elif isinstance(spec, CatalogSpec):
        # As many requests, sent faster: the same catalog, the same run's worth of reuse.
        spec = replace(spec, rate=spec.rate * factor)
    return replace(scenario, spec=spec)

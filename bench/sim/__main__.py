"""``python -m bench.sim``: the standard routing comparison (or any part of it).

    python -m bench.sim                          # every scenario x every policy
    python -m bench.sim --scenarios chat,docqa   # some scenarios
    python -m bench.sim --scale 0.25             # a quarter of the population, quicker
    python -m bench.sim --chat-users 100 --chat-turns 12 --blocks-per-pod 4096
    python -m bench.sim --list                   # scenarios and their parameters

Every workload parameter is a flag ``--<kind>-<field>`` (kinds: chat, shared, docqa,
agent) that applies to every scenario of that kind; cluster and cost flags apply to
every scenario. Results go to the terminal and to ``--out`` (routing.md, routing.json,
routing.png). Precise runs start their own ``kvindex serve`` on free loopback ports.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.sim.claims import evaluate
from bench.sim.cluster import ClusterSpec
from bench.sim.costs import CostModel
from bench.sim.policies import POLICY_NAMES, PickRule, parse_policy
from bench.sim.progress import progress
from bench.sim.report import ScenarioRuns, table, write
from bench.sim.runner import RunSpec, run
from bench.sim.scenarios import Scenario, by_name, scaled, standard
from bench.sim.workloads import SPECS, DocQASpec, WorkloadSpec, prepare, spec_fields
from kvindex.indexer.keys import BlockHasher, HashConfig

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "out"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.sim",
        description="Compare routing policies on a simulated vLLM cluster; precise routing "
        "goes through a real kvindex.",
    )
    parser.add_argument("--scenarios", help="comma-separated (default: all; see --list)")
    parser.add_argument(
        "--policies",
        default=",".join(POLICY_NAMES),
        help="comma-separated; approximate:R sizes its LRU at R x the pod (default: all)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="population factor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--no-png", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--list", action="store_true", help="show the scenarios and exit")
    cluster = parser.add_argument_group("cluster and cost model (every scenario)")
    cluster.add_argument("--pods", type=int)
    cluster.add_argument("--blocks-per-pod", type=int)
    cluster.add_argument("--block-size", type=int, default=16)
    cluster.add_argument("--prefill-tps", type=float, help="prefill tokens/s (10000)")
    cluster.add_argument("--decode-ms", type=float, help="ms per output token (20)")
    cluster.add_argument("--batch-limit", type=int, help="max running requests per pod (256)")
    cluster.add_argument("--max-waiting", type=int, help="queue bound per pod (256)")
    routing = parser.add_argument_group("routing")
    routing.add_argument(
        "--load-tokens",
        type=int,
        default=PickRule().load_tokens,
        help="cache-aware policies price each request already on a pod at this many "
        "prefill tokens (default %(default)s)",
    )
    routing.add_argument(
        "--overload-margin",
        type=int,
        default=PickRule().margin,
        help="cache-aware policies skip a pod running more than this many requests ahead "
        "of the least loaded one (default %(default)s)",
    )
    routing.add_argument(
        "--approx-ratio",
        type=float,
        default=0.5,
        help="approximate's LRU size as a fraction of a pod's blocks (default %(default)s)",
    )
    routing.add_argument("--vllm-version", default="0.33", help="event wire layout")
    routing.add_argument(
        "--max-probes",
        type=int,
        default=2000,
        help="agreement check: most cached chains probed per precise run (default "
        "%(default)s; 0 = all)",
    )
    for kind, spec in SPECS.items():
        group = parser.add_argument_group(f"{kind} workload ({spec.help})")
        for name, kind_type, default in spec_fields(spec):
            group.add_argument(
                f"--{kind}-{name.replace('_', '-')}",
                dest=f"{kind}__{name}",
                type=kind_type,
                metavar=kind_type.__name__.upper(),
                help=f"default {default} (scenarios may set their own)",
            )
    return parser


def configure(args: argparse.Namespace) -> list[Scenario]:
    """The chosen scenarios with every command-line override applied."""
    names = args.scenarios.split(",") if args.scenarios else None
    scenarios = []
    for scenario in by_name(names):
        scenario = scaled(scenario, args.scale)
        overrides = {
            name: value
            for name, _, _ in spec_fields(type(scenario.spec))
            if (value := getattr(args, f"{scenario.spec.kind}__{name}")) is not None
        }
        spec: WorkloadSpec = replace(scenario.spec, **overrides)  # type: ignore[type-var]
        scenarios.append(replace(scenario, spec=spec, cluster=_cluster(scenario.cluster, args)))
    return scenarios


def _cluster(base: ClusterSpec, args: argparse.Namespace) -> ClusterSpec:
    costs = base.costs
    costs = CostModel(
        prefill_tokens_per_s=args.prefill_tps or costs.prefill_tokens_per_s,
        decode_s_per_token=(
            args.decode_ms / 1000 if args.decode_ms is not None else costs.decode_s_per_token
        ),
        batch_limit=args.batch_limit or costs.batch_limit,
        max_waiting=args.max_waiting if args.max_waiting is not None else costs.max_waiting,
    )
    return replace(
        base,
        pods=args.pods or base.pods,
        blocks_per_pod=args.blocks_per_pod or base.blocks_per_pod,
        block_size=args.block_size,
        costs=costs,
    )


def list_scenarios() -> str:
    lines = []
    for s in standard():
        params = ", ".join(f"{k}={v}" for k, v in s.spec.params().items())
        lines.append(f"{s.name} ({s.spec.kind}): {s.about}\n    {params}")
        lines.append(f"    {s.cluster.pods} pods x {s.cluster.blocks_per_pod} blocks")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.list:
        print(list_scenarios())
        return 0
    try:
        scenarios = configure(args)
        policies = [p for p in args.policies.split(",") if p]
        for policy in policies:
            parse_policy(policy)
    except ValueError as exc:
        print(f"bench.sim: {exc}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    hasher = BlockHasher(HashConfig(block_size=args.block_size))
    prepared = []
    for scenario in scenarios:
        workload = scenario.spec.build(args.seed, scenario.name)
        prepared.append(prepare(workload, hasher))
    plan = [
        (i, policy)
        for i, scenario in enumerate(scenarios)
        for policy in [*policies, *(p for p in scenario.extra_policies if p not in policies)]
    ]
    bar = progress(sum(len(prepared[i].requests) for i, _ in plan), enabled=not args.no_progress)
    results = [
        ScenarioRuns(s, [], len(p.requests), p.ideal_prefill_tokens)
        for s, p in zip(scenarios, prepared, strict=True)
    ]
    try:
        for i, policy in plan:
            scenario = scenarios[i]
            bar.describe(f"{scenario.name} / {policy}")
            spec = RunSpec(
                scenario.name,
                policy,
                scenario.cluster,
                seed=args.seed,
                rule=PickRule(load_tokens=args.load_tokens, margin=args.overload_margin),
                approx_ratio=args.approx_ratio,
                vllm_version=args.vllm_version,
                max_probes=args.max_probes or None,
            )
            results[i].runs.append(run(prepared[i], spec, bar))
    finally:
        bar.close()
    runs = {(r.scenario, r.policy): r for s in results for r in s.runs}
    doc_tokens = {s.name: s.spec.doc_tokens for s in scenarios if isinstance(s.spec, DocQASpec)}
    claims = evaluate(runs, doc_tokens)
    meta = _meta(args, argv, time.perf_counter() - started)
    print(table(results))
    print("\n".join(c.line() for c in claims))
    for path in write(args.out, results, claims, meta, png=not args.no_png):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _meta(args: argparse.Namespace, argv: list[str] | None, wall_s: float) -> dict[str, Any]:
    words = sys.argv[1:] if argv is None else argv
    costs = _cluster(ClusterSpec(), args).costs
    return {
        "command": shlex.join(["python", "-m", "bench.sim", *words]),
        "seed": args.seed,
        "scale": args.scale,
        "block_size": args.block_size,
        "costs": {
            "prefill_tokens_per_s": costs.prefill_tokens_per_s,
            "decode_s_per_token": costs.decode_s_per_token,
            "batch_limit": costs.batch_limit,
            "max_waiting": costs.max_waiting,
        },
        "load_tokens": args.load_tokens,
        "overload_margin": args.overload_margin,
        "approx_ratio": args.approx_ratio,
        "vllm_version": args.vllm_version,
        "wall_s": round(wall_s, 1),
    }


if __name__ == "__main__":
    sys.exit(main())

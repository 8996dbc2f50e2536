"""``python -m bench.sim``: routing policies on a simulated vLLM cluster, under load.

    python -m bench.sim                          # the whole comparison (see bench/README.md)
    python -m bench.sim --quick                  # a small version of everything (minutes)
    python -m bench.sim --scenarios chat,docqa --sweep none   # some standard scenarios
    python -m bench.sim --loads 0.5,1,2 --seeds 3 # the load sweep with CIs
    python -m bench.sim --list                   # scenarios and their parameters
    python -m bench.sim --study eviction --seeds 3   # working sets past one pod's cache
    python -m bench.sim --study eviction --knee-check  # is the run long enough?

Four studies (``bench.sim.plan``): the standard table, the load sweep, the gateway
replica study and the fault study. ``--study eviction`` runs instead the eviction study:
the :func:`~bench.sim.scenarios.eviction_study` scenarios swept past the knee, and a
fault study on its first scenario. Every workload parameter is a flag
``--<kind>-<field>`` (kinds: chat, shared, docqa, agent, mooncake, tenants, catalog) that
applies to every scenario of that kind. Results go to the terminal and to ``--out``
(routing.md, routing.json, PNGs). Runs through kvindex share one ``kvindex serve`` on
free loopback ports, each run with its own pod ids.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.sim.claims import evaluate
from bench.sim.cluster import ClusterSpec
from bench.sim.costs import CostModel
from bench.sim.faults import FaultSpec
from bench.sim.knee import knee_check
from bench.sim.lag import LagModel
from bench.sim.metrics import DEFAULT_SCRAPE_S
from bench.sim.plan import Cell, PlanSpec, cells
from bench.sim.policies import POLICY_NAMES, PickRule, parse_policy, uses_index
from bench.sim.progress import progress
from bench.sim.report import write
from bench.sim.results import RunResult, Slo
from bench.sim.runner import RunSpec, run
from bench.sim.scenarios import (
    SPECS,
    Scenario,
    by_name,
    eviction_study,
    load_study,
    loaded,
    scaled,
    standard,
)
from bench.sim.service import KvindexProcess
from bench.sim.workloads import (
    PreparedWorkload,
    WorkloadSpec,
    prepare,
    spec_fields,
    working_set,
    workload_stats,
)
from kvindex.indexer.keys import BlockHasher, HashConfig
from kvindex.scoring.route.cost import CostWeights

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "out"
DEFAULT_LOADS = "0.25,0.5,0.75,1,1.25,1.5,2,3"
DEFAULT_POLICIES = ",".join(POLICY_NAMES)
DEFAULT_FAULTS = "restarts:4,resets:4,direct:0.2"
#: --quick's and the eviction study's fault study: kvindex, and the two its hit-ratio
#: loss is read next to (claim 3 judges it against greedy-perfect's).
FAULT_STUDY_POLICIES = ("approximate", "greedy-perfect", "kvindex-route")
#: The eviction study's loads (x its scenarios' base load, near least-loaded's knee):
#: from light load to past 2x the knee.
EVICTION_LOADS = "0.25,0.5,1,1.5,2"
EVICTION_FAULTS = "restarts:4,direct:0.2"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.sim",
        description="Compare routing policies on a simulated vLLM cluster under load; "
        "kvindex policies go through a real kvindex serve.",
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of the study")
    p.add_argument(
        "--study",
        choices=("standard", "eviction"),
        default="standard",
        help="standard: the standard table, load sweep, replica and fault studies; "
        "eviction: working sets past one pod's cache, swept past the knee, and faults",
    )
    p.add_argument(
        "--knee-check",
        action="store_true",
        help="only find the sweep scenarios' cache-oblivious knees at --scale and twice "
        "it (is the run long enough for a stable knee?)",
    )
    p.add_argument("--scenarios", help="standard table scenarios (default: all; 'none')")
    p.add_argument("--sweep", help="load-sweep scenarios (default: all load studies; 'none')")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated")
    p.add_argument("--loads", default=DEFAULT_LOADS, help="sweep load factors")
    p.add_argument("--seeds", type=int, default=1, help="seeds per sweep point (CIs from 2)")
    p.add_argument("--replicas", type=int, default=2, help="gateway replicas in the sweep")
    p.add_argument("--replica-counts", default="1,2,4", help="replica study ('' = skip)")
    p.add_argument("--study-scenario", default="chat-load", help="replica and fault studies")
    p.add_argument("--study-load", type=float, default=1.0)
    p.add_argument(
        "--faults", default=DEFAULT_FAULTS, help="fault study: restarts:N,resets:N,direct:F"
    )
    p.add_argument("--scale", type=float, default=1.0, help="population factor")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--list", action="store_true", help="show the scenarios and exit")
    c = p.add_argument_group("cluster and engine model (every scenario; see sim/costs.py)")
    c.add_argument("--pods", type=int)
    c.add_argument("--blocks-per-pod", type=int)
    c.add_argument("--block-size", type=int, default=16)
    base = CostModel()
    c.add_argument("--max-batched-tokens", type=int, default=base.max_num_batched_tokens)
    c.add_argument("--max-seqs", type=int, default=base.max_num_seqs)
    c.add_argument("--max-waiting", type=int, default=base.max_waiting)
    c.add_argument("--step-overhead-ms", type=float, default=base.overhead_s * 1e3)
    c.add_argument("--token-us", type=float, default=base.token_s * 1e6)
    c.add_argument("--kv-token-ns", type=float, default=base.kv_token_s * 1e9)
    c.add_argument("--lag-ms", type=float, default=LagModel().median_ms, help="median lag")
    c.add_argument("--lag-sigma", type=float, default=LagModel().sigma)
    c.add_argument("--slo-ttft", type=float, default=Slo().ttft_s, help="seconds")
    c.add_argument("--slo-itl", type=float, default=Slo().itl_s, help="seconds")
    r = p.add_argument_group("routing")
    r.add_argument("--load-tokens", type=int, default=PickRule().load_tokens)
    r.add_argument("--overload-margin", type=int, default=PickRule().margin)
    r.add_argument("--approx-ratio", type=float, default=1.0, help="LRU size / pod blocks")
    r.add_argument("--vllm-version", default="0.33", help="event wire layout")
    r.add_argument(
        "--scrape-ms",
        type=float,
        default=DEFAULT_SCRAPE_S * 1e3,
        help="virtual ms between scrapes of pod load, for every policy (llm-d's default)",
    )
    r.add_argument(
        "--route-weights",
        type=_weights,
        help="kvindex-route's cost weights, e.g. prefix=1,queue=1,decode=0,kv=1 "
        "(default: kvindex's)",
    )
    r.add_argument(
        "--route-max-tokens",
        choices=("client", "true"),
        default="client",
        help="kvindex-route's max_tokens: the client's own field (none, or inference-perf's "
        "fixed cap) or the true output length, which no gateway knows",
    )
    r.add_argument("--max-probes", type=int, default=500, help="agreement probes (0 = all)")
    for kind, spec in SPECS.items():
        group = p.add_argument_group(f"{kind} workload ({spec.help})")
        for name, kind_type, default in spec_fields(spec):
            group.add_argument(
                f"--{kind}-{name.replace('_', '-')}",
                dest=f"{kind}__{name}",
                type=_yes_no if kind_type is bool else kind_type,
                metavar=kind_type.__name__.upper(),
                help=f"default {default} (scenarios may set their own)",
            )
    return p


def _weights(text: str) -> dict[str, float]:
    try:
        pairs = [item.split("=", 1) for item in text.split(",") if item]
        weights = {name.strip(): float(value) for name, value in pairs}
        CostWeights(**weights)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"bad weights {text!r}: {exc}") from None
    return weights


def _yes_no(text: str) -> bool:
    if text.lower() in ("1", "yes", "true", "on"):
        return True
    if text.lower() in ("0", "no", "false", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected yes or no, got {text!r}")


def _names(text: str | None, default: list[Scenario]) -> list[str]:
    if text is None:
        return [s.name for s in default]
    return [] if text in ("", "none") else text.split(",")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_faults(text: str) -> list[FaultSpec]:
    out = []
    for item in filter(None, text.split(",")):
        kind, _, value = item.partition(":")
        if kind not in ("restarts", "resets", "direct") or not value:
            raise ValueError(f"bad fault {item!r}: use restarts:N, resets:N or direct:F")
        number = float(value) if kind == "direct" else int(value)
        out.append(FaultSpec(**{kind: number}))  # type: ignore[arg-type]
    return out


def plan_spec(args: argparse.Namespace) -> PlanSpec:
    policies = [p for p in args.policies.split(",") if p]
    for policy in policies:
        parse_policy(policy)
    if args.study == "eviction":
        return _eviction_plan(args, policies)
    if args.quick:  # every policy, on small populations
        return PlanSpec(
            standard=_names(args.scenarios, [s for s in standard() if s.name == "docqa"]),
            sweep=_names(args.sweep, load_study()),
            policies=policies,
            loads=[0.25, 1.5] if args.loads == DEFAULT_LOADS else _floats(args.loads),
            seeds=args.seeds,
            sweep_replicas=args.replicas,
            replica_counts=[2],  # the same runs as the fault study's fault-free ones
            study_scenario=args.study_scenario,
            study_load=args.study_load / 2,
            study_policies=[p for p in policies if p in FAULT_STUDY_POLICIES] or policies,
            faults=parse_faults("restarts:2,direct:0.2"),
        )
    counts = [int(x) for x in args.replica_counts.split(",") if x]
    return PlanSpec(
        standard=_names(args.scenarios, standard()),
        sweep=_names(args.sweep, load_study()),
        policies=policies,
        loads=_floats(args.loads),
        seeds=args.seeds,
        sweep_replicas=args.replicas,
        replica_counts=counts,
        study_scenario=args.study_scenario,
        study_load=args.study_load,
        faults=parse_faults(args.faults),
    )


def _eviction_plan(args: argparse.Namespace, policies: list[str]) -> PlanSpec:
    """The eviction study: its scenarios swept from light load to past 2x the knee, and
    the fault study on its first scenario at half its base load (below the knee, so the
    faults, not the queues, move the hit ratio). ``--quick``: fewer loads, smaller
    populations (``_scale``)."""
    sweep = _names(args.sweep, eviction_study())
    default_loads = "0.5,2" if args.quick else EVICTION_LOADS
    faults = args.faults if args.faults != DEFAULT_FAULTS else EVICTION_FAULTS
    return PlanSpec(
        standard=_names(args.scenarios, []),
        sweep=sweep,
        policies=policies,
        loads=_floats(default_loads if args.loads == DEFAULT_LOADS else args.loads),
        seeds=args.seeds,
        sweep_replicas=args.replicas,
        replica_counts=[],
        study_scenario=sweep[0] if sweep else "",
        study_load=0.5,
        study_policies=[p for p in policies if p in FAULT_STUDY_POLICIES] or policies,
        faults=parse_faults(faults),
    )


def scenario_for(cell: Cell, args: argparse.Namespace) -> Scenario:
    (scenario,) = by_name([cell.scenario])
    overrides = {
        name: value
        for name, _, _ in spec_fields(type(scenario.spec))
        if (value := getattr(args, f"{scenario.spec.kind}__{name}")) is not None
    }
    # Flags set the base workload; the scale and the load factor apply on top of them.
    spec: WorkloadSpec = replace(scenario.spec, **overrides)  # type: ignore[type-var]
    scenario = replace(scenario, spec=spec, cluster=_cluster(scenario.cluster, args))
    return loaded(scaled(scenario, _scale(args)), cell.load)


def _scale(args: argparse.Namespace) -> float:
    if not args.quick:
        return args.scale
    # The eviction study's working sets are its point: a quick run keeps more of them.
    return args.scale * (0.15 if args.study == "eviction" else 0.1)


def _cluster(base: ClusterSpec, args: argparse.Namespace) -> ClusterSpec:
    costs = CostModel(
        max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_seqs,
        max_waiting=args.max_waiting,
        overhead_s=args.step_overhead_ms / 1e3,
        token_s=args.token_us / 1e6,
        kv_token_s=args.kv_token_ns / 1e9,
    )
    return replace(
        base,
        pods=args.pods or base.pods,
        blocks_per_pod=args.blocks_per_pod or base.blocks_per_pod,
        block_size=args.block_size,
        costs=costs,
    )


def list_scenarios(args: argparse.Namespace) -> str:
    """The scenarios of the study, each with its working set in pods' caches
    (:func:`bench.sim.workloads.working_set`, seed 0, base load, after the flags)."""
    hasher = BlockHasher(HashConfig(block_size=args.block_size))
    chosen = eviction_study() if args.study == "eviction" else [*standard(), *load_study()]
    lines = []
    for base in chosen:
        s = scenario_for(Cell("list", base.name, "", 1.0), args)
        params = ", ".join(f"{k}={v}" for k, v in s.spec.params().items())
        lines.append(f"{s.name} ({s.spec.kind}): {s.about}\n    {params}")
        peak, mean = working_set(prepare(s.spec.build(0, s.name), hasher))
        pod = s.cluster.blocks_per_pod
        lines.append(
            f"    {s.cluster.pods} pods x {pod} blocks; working set {peak / pod:.2f}x one "
            f"pod's cache at its peak, {mean / pod:.2f}x on average"
        )
    return "\n".join(lines)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Unwinds like Ctrl-C does, so every kvindex serve started so far is stopped on the
    # way out (the default SIGTERM action would end this process and leave that to the
    # kernel's parent-death signal).
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)  # only the main thread may set a signal handler
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("bench.sim: interrupted; every kvindex serve it started is stopped", file=sys.stderr)
        return 128 + signal.SIGINT
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.list:
            print(list_scenarios(args))
            return 0
        if args.knee_check:
            return _knee_check(args)
        plan = cells(plan_spec(args))
        scenarios = {c: scenario_for(c, args) for c in plan}
        lag = LagModel(args.lag_ms, args.lag_sigma)
        slo = Slo(args.slo_ttft, args.slo_itl)
    except ValueError as exc:
        print(f"bench.sim: {exc}", file=sys.stderr)
        return 2
    return _compare(args, argv, plan, scenarios, lag, slo)


def _compare(
    args: argparse.Namespace,
    argv: list[str] | None,
    plan: list[Cell],
    scenarios: dict[Cell, Scenario],
    lag: LagModel,
    slo: Slo,
) -> int:
    started = time.perf_counter()
    results, stats = _run_cells(args, plan, scenarios, lag, slo)
    meta = _meta(args, argv, time.perf_counter() - started, lag, slo)
    meta["workload_stats"] = stats
    abouts = {c.scenario: scenarios[c] for c in plan}
    claims = evaluate(results, abouts, slo.ttft_s)
    for path in write(args.out, results, abouts, claims, meta, png=not args.no_png):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _knee_check(args: argparse.Namespace) -> int:
    """Each sweep scenario's cache-oblivious knee at --scale and at twice it."""
    lag = LagModel(args.lag_ms, args.lag_sigma)
    slo = Slo(args.slo_ttft, args.slo_itl)
    spec = plan_spec(args)
    knees = {}
    for scale in (args.scale, 2 * args.scale):
        scaled_args = argparse.Namespace(**{**vars(args), "scale": scale})
        plan = cells(
            replace(spec, standard=[], policies=["least-loaded"], replica_counts=[], faults=[])
        )
        scenarios = {c: scenario_for(c, scaled_args) for c in plan}
        knees[scale], _ = _run_cells(scaled_args, plan, scenarios, lag, slo)
    for line in knee_check(knees, slo.ttft_s):
        print(line)
    return 0


def _run_cells(
    args: argparse.Namespace,
    plan: list[Cell],
    scenarios: dict[Cell, Scenario],
    lag: LagModel,
    slo: Slo,
) -> tuple[dict[Cell, RunResult], dict[str, dict[str, Any]]]:
    """Every cell's run, and each scenario's generator figures."""
    hasher = BlockHasher(HashConfig(block_size=args.block_size))
    workloads = _Workloads(plan, scenarios, hasher)
    bar = progress(workloads.total, enabled=not args.no_progress)
    results: dict[Cell, RunResult] = {}
    with ExitStack() as stack:
        service: KvindexProcess | None = None
        stack.callback(bar.close)
        done: dict[Cell, RunResult] = {}  # the same run in two studies is made once
        for n, cell in enumerate(plan):
            same = replace(cell, study="")
            if same in done:
                results[cell] = done[same]
                bar.update(workloads.count(cell))
                continue
            scenario = scenarios[cell]
            if uses_index(cell.policy) and service is None:
                service = stack.enter_context(KvindexProcess(block_size=args.block_size))
            bar.describe(cell.label())
            cluster = scenario.cluster.for_run(n)
            spec = RunSpec(
                scenario.name,
                cell.policy,
                cluster,
                seed=cell.seed,
                rule=PickRule(load_tokens=args.load_tokens, margin=args.overload_margin),
                approx_ratio=args.approx_ratio,
                replicas=cell.replicas,
                lag=lag,
                faults=cell.faults,
                slo=slo,
                vllm_version=args.vllm_version,
                max_probes=(min(args.max_probes, 100) if args.quick else args.max_probes) or None,
                load=cell.load,
                scrape_s=args.scrape_ms / 1e3,
                route_weights=args.route_weights,
                route_max_tokens=args.route_max_tokens,
            )
            results[cell] = done[same] = run(workloads.get(n, cell), spec, bar, service=service)
    return results, workloads.stats


class _Workloads:
    """Each (scenario, load, seed) workload, prepared when a run first needs it and
    dropped after its last run: a long-context trace's prompts take hundreds of MB, and a
    sweep has dozens of them."""

    def __init__(self, plan: list[Cell], scenarios: dict[Cell, Scenario], hasher: BlockHasher):
        self._scenarios, self._hasher = scenarios, hasher
        self._last: dict[tuple[str, float, int], int] = {}
        self._counts: dict[tuple[str, float, int], int] = {}
        self._ready: dict[tuple[str, float, int], PreparedWorkload] = {}
        #: Per scenario, its generator's own figures (seed 0, lowest load), e.g. a
        #: trace's statistics next to its targets.
        self.stats: dict[str, dict[str, Any]] = {}
        for n, cell in enumerate(plan):
            key = _key(cell)
            self._last[key] = n
            if key not in self._counts:
                s = scenarios[cell]
                workload = s.spec.build(cell.seed, s.name)
                self._counts[key] = len(workload.requests)
                if cell.seed == 0 and s.name not in self.stats:
                    self.stats[s.name] = workload_stats(s.spec, workload)
        self.total = sum(self._counts[_key(c)] for c in plan)

    def count(self, cell: Cell) -> int:
        return self._counts[_key(cell)]

    def get(self, n: int, cell: Cell) -> PreparedWorkload:
        key = _key(cell)
        prepared = self._ready.get(key)
        if prepared is None:
            s = self._scenarios[cell]
            prepared = self._ready[key] = prepare(s.spec.build(cell.seed, s.name), self._hasher)
        for old in [k for k, last in self._last.items() if last <= n and k != key]:
            self._ready.pop(old, None)
        if self._last[key] <= n:
            self._ready.pop(key, None)
        return prepared


def _key(cell: Cell) -> tuple[str, float, int]:
    return (cell.scenario, cell.load, cell.seed)


def _meta(
    args: argparse.Namespace, argv: list[str] | None, wall_s: float, lag: LagModel, slo: Slo
) -> dict[str, Any]:
    words = sys.argv[1:] if argv is None else argv
    costs = _cluster(ClusterSpec(), args).costs
    return {
        "command": shlex.join(["python", "-m", "bench.sim", *words]),
        "quick": args.quick,
        "scale": _scale(args),
        "block_size": args.block_size,
        "engine": costs.as_dict(),
        "lag": lag.describe(),
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
        "sweep_replicas": args.replicas,
        "load_tokens": args.load_tokens,
        "overload_margin": args.overload_margin,
        "approx_ratio": args.approx_ratio,
        "vllm_version": args.vllm_version,
        "scrape_ms": args.scrape_ms,
        "route_weights": args.route_weights,
        "route_max_tokens": args.route_max_tokens,
        "wall_s": round(wall_s, 1),
    }


if __name__ == "__main__":
    sys.exit(main())

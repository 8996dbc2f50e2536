"""End-to-end ingest (``bench_ingest.py``) from this tree and from another git ref, side by
side in one run, in ABBA rounds: the comparison a change to the ingest path is judged by.

Each round runs the ref's own ``bench_ingest.py`` (from a ``git archive`` on
``PYTHONPATH``, its extensions built in place) and this tree's, one after the other (the
order flips every round), each a fresh process with the same arguments. On a shared
machine the wall figure moves with the load; the per-CPU-second figure (this process's
CPU time over the same interval) much less, and the medians of both are printed.

    python bench/bench_ingest_ab.py --baseline aa2fd09 [--rounds 4] [--blocks 2000000]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

try:  # run as a script: bench/ is sys.path[0]
    from bench_gateway import _checkout
except ModuleNotFoundError:
    from bench.bench_gateway import _checkout

HERE = Path(__file__).resolve().parent
LINE = re.compile(
    r"(\d+) event\(s\)/batch:\s+([\d,]+) blocks/s \(([\d,]+) per CPU-second"
    r".*\((\d[\d,]*)/([\d,]+) batches"
)


def run_once(script: Path, pythonpath: str | None, argv: list[str]) -> dict[int, tuple]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run(
        [sys.executable, str(script), *argv], env=env, capture_output=True, text=True, check=True
    )
    out = {}
    for m in LINE.finditer(done.stdout):
        per, wall, cpu, got, want = m.groups()
        out[int(per)] = (
            int(wall.replace(",", "")),
            int(cpu.replace(",", "")),
            got.replace(",", "") == want.replace(",", ""),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="REF", required=True, help="the git ref to compare")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=2_000_000)
    parser.add_argument("--events-per-batch", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--presize", action="store_true", help="bench_ingest.py --presize")
    args = parser.parse_args()
    argv = ["--blocks", str(args.blocks), "--events-per-batch", *map(str, args.events_per_batch)]
    if args.presize:
        argv.append("--presize")
    results: dict[str, dict[int, list[tuple]]] = {"this": {}, "base": {}}
    with ExitStack() as stack:
        base_path = stack.enter_context(_checkout(args.baseline))
        base_script = base_path.parent / "src" / "bench" / "bench_ingest.py"
        sides = {"this": (HERE / "bench_ingest.py", None), "base": (base_script, str(base_path))}
        print(f"load average before: {os.getloadavg()[0]:.1f}", flush=True)
        for r in range(args.rounds):
            order = ("this", "base") if r % 2 == 0 else ("base", "this")
            for name in order:
                script, path = sides[name]
                got = run_once(script, path, argv)
                for per, figures in got.items():
                    results[name].setdefault(per, []).append(figures)
                    wall, cpu, whole = figures
                    print(
                        f"  round {r + 1} {name:4} {per} event(s)/msg: {wall:>10,} blocks/s, "
                        f"{cpu:>10,} per CPU-s{'' if whole else '  (batches missing)'}",
                        flush=True,
                    )
        print(f"load average after: {os.getloadavg()[0]:.1f}")
    label = {"this": "this tree", "base": args.baseline}
    print(f"\nmedians of {args.rounds} rounds, {args.blocks:,} fresh blocks per run")
    for per in args.events_per_batch:
        for name in ("this", "base"):
            runs = results[name].get(per, [])
            if not runs:
                continue
            wall = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            print(
                f"  {per} event(s)/msg  {label[name]:>12}: {wall:>12,.0f} blocks/s, "
                f"{cpu:>12,.0f} per CPU-second"
            )


if __name__ == "__main__":
    main()

"""wrk (Debian's ``wrk`` package, C, epoll) as the load generator, in place of the
minimal asyncio client of ``bench/bench_score.py``.

Why a second generator: on a 2-core machine the generator shares the CPUs with the
server it measures. The asyncio client costs ~40-50 µs of CPU per request, wrk ~17-22
(``bench/README.md``, "Load generators"); with 16 connections the server is the
bottleneck either way, but with one connection the client's own time is part of every
latency. Both peers of ``bench/compare_peers.py`` get the same generator, never one each.

:func:`measure` returns the figures ``bench_score._measure`` returns (``rps``,
``p50_ms``, ``p99_ms``, ``requests``) plus ``generator_us``, wrk's CPU time per request.
Every request is a POST of one of the bodies, in turn; an answer other than 2xx is an
error (the run raises instead of measuring refusals).
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import tempfile
from pathlib import Path

_SCRIPT = """
local bodies = {}
for name in io.lines(os.getenv("KVBENCH_BODIES")) do
  local file = assert(io.open(name, "rb"))
  bodies[#bodies + 1] = file:read("*a")
  file:close()
end
local path = os.getenv("KVBENCH_PATH")
local headers = {["Content-Type"] = os.getenv("KVBENCH_CONTENT_TYPE")}
local i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format("POST", path, headers, bodies[i])
end
"""
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def available() -> bool:
    return shutil.which("wrk") is not None


def measure(
    port: int,
    bodies: list[bytes],
    connections: int,
    seconds: float,
    path: str = "/score",
    content_type: str = "application/json",
) -> dict[str, float]:
    """``connections`` keep-alive connections for ``seconds`` (one wrk thread)."""
    with tempfile.TemporaryDirectory(prefix="kvbench-wrk-") as tmp:
        script, listing = Path(tmp, "post.lua"), Path(tmp, "bodies")
        script.write_text(_SCRIPT)
        names = []
        for i, body in enumerate(bodies):  # one file each: a binary body may hold newlines
            names.append(Path(tmp, f"body{i}"))
            names[-1].write_bytes(body)
        listing.write_text("".join(f"{name}\n" for name in names))
        env = {
            **os.environ,
            "KVBENCH_BODIES": str(listing),
            "KVBENCH_PATH": path,
            "KVBENCH_CONTENT_TYPE": content_type,
        }
        argv = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run(
            [*argv, "-s", str(script), f"http://127.0.0.1:{port}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=seconds + 60,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed: {out.stderr or out.stdout}")
    return _figures(out.stdout, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)


def _figures(report: str, cpu_s: float) -> dict[str, float]:
    refused = re.search(r"Non-2xx or 3xx responses: (\d+)", report)
    if refused or "Socket errors" in report:
        raise RuntimeError(f"wrk saw refusals or socket errors:\n{report}")
    requests = int(re.search(r"(\d+) requests in ([\d.]+)(\w+)", report).group(1))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", report).group(1))

    def percentile(p: int) -> float:
        value, unit = re.search(rf"\s{p}%\s+([\d.]+)(\w+)", report).groups()
        return float(value) * _UNITS[unit]

    return {
        "requests": requests,
        "rps": rps,
        "p50_ms": percentile(50),
        "p99_ms": percentile(99),
        "generator_us": 1e6 * cpu_s / max(1, requests),
    }

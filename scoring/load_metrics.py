"""A vLLM pod's ``/metrics`` text to its live load: requests running and waiting, and how
full its KV cache is, per engine.

vLLM 0.33 (``vllm/v1/metrics/loggers.py``): the gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (0..1), labelled
``model_name`` and ``engine`` (one series per data-parallel engine core); older releases
named the KV gauge ``vllm:gpu_cache_usage_perc``, read when the new one is absent. Only
those gauges' lines are fed to prometheus_client's parser: a page is mostly histograms,
and parsing every pod's whole page each second competes for the GIL with requests.
SGLang 0.5.23 (``--enable-metrics``) serves ``sglang:num_running_reqs``,
``sglang:num_queue_reqs`` and ``sglang:token_usage`` per ``dp_rank``; several tensor- or
pipeline-parallel ranks may export one scheduler's figures, so the largest is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD_NAME = "vllm:gpu_cache_usage_perc"
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_WAITING = "sglang:num_queue_reqs"
SGLANG_KV_USAGE = "sglang:token_usage"


class MetricsError(ValueError):
    """A metrics page kvindex cannot read a load from; the message says why."""


#: The most requests one pod's page may report running, or waiting (each sample, and
#: their sum over the page). vLLM runs at most ``max_num_seqs`` requests per engine (256
#: by default, a few thousand at most) and holds its waiting queue in memory, so a
#: million is no real pod's figure but a broken or hostile page. The bound also keeps
#: every figure the route cost multiplies by a prompt's length far inside 64 bits.
MAX_REQUESTS = 1_000_000
#: KV usage is a fraction (0..1); a little above 1 is float rounding, read as 1.0, and
#: anything further is not a fraction.
MAX_KV_USAGE = 1.01


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine core's scheduler state (one data-parallel rank)."""

    running: int
    waiting: int
    kv_usage: float | None  # fraction of KV blocks in use, 0..1; None if not exported


def parse_engine_loads(text: str) -> dict[str, EngineLoad]:
    """Per ``engine`` label, the load in a vLLM metrics page.

    Requests are summed over the other labels (``model_name``); KV usage is the largest
    value seen for the engine. Raises MetricsError for text that does not parse, holds no
    vLLM scheduler gauges, or holds values that cannot be a load (NaN, infinite,
    negative, more than :data:`MAX_REQUESTS` requests, KV usage above
    :data:`MAX_KV_USAGE`).
    """
    from prometheus_client.parser import text_string_to_metric_families

    running: dict[str, float] = {}
    waiting: dict[str, float] = {}
    kv_new: dict[str, float] = {}
    kv_old: dict[str, float] = {}
    sums = {RUNNING: running, WAITING: waiting}
    maxima = {
        KV_USAGE: kv_new,
        KV_USAGE_OLD_NAME: kv_old,
        SGLANG_RUNNING: running,
        SGLANG_WAITING: waiting,
        SGLANG_KV_USAGE: kv_new,
    }
    requests = (RUNNING, WAITING, SGLANG_RUNNING, SGLANG_WAITING)
    # A page without the gauges is parsed whole, so that text that is no Prometheus
    # exposition at all is reported as such (a failure path: the cost does not matter).
    lines = _gauge_lines(text) or text
    try:
        for family in text_string_to_metric_families(lines):
            if family.name not in sums and family.name not in maxima:
                continue
            for sample in family.samples:
                if sample.name != family.name:
                    continue
                value = sample.value
                limit = MAX_REQUESTS if family.name in requests else MAX_KV_USAGE
                if not (0.0 <= value <= limit):  # NaN fails every comparison
                    raise MetricsError(f"{sample.name} has impossible value {value}")
                labels = sample.labels
                engine = labels.get("engine") or labels.get("dp_rank", "0")
                if family.name in sums:
                    target = sums[family.name]
                    target[engine] = target.get(engine, 0.0) + value
                else:
                    target = maxima[family.name]
                    target[engine] = max(target.get(engine, 0.0), value)
    except MetricsError:
        raise
    except Exception as exc:  # the parser raises ValueError and friends on bad text
        raise MetricsError(f"not Prometheus text: {exc}") from None
    if not running and not waiting:
        raise MetricsError(
            f"no {RUNNING} or {WAITING} (or SGLang's {SGLANG_RUNNING}): is this a vLLM or "
            "SGLang metrics endpoint?"
        )
    for name, per_engine in sums.items():
        if sum(per_engine.values()) > MAX_REQUESTS:
            raise MetricsError(f"{name} sums to more than {MAX_REQUESTS} requests")
    kv = kv_new or kv_old
    engines = sorted(set(running) | set(waiting) | set(kv), key=_engine_order)
    return {
        engine: EngineLoad(
            int(running.get(engine, 0)), int(waiting.get(engine, 0)), _fraction(kv.get(engine))
        )
        for engine in engines
    }


_WANTED = (
    RUNNING,
    WAITING,
    KV_USAGE,
    KV_USAGE_OLD_NAME,
    SGLANG_RUNNING,
    SGLANG_WAITING,
    SGLANG_KV_USAGE,
)
_PREFIXES = (*_WANTED, *(f"# HELP {n} " for n in _WANTED), *(f"# TYPE {n} " for n in _WANTED))


def _gauge_lines(text: str) -> str:
    """The lines of ``text`` that belong to the gauges read (their samples, HELP and
    TYPE lines); a sample of another metric whose name starts like one of them
    (``vllm:num_requests_waiting_by_reason``) is dropped by the parser's family check."""
    wanted = [line for line in text.splitlines() if line.startswith(_PREFIXES)]
    return "\n".join(wanted) + "\n" if wanted else ""


START_TIME = "process_start_time_seconds"


def parse_start_time(text: str) -> float | None:
    """When the pod's API server process started (unix seconds), from prometheus_client's
    process collector, which vLLM's ``/metrics`` serves with its own gauges (vLLM 0.33
    serves the default registry unless it runs several API server processes, then a
    multiprocess registry without it); None when the page has none or it is unreadable.
    A new value means the pod restarted: its engine, and the KV cache the index holds
    for it, are gone."""
    at = text.find("\n" + START_TIME + " ")
    if at < 0:
        if not text.startswith(START_TIME + " "):
            return None
        at = -1
    start = at + 2 + len(START_TIME)
    end = text.find("\n", start)
    try:
        value = float(text[start : end if end >= 0 else len(text)])
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def _fraction(value: float | None) -> float | None:
    return None if value is None else min(value, 1.0)


def _engine_order(engine: str) -> tuple[int, str]:
    return (int(engine), "") if engine.isdigit() else (1 << 30, engine)


@dataclass(frozen=True, slots=True)
class Totals:
    """A pod's load over all its engines."""

    running: int
    waiting: int
    kv_usage: float | None  # mean over engines that export it
    kv_usage_max: float | None  # the fullest engine, for admission


def totals(engines: Mapping[str, EngineLoad]) -> Totals:
    usage = [e.kv_usage for e in engines.values() if e.kv_usage is not None]
    return Totals(
        sum(e.running for e in engines.values()),
        sum(e.waiting for e in engines.values()),
        sum(usage) / len(usage) if usage else None,
        max(usage) if usage else None,
    )

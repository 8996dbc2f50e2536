"""The kvindex side of the conformance suite: the vLLM driver as a child process, and the
comparison of kvindex's answers with vLLM's own state.

The driver (``vllm_driver.py``) runs under the vLLM venv's interpreter and answers one
JSON line per command; :class:`DriverProcess` sends commands and waits for the answer,
bounded in time. :func:`compare_pod` is the check: the pod's block set in kvindex equals
the keys of vLLM's ``cached_block_hash_to_block`` (per KV group), and every probe's
``/score`` equals ``get_computed_blocks`` on that pod.

How hits are compared: vLLM's scheduler asks ``get_computed_blocks(request)``, which caps
a hit at ``num_tokens - 1`` (the last token is always recomputed for its logits), while
``/score`` reports the cached prefix. So each probe prompt P is checked twice:
``/score(P)`` equals ``get_computed_blocks(P, max_cache_hit_length=len(P))`` (the cached
prefix, uncapped), and ``/score(P[:-1])`` equals ``get_computed_blocks(P)`` as the
scheduler calls it - the blocks of P[:-1] are exactly the ones the cap allows.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("vllm_driver.py")
#: The KV group namespace of group g > 0 in kvindex (the hybrid indexing's rule: group 0
#: under the model's own name, group g under ``<model>#kv-group-<g>``).
GROUP_SEPARATOR = "#kv-group-"


class DriverError(RuntimeError):
    pass


class Divergence(AssertionError):
    """kvindex's index or scores differ from vLLM's own state (the conformance check
    failed, as opposed to the suite not running)."""


class DriverProcess:
    """``vllm_driver.py`` under the vLLM interpreter; one command at a time."""

    def __init__(self, python: str, log_path: Path) -> None:
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "PYTHONPATH")}
        env["VLLM_LOGGING_LEVEL"] = "WARNING"
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [python, str(DRIVER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def answer(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DriverError(f"vLLM driver gave no answer in {timeout_s}s\n{self.log_tail()}")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise DriverError(f"vLLM driver exited ({self.process.poll()})\n{self.log_tail()}")
            if line.startswith("{"):
                answer = json.loads(line)
                if "error" in answer:
                    raise DriverError(f"vLLM driver: {answer['error']}\n{answer.get('trace')}")
                return answer

    def call(self, op: str, timeout_s: float = 120.0, **args: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()
        return self.answer(timeout_s)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(DriverError, OSError, ValueError):
                self.call("stop", timeout_s=15)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)


@dataclass
class PodSpec:
    """One vLLM pod of the suite: its id (``ip:port``), model, topology and settings."""

    pod: str
    model: str
    topology: str  # "bind": kvindex binds, the pod connects; "connect": the reverse
    topic: bool = True
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def host(self) -> str:
        return self.pod.rsplit(":", 1)[0]


def group_namespace(model: str, group: int) -> str:
    return model if group == 0 else f"{model}{GROUP_SEPARATOR}{group}"


class Kvindex:
    """The HTTP side of a running ``kvindex serve``."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=10.0)

    def pod_report(self, pod: str) -> dict[str, Any] | None:
        response = self.client.get(f"/index/pods/{pod}")
        return response.json() if response.status_code == 200 else None

    def caught_up(self, pod: str, published: int) -> bool:
        """Every batch the pod published (seq 0..published-1) is applied and its stream
        is live."""
        report = self.pod_report(pod)
        if report is None:
            return published == 0
        streams = report.get("streams") or []
        return any(
            s.get("state") == "live" and s.get("last_seq") == published - 1 for s in streams
        ) or (published == 0 and not streams)

    def blocks(self, pod: str, model: str) -> set[int]:
        response = self.client.get(
            f"/index/pods/{pod}/blocks", params={"model": model, "limit": 1_000_000}
        )
        if response.status_code == 404:
            return set()
        response.raise_for_status()
        body = response.json()
        assert not body["truncated"]
        return {key for keys in body["blocks"].values() for key in keys}

    def matched(self, pod: str, model: str, probe: dict[str, Any], tokens: list[int]) -> int:
        body: dict[str, Any] = {"model": model, "token_ids": tokens, "pods": [pod]}
        if probe.get("lora"):
            body["lora_name"] = probe["lora"]
        if probe.get("salt"):
            body["cache_salt"] = probe["salt"]
        # Items clipped to ``tokens`` (P[:-1] may end inside an image): which full
        # blocks an item overlaps, and its offset in them, are all that is hashed.
        clipped = [
            {"identifier": i, "offset": o, "length": min(o + n, len(tokens)) - o}
            for i, o, n in probe.get("mm") or []
            if o < len(tokens)
        ]
        if clipped:
            body["mm_features"] = clipped
        response = self.client.post("/score", json=body)
        assert response.status_code == 200, response.text
        (answer,) = [p for p in response.json()["pods"] if p["pod"] == pod]
        return answer["matched_blocks"]

    def close(self) -> None:
        self.client.close()


def compare_pod(kvindex: Kvindex, spec: PodSpec, truth: dict[str, Any]) -> list[str]:
    """Every difference between kvindex and vLLM for one pod, as readable lines."""
    problems: list[str] = []
    duplicates = set(truth["duplicates_seen"])
    groups = {int(g): set(keys) for g, keys in truth["blocks"].items()}
    groups.setdefault(0, set())
    for group, expected in sorted(groups.items()):
        held = kvindex.blocks(spec.pod, group_namespace(spec.model, group))
        missing, extra = expected - held, held - expected
        if missing or extra:
            problems.append(
                f"{spec.pod} group {group}: kvindex holds {len(held)} blocks, vLLM caches "
                f"{len(expected)}; {len(missing)} missing (of them {len(missing & duplicates)} "
                f"had duplicate copies in vLLM), {len(extra)} extra (of them "
                f"{len(extra & duplicates)} had duplicate copies)"
            )
    wrong = []
    for probe in truth["probes"]:
        toks = probe["tokens"]
        got = kvindex.matched(spec.pod, spec.model, probe, toks)
        got_capped = kvindex.matched(spec.pod, spec.model, probe, toks[:-1])
        if got != probe["uncapped"] or got_capped != probe["capped"]:
            wrong.append(
                f"{len(toks)} tokens lora={probe.get('lora')} salt={probe.get('salt')} "
                f"mm={probe.get('mm')}: "
                f"/score {got} (of P[:-1]: {got_capped}), vLLM get_computed_blocks "
                f"{probe['uncapped']} uncapped, {probe['capped']} as the scheduler asks"
            )
    if wrong:
        problems.append(
            f"{spec.pod}: {len(wrong)} of {len(truth['probes'])} probes differ, e.g. "
            + "; ".join(wrong[:3])
        )
    return problems


def hash_check_problems(kvindex: Kvindex, pod: str) -> list[str]:
    """kvindex's ingest hash check (indexer/verify.py) for one pod, as problems.

    Every pod hashes exactly as its model is configured, so the check must have passed
    on the pod's events and never failed: a failure is a false alarm in kvindex, or
    a pod of the driver hashing as no real engine would (an earlier false alarm was the
    driver hashing a request with another pod's NONE_HASH).
    """
    report = kvindex.pod_report(pod) or {}
    checks = report.get("hash_check") or {}
    if not checks:
        return [f"{pod}: kvindex reports no hash check (report: {report})"]
    return [
        f"{pod}: hash check {member} is {check['state']} with {check['failed_events']} "
        f"failed of {check['checked_events']} events: {check['diagnosis']}"
        for member, check in sorted(checks.items())
        if check["state"] != "ok" or check["failed_events"]
    ]


#: What kvindex logs when a pod's block hashes do not match its own (indexer/verify.py).
HASH_ALARM = "do not match kvindex's"


def hash_alarms(log_path: Path, start: int) -> tuple[list[str], int]:
    """Hash-mismatch lines kvindex logged past byte ``start`` of its log, and where the
    log ends now (the next call's ``start``)."""
    with open(log_path, "rb") as log:
        log.seek(start)
        text = log.read()
    lines = text.decode(errors="replace").splitlines()
    return [line for line in lines if HASH_ALARM in line], start + len(text)

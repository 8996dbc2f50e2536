"""The real kvindex service, as a subprocess, and the HTTP client the precise router uses.

The benchmark must go through the service users run - ``kvindex serve`` with its ZMQ
subscriber and HTTP API - not a model of it. :class:`KvindexProcess` starts it on free
loopback ports (bind mode: the simulated pods connect their publishers to it);
:class:`IndexClient` asks ``/score`` and waits for the index to catch up with what the
pods published (:meth:`IndexClient.wait_applied`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec

from kvindex.api.testing import ServeProcess, free_port

DETACH = Path(__file__).with_name("detach.py")


class ServiceError(RuntimeError):
    """kvindex did not start, or answered something unusable."""


class KvindexProcess:
    """``kvindex serve`` on loopback: HTTP at :attr:`url`, SUB bound at :attr:`zmq_endpoint`.

    ``models`` are declared in a model config file, so the first requests of a run
    (before any event) are answered with zero scores; ``settings`` adds sections to that
    file (e.g. ``{"scoring": {"route_weights": {...}}}``). Ports are picked free just before
    the start; if another process takes one in between, the start is retried with new
    ports.
    """

    def __init__(
        self,
        *,
        block_size: int = 16,
        models: Sequence[str] = ("sim-model",),
        extra_args: Sequence[str] = (),
        settings: Mapping[str, Any] | None = None,
        startup_timeout_s: float = 30.0,
        attempts: int = 3,
    ) -> None:
        with tempfile.NamedTemporaryFile(
            "wb", prefix="kvindex-sim-models-", suffix=".json", delete=False
        ) as config:
            tree = {"models": {m: {"block_size": block_size} for m in models}, **(settings or {})}
            config.write(msgspec.json.encode(tree))
        self._config_path = config.name
        last_error = ""
        for _ in range(attempts):
            self.zmq_endpoint = f"tcp://127.0.0.1:{free_port()}"
            self._server = ServeProcess(
                "--zmq-bind", self.zmq_endpoint,
                "--block-size", str(block_size),
                "--model-config", self._config_path,
                "--log-level", "warning",
                *extra_args,
                command=_detached(sys.executable, "-m", "kvindex.api.serve.cli", "serve"),
            )  # fmt: skip
            self.pid = self._server.process.pid
            self.url = self._server.url
            self.log_path = self._server.log_path
            try:
                self._server.wait_ready(startup_timeout_s)
                return
            except RuntimeError as exc:
                last_error = str(exc)
                self._stop()
            except BaseException:  # Ctrl-C while it starts: nobody else holds it yet
                self.close()
                raise
        os.unlink(self._config_path)
        raise ServiceError(f"kvindex serve did not start: {last_error}")

    def log_tail(self, chars: int = 2000) -> str:
        return self._server.log_tail(chars)

    def _stop(self) -> None:
        self._server.stop()
        # The group outlives its leader only if the service spawned something that did
        # not exit with it; nothing of it may outlive the run.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def close(self) -> None:
        self._stop()
        for path in (self.log_path, self._config_path):
            with contextlib.suppress(OSError):
                os.unlink(path)

    def __enter__(self) -> KvindexProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _detached(*command: str) -> list[str]:
    """``command`` started through :mod:`bench.sim.detach`: its own session, and the
    kernel's SIGTERM when this process dies."""
    return [sys.executable, str(DETACH), str(os.getpid()), *command]


class _PodScore(msgspec.Struct):
    pod: str
    matched_blocks: int


class _ScoreAnswer(msgspec.Struct):
    pods: list[_PodScore]


class _RouteAnswer(msgspec.Struct):
    pod: str
    reason: str


class IndexClient:
    """What a gateway does with kvindex: score prompts, read pod state."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        # verify=False: plain HTTP on loopback; skips loading the CA bundle (~0.1 s CPU).
        self._http = httpx.Client(base_url=url, timeout=timeout_s, verify=False)
        self._score_decoder = msgspec.json.Decoder(_ScoreAnswer)
        self._route_decoder = msgspec.json.Decoder(_RouteAnswer)
        self.score_calls = 0
        self.route_calls = 0
        self.sync_waits = 0  # wait_applied calls that found the index behind
        self.sync_timeouts = 0  # counted by whoever gives up waiting (Cluster.sync)
        self.sync_wait_s = 0.0
        #: The virtual time sent with every /route call (``?now=``), for a kvindex run
        #: with ``--clock external``; None: none sent (kvindex's own clock).
        self.now: float | None = None

    def score(self, model: str, tokens: Sequence[int], pods: Sequence[str]) -> dict[str, int]:
        """``POST /score``: matched blocks per candidate pod."""
        body = msgspec.json.encode({"model": model, "token_ids": tokens, "pods": pods})
        response = self._http.post(
            "/score", content=body, headers={"content-type": "application/json"}
        )
        if response.status_code != 200:
            raise ServiceError(f"/score answered {response.status_code}: {response.text[:300]}")
        self.score_calls += 1
        answer = self._score_decoder.decode(response.content)
        return {p.pod: p.matched_blocks for p in answer.pods}

    def route(
        self,
        model: str,
        tokens: Sequence[int],
        pods: Sequence[str],
        rid: str,
        max_tokens: int | None,
    ) -> tuple[str, str] | None:
        """``POST /route``: (chosen pod, reason), or None when no pod is admissible (429).
        ``max_tokens`` None sends none, as a client that sets no cap."""
        fields: dict[str, Any] = {"model": model, "token_ids": tokens, "pods": pods}
        fields["request_id"] = rid
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        body = msgspec.json.encode(fields)
        response = self._http.post(
            "/route",
            content=body,
            headers={"content-type": "application/json"},
            params=self._at_now(),
        )
        if response.status_code == 429:
            return None
        if response.status_code != 200:
            raise ServiceError(f"/route answered {response.status_code}: {response.text[:300]}")
        self.route_calls += 1
        answer = self._route_decoder.decode(response.content)
        return answer.pod, answer.reason

    def route_first_token(self, rid: str) -> None:
        """``POST /route/{id}/first-token``; an id kvindex no longer holds (404) is fine."""
        response = self._http.post(f"/route/{rid}/first-token", params=self._at_now())
        if response.status_code not in (200, 404):
            raise ServiceError(f"/route/first-token answered {response.status_code}")

    def route_done(self, rid: str) -> None:
        """``POST /route/{id}/done``; an id kvindex no longer holds (404) is fine."""
        response = self._http.post(f"/route/{rid}/done", params=self._at_now())
        if response.status_code not in (200, 404):
            raise ServiceError(f"/route/done answered {response.status_code}")

    def _at_now(self) -> dict[str, str] | None:
        return None if self.now is None else {"now": repr(self.now)}

    def pods(self) -> dict[str, dict[str, Any]]:
        """``GET /index/pods`` by pod id."""
        response = self._http.get("/index/pods")
        if response.status_code != 200:
            raise ServiceError(
                f"/index/pods answered {response.status_code}: {response.text[:300]}"
            )
        return {p["pod"]: p for p in response.json()["pods"]}

    def block_keys(self, pod: str, model: str) -> set[int]:
        """``GET /index/pods/{pod}/blocks``: every key the index holds for ``pod``."""
        response = self._http.get(f"/index/pods/{pod}/blocks", params={"model": model})
        if response.status_code == 404:
            return set()
        if response.status_code != 200:
            raise ServiceError(f"/blocks answered {response.status_code}: {response.text[:300]}")
        answer = response.json()
        return {key for keys in answer["blocks"].values() for key in keys}

    def applied_seqs(self) -> dict[str, int]:
        """The last seq the index applied, per stream member (rank 0's member = pod id)."""
        seqs: dict[str, int] = {}
        for report in self.pods().values():
            seqs.update(report["last_seq"])
        return seqs

    def applied_seq(self, pod: str) -> int:
        """The last seq the index applied from ``pod``'s rank 0 (-1: none yet)."""
        return self.position(pod)[0]

    def position(self, pod: str) -> tuple[int, int]:
        """``(last applied seq of pod's rank 0, engine restarts seen)``; ``(-1, 0)``
        before kvindex heard from the pod."""
        response = self._http.get(f"/index/pods/{pod}")
        if response.status_code == 404:
            return -1, 0
        if response.status_code != 200:
            raise ServiceError(f"/index/pods/{pod} answered {response.status_code}")
        report = response.json()
        return int(report["last_seq"].get(pod, -1)), int(report.get("restarts", 0))

    def event_errors(self) -> dict[str, float]:
        """``kvindex_event_errors_total`` from ``/metrics``, by reason (why kvindex skipped
        events: a refused sender, a full stream table, bad payloads...)."""
        response = self._http.get("/metrics")
        if response.status_code != 200:
            raise ServiceError(f"/metrics answered {response.status_code}")
        errors: dict[str, float] = {}
        for line in response.text.splitlines():
            if line.startswith("kvindex_event_errors_total{"):
                labels, _, value = line.rpartition(" ")
                reason = labels.partition('reason="')[2].partition('"')[0]
                errors[reason] = errors.get(reason, 0.0) + float(value)
        return errors

    def wait_applied(
        self,
        expected: Mapping[str, int],
        timeout_s: float = 10.0,
        *,
        restarted: Mapping[str, int] | None = None,
        seen: Callable[[str, int], None] | None = None,
    ) -> bool:
        """Wait until every member's applied seq reached ``expected``; False on timeout.

        A member in ``restarted`` (engine restarted, seq started again at 0) maps to the
        restart count kvindex must have reached: until it applies the new engine's first
        batch it still reports the old life's seq, which may be larger *or equal* (old
        seq 0, new seq 0), so its seq must equal the target and its restarts must have
        reached the count. ``seen`` is told every applied seq read. The subscriber
        updates ``last_seq`` after the sink applied the batch, so once it is reached,
        ``/score`` answers from an index holding every event up to it.
        """
        restarted = restarted or {}
        started = time.monotonic()
        deadline = started + timeout_s
        pause = 0.0002
        waited = False
        behind = dict(expected)
        try:
            while True:
                for member, seq in list(behind.items()):
                    applied, restarts = self.position(member)
                    owed = restarted.get(member)  # a restarted member: seq and restarts
                    done = (
                        (applied >= seq) if owed is None else (applied == seq and restarts >= owed)
                    )
                    if seen is not None:
                        seen(member, applied)
                    if done:
                        del behind[member]
                if not behind:
                    return True
                if not waited:
                    waited = True
                    self.sync_waits += 1
                if time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 0.005)
        finally:
            self.sync_wait_s += time.monotonic() - started

    def close(self) -> None:
        self._http.close()

"""``kvindex demo``: kvindex and a simulated three-pod vLLM cluster on loopback, answering.

Three :class:`kvindex.api.demo_pod.DemoPod` s publish real vLLM KV events into the
``kvindex serve --gateway`` this process runs. Each has "served" the same system prompt
followed by a document of its own, so their caches share two blocks and differ after
them. The demo asks ``/score``, ``/route`` and the gateway about one question on pod B's
document, says what they answered, and prints the commands that ask the same (bodies of
token ids: no tokenizer, nothing downloaded; the gateway gets ``/v1/completions`` with a
token-id prompt, since a chat request would be routed by load alone). Everything binds
127.0.0.1. :class:`Demo` owns the pods, the request files and the thread that prepares
and checks the cluster; the caller runs the service and closes the demo after it.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import httpx

from kvindex.api.demo_pod import DemoPod
from kvindex.api.testing import free_port
from kvindex.indexer.keys import HashConfig

MODEL = "demo/model"
HASH = HashConfig()  # vLLM's defaults (sha256, 16-token blocks), which kvindex's match
SYSTEM_BLOCKS = 2
DOCUMENT_BLOCKS = 12
QUESTION_TOKENS = 24  # one full block and a partial one, past the document
PODS = {"pod-a": "document A", "pod-b": "document B", "pod-c": "document C"}
ASKED_POD = "pod-b"
#: Bounds on each step of getting the cluster ready (a loaded machine is slow, not stuck).
STEP_TIMEOUT_S = 60.0


def token_ids(name: str, count: int) -> list[int]:
    """``count`` made-up token ids, the same on every run (``name`` seeds them)."""
    rng = random.Random(name)
    return [rng.randrange(1_000, 30_000) for _ in range(count)]


class DemoFailed(Exception):
    """The cluster did not get ready or did not answer as it should; the message says how."""


class Demo:
    """The simulated cluster in front of a kvindex on ``127.0.0.1:port``."""

    def __init__(self, port: int, out: TextIO = sys.stdout) -> None:
        self.started = time.monotonic() - _process_age_s()
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.out = out
        self.failure: str | None = None
        self.events_endpoint = f"tcp://127.0.0.1:{free_port()}"
        block = HASH.block_size
        self.system_prompt = token_ids("system prompt", SYSTEM_BLOCKS * block)
        self.documents = {
            name: token_ids(document, DOCUMENT_BLOCKS * block) for name, document in PODS.items()
        }
        asked = self.system_prompt + self.documents[ASKED_POD]
        self.checked_prompt = asked + token_ids("the demo's question", QUESTION_TOKENS)
        self.prompt = asked + token_ids("your question", QUESTION_TOKENS)
        self.pods: list[DemoPod] = []
        self.files = Path(tempfile.mkdtemp(prefix="kvindex-demo-"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvindex-demo", daemon=True)
        try:
            for name in PODS:
                self.pods.append(DemoPod(name, MODEL, self.events_endpoint, HASH))
            self._write_requests()
        except BaseException:
            self.close()
            raise

    def serve_flags(self) -> list[str]:
        """The ``kvindex serve`` flags of the demo's kvindex."""
        flags = ["--listen", f"127.0.0.1:{self.port}", "--gateway"]
        flags += ["--zmq-bind", self.events_endpoint]
        # Named pods are known (scraped, routable) before they publish, and bind mode
        # then accepts events from them alone.
        for pod in self.pods:
            flags += ["--pod-role", f"{pod.pod}=both"]
        # The pods' hashing, stated so that a KVINDEX_* variable in the environment
        # cannot make kvindex disagree with them.
        flags += ["--hash-algo", HASH.algo.value, "--block-size", str(HASH.block_size)]
        return [*flags, "--log-level", "warning"]

    def start(self) -> None:
        """Serve the pods' HTTP and start preparing the cluster in the background: it
        waits for the kvindex being served on ``port``."""
        for pod in self.pods:
            pod.start()
        self._say(
            f"kvindex demo: kvindex on {self.url} and {len(self.pods)} simulated vLLM pods "
            f"publishing real KV events (vLLM 0.33's wire, {HASH.algo.value} block hashes, "
            f"{HASH.block_size}-token blocks) for model {MODEL}; starting...\n"
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the pods (their ports are free after this) and remove the request files."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
        for pod in self.pods:
            pod.close()
        shutil.rmtree(self.files, ignore_errors=True)

    # -- preparing and checking (the demo's thread) ---------------------------------

    def _run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=10.0) as http:
                self._prepare(http)
                self._check(http)
        except Exception as exc:  # any failure ends the demo, said in one line
            if self._stop.is_set():
                return  # stopping anyway: what failed is the stop's doing
            self.failure = str(exc) or type(exc).__name__
            print(f"kvindex demo: {exc}; stopping", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGINT)  # the same clean stop as Ctrl-C

    def _prepare(self, http: httpx.Client) -> None:
        self._wait(lambda: http.get("/readyz").status_code == 200, "kvindex to be ready")
        for pod in self.pods:
            # In short waits: the pod's socket is held meanwhile, and a stop closes it.
            subscribed = functools.partial(pod.wait_for_kvindex, 0.05)
            self._wait(subscribed, f"kvindex to subscribe to {pod.name}'s events")
            pod.compute(self.system_prompt + self.documents[pod.name])

    def _check(self, http: httpx.Client) -> None:
        asked = next(pod for pod in self.pods if pod.name == ASKED_POD)
        body = {"model": MODEL, "token_ids": self.checked_prompt}
        # Every pod holds the system prompt, the asked pod its document too.
        expected = {pod.pod: SYSTEM_BLOCKS for pod in self.pods}
        expected[asked.pod] += DOCUMENT_BLOCKS
        score: dict[str, Any] = {}
        first_answer_s: float | None = None

        def indexed() -> bool:
            nonlocal score, first_answer_s
            answer = http.post("/score", json=body)
            if answer.status_code == 404:  # no event of the model applied yet
                return False
            score = _ok(answer)
            if first_answer_s is None and score["pods"]:
                first_answer_s = time.monotonic() - self.started
            held = {p["pod"]: p["matched_blocks"] for p in score["pods"]}
            # Warnings (a pod not heard yet) are recomputed at most once a second: wait
            # for an answer that has none, so what is printed and asked next is clean.
            return held == expected and not score["warnings"]

        self._wait(indexed, "every pod's blocks to be indexed and every pod heard")
        assert first_answer_s is not None
        route = _ok(http.post("/route", json=body))
        _ok(http.post(f"/route/{route['route_id']}/done"))
        completion = {"model": MODEL, "prompt": self.checked_prompt, "max_tokens": 16}
        gateway = http.post("/v1/completions", json=completion)
        _ok(gateway)
        served_by = gateway.headers.get("x-kvindex-pod")
        if route["pod"] != asked.pod or served_by != asked.pod:
            raise DemoFailed(
                f"/route chose {route['pod']} and the gateway {served_by}, not {asked.pod}"
            )
        self._say(self._report(score, route, gateway, first_answer_s))

    def _wait(self, check: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not self._stop.is_set():
            try:
                if check():
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise DemoFailed(f"timed out after {STEP_TIMEOUT_S:.0f}s waiting for {what}")
            self._stop.wait(0.05)
        raise DemoFailed("stopped")

    # -- what is printed ------------------------------------------------------------

    def _write_requests(self) -> None:
        requests = {
            "score.json": {"model": MODEL, "token_ids": self.prompt},
            "completion.json": {"model": MODEL, "prompt": self.prompt, "max_tokens": 16},
            "tokens.json": self.prompt,
        }
        for name, body in requests.items():
            (self.files / name).write_text(json.dumps(body) + "\n", encoding="utf-8")

    def _name(self, pod_id: str) -> str:
        return next((pod.name for pod in self.pods if pod.pod == pod_id), pod_id)

    def _report(
        self, score: dict[str, Any], route: dict[str, Any], gateway: httpx.Response, first_s: float
    ) -> str:
        block = HASH.block_size
        blocks = len(self.checked_prompt) // block
        named = sorted((-p["matched_blocks"], self._name(p["pod"])) for p in score["pods"])
        matched = ", ".join(f"{name} {-blocks}" for blocks, name in named)
        lines = ["This is what runs:", "  kvindex serve " + shlex.join(self.serve_flags())]
        for pod in self.pods:
            lines.append(
                f"  {pod.name}  {pod.pod}  has served the system prompt ({SYSTEM_BLOCKS} blocks) "
                f"+ {PODS[pod.name]} ({DOCUMENT_BLOCKS} blocks)"
            )
        lines += [
            "",
            f"It answers (the first answer with a cached prefix came {first_s:.1f}s after the "
            "process started). "
            f"Asked about system prompt + {PODS[ASKED_POD]} + a question ({blocks} full blocks):",
            f"  /score    matched blocks: {matched} (the system prompt is on every pod)",
            f"  /route    {self._name(route['pod'])}, reason {route['reason']}",
            f"  gateway   {self._name(gateway.headers['x-kvindex-pod'])} answered "
            f"(reason {gateway.headers.get('x-kvindex-route-reason')}): "
            f"{gateway.json()['choices'][0]['text']}",
            "",
            f"Try it: the request bodies are token ids in {self.files}/ (the same documents, "
            "another question):",
        ]
        json_post = "-H 'content-type: application/json' -d @"
        commands = [
            ("which pods hold this prompt's prefix, and how many blocks of it",
             f"curl -s {self.url}/score {json_post}{self.files / 'score.json'}"),
            ("where to send it, and why (reason, each pod's cost terms)",
             f"curl -s {self.url}/route {json_post}{self.files / 'score.json'}"),
            ("send it through the OpenAI-compatible gateway (see x-kvindex-pod and "
             "x-kvindex-route-reason)",
             f"curl -si {self.url}/v1/completions {json_post}{self.files / 'completion.json'}"),
            ("what kvindex knows of each pod",
             f"curl -s {self.url}/index/pods"),
            ("Prometheus metrics",
             f"curl -s {self.url}/metrics | grep -E '^kvindex_(pods|index_blocks|events_total)'"),
            ("/score as a table",
             f"{_kvindex_command()} score --url {self.url} --model {MODEL} "
             f"--token-file {self.files / 'tokens.json'}"),
        ]  # fmt: skip
        for comment, command in commands:
            lines += [f"  # {comment}", f"  {command}"]
        lines += ["", "Ctrl-C stops the demo."]
        return "\n".join(lines) + "\n"

    def _say(self, text: str) -> None:
        print(text, file=self.out, flush=True)


def _ok(response: httpx.Response) -> Any:
    """The answer's JSON, or DemoFailed naming the request and what it answered."""
    if response.status_code != 200:
        raise DemoFailed(
            f"{response.request.method} {response.request.url.path} answered "
            f"{response.status_code}: {response.text[:500]}"
        )
    return response.json()


def _process_age_s() -> float:
    """Seconds since this process started (Linux: its start time in /proc), so the time
    to the first answer counts the interpreter's start and the imports too; 0 where
    /proc cannot tell."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22
        with open("/proc/uptime", encoding="ascii") as uptime:
            now_s = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, now_s - start_ticks / os.sysconf("SC_CLK_TCK"))


def _kvindex_command() -> str:
    """How this process was started, to run another kvindex command the same way."""
    program = sys.argv[0]
    if Path(program).name == "kvindex":
        return shlex.quote(program)
    return f"{shlex.quote(sys.executable)} -m kvindex.api.serve.cli"

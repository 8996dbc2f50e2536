"""``kvindex demo`` as a new user runs it: the installed command, the commands it prints
run verbatim by a shell (curl, the ``kvindex score`` table), and Ctrl-C."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvindex.api.testing import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("curl") is None, reason="the printed commands use curl"),
]

KVINDEX = Path(sys.executable).with_name("kvindex")  # the installed entry point
LAST_LINE = "Ctrl-C stops the demo."
EXITED = "(the demo's output ended)"


class Demo:
    """``kvindex demo --port PORT`` as a child process, its stdout read line by line."""

    def __init__(self, port: int) -> None:
        command = (
            [str(KVINDEX)] if KVINDEX.exists() else [sys.executable, "-m", "kvindex.api.serve.cli"]
        )
        # Alone, as on a new user's machine: no KVINDEX_* setting of this one's.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [*command, "demo", "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(EXITED)

    def read_until(self, wanted: str, timeout_s: float = 90.0) -> list[str]:
        """Every line printed up to the one starting with ``wanted`` (included)."""
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        while not seen or not seen[-1].startswith(wanted):
            try:
                seen.append(self.lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                seen.append(EXITED)
            if seen[-1] == EXITED:
                self.stop(signal.SIGKILL)
                raise AssertionError(
                    f"no {wanted!r} line: printed {seen}, stderr {self.stderr}"
                ) from None
        return seen

    def stop(self, sig: int) -> int:
        """Send ``sig`` and return the exit status (bounded: killed after 30 s)."""
        self.process.send_signal(sig)
        try:
            _, self.stderr = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, self.stderr = self.process.communicate(timeout=10)
            raise AssertionError(f"the demo did not exit on {sig!r}: {self.stderr}") from None
        return self.process.returncode


def documented_output() -> list[str]:
    """The demo's /score and /route lines as README.md or docs/ show them."""
    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("**/*.md"))]
    lines = {
        line
        for page in pages
        for line in page.read_text(encoding="utf-8").splitlines()
        if line.startswith(("  /score    matched blocks:", "  /route    "))
    }
    assert len(lines) == 2, f"the docs show {sorted(lines)}, not one /score and one /route line"
    return sorted(lines)


def shell(command: str) -> str:
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{command} failed ({done.returncode}): {done.stderr}"
    assert done.stdout.strip(), f"{command} printed nothing"
    return done.stdout


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_the_printed_commands_answer_from_the_pod_holding_the_prefix_and_ctrl_c_cleans_up() -> None:
    port = free_port()
    demo = Demo(port)
    printed = demo.read_until(LAST_LINE)
    answered_s = time.monotonic() - demo.started
    text = "\n".join(printed)
    print(f"\nkvindex demo: its commands printed {answered_s:.1f}s after the process started")
    print(text)
    for line in documented_output():  # the docs show what the demo prints
        assert line in printed, f"{line!r} is not among the demo's lines"
    pods = dict(re.findall(r"^  (pod-\w)  (127\.0\.0\.1:\d+)  has served", text, re.M))
    assert set(pods) == {"pod-a", "pod-b", "pod-c"}
    holder = pods["pod-b"]  # the pod whose document the printed question asks about
    commands = [line.strip() for line in printed if line.startswith("  curl ")]
    commands += [line.strip() for line in printed if " score --url " in line]
    assert len(commands) == 6, printed

    score = json.loads(shell(commands[0]))
    best, *others = score["pods"]
    assert (best["pod"], best["matched_blocks"]) == (holder, 14)  # system prompt + document
    assert [p["matched_blocks"] for p in others] == [2, 2]  # the system prompt alone
    assert score["warnings"] == []

    route = json.loads(shell(commands[1]))
    assert (route["pod"], route["reason"]) == (holder, "prefix")

    head, body = shell(commands[2]).replace("\r\n", "\n").split("\n\n", 1)
    status, *header_lines = head.splitlines()
    headers = dict(line.lower().split(": ", 1) for line in header_lines)
    assert status.split()[1] == "200"
    assert headers["x-kvindex-pod"] == holder
    assert headers["x-kvindex-route-reason"] == "prefix"
    answer = json.loads(body)["choices"][0]["text"]
    assert answer.startswith(f"pod-b ({holder}) served this: 224 of")  # 14 blocks cached

    reports = json.loads(shell(commands[3]))["pods"]
    assert {p["pod"] for p in reports} == set(pods.values())
    assert all(p["stream_state"] == "live" for p in reports)
    assert "kvindex_pods 3.0" in shell(commands[4]).splitlines()
    assert holder in shell(commands[5])

    files = Path(re.search(r"-d @(\S+)/score\.json", commands[0]).group(1))  # type: ignore[union-attr]
    events_port = int(re.search(r"--zmq-bind tcp://127\.0\.0\.1:(\d+)", text).group(1))  # type: ignore[union-attr]
    assert demo.stop(signal.SIGINT) == 0, demo.stderr
    assert "Traceback" not in demo.stderr
    for freed in [port, events_port, *(int(p.split(":")[1]) for p in pods.values())]:
        assert port_is_free(freed), f"port {freed} still bound after the demo exited"
    assert not files.exists()


def test_sigterm_while_starting_stops_the_demo_cleanly() -> None:
    demo = Demo(free_port())
    printed = demo.read_until("kvindex demo: ")
    assert "starting" in printed[-1]
    assert demo.stop(signal.SIGTERM) == 0, demo.stderr
    assert "Traceback" not in demo.stderr

"""The simulator leaves no ``kvindex serve`` behind (bench/sim/detach.py, service.py):
the service runs in a process group of its own, is stopped on the way out of a Ctrl-C
or a SIGTERM, and ends by the kernel's parent-death signal when the simulator is
SIGKILLed. Real processes: the simulator's command line and the service it starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.sim.detach import main as detach_main  # noqa: E402

#: A comparison that runs long enough to be interrupted while its kvindex serves.
LONG_RUN = [
    "--scenarios", "docqa",
    "--policies", "precise",
    "--sweep", "none",
    "--replica-counts", "",
    "--faults", "",
    "--no-png",
    "--no-progress",
]  # fmt: skip


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rpartition(")")[2].split()


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and fields[1] == str(pid):
            out.append(int(entry.name))
    return out


def _wait_for(check, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _serving_child(sim: subprocess.Popen[bytes]) -> int:
    """The simulator's ``kvindex serve``, once it started (detach.py exec'd into it)."""
    found: list[int] = []

    def started() -> bool:
        assert sim.poll() is None, "the simulator ended before it started kvindex"
        for child in _children(sim.pid):
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"kvindex.api.serve.cli" in cmdline and not any(b"detach.py" in a for a in cmdline):
                found.append(child)
                return True
        return False

    _wait_for(started, "the simulator to start kvindex serve")
    return found[0]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm", "sigkill"])
def test_an_interrupted_or_killed_simulator_leaves_no_kvindex_behind(
    how: str, tmp_path: Path
) -> None:
    sim = subprocess.Popen(
        [sys.executable, "-m", "bench.sim", *LONG_RUN, "--out", str(tmp_path)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # a terminal's foreground group of its own, for Ctrl-C
    )
    try:
        serve = _serving_child(sim)
        assert os.getpgid(serve) == serve != os.getpgid(sim.pid)  # a group of its own
        if how == "ctrl-c":
            os.killpg(sim.pid, signal.SIGINT)  # what the terminal sends its foreground group
        else:
            sim.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        sim.wait(timeout=60)
        _wait_for(lambda: not _alive(serve), f"kvindex serve {serve} to exit after {how}")
        if how != "sigkill":
            # Stopped by the simulator on its way out, not by the kernel: the whole group.
            with pytest.raises(ProcessLookupError):
                os.killpg(serve, 0)
            assert b"Traceback" not in sim.stderr.read()  # type: ignore[union-attr]
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait(timeout=10)


def test_detach_refuses_to_start_a_command_whose_parent_is_gone(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    # A parent pid that is not ours: the command must not run (nothing would stop it).
    code = subprocess.run(
        [sys.executable, str(ROOT / "bench/sim/detach.py"), "1", "/usr/bin/touch", str(marker)],
        timeout=30,
    ).returncode
    assert code == 1 and not marker.exists()
    assert detach_main([]) == 2 and detach_main(["x", "true"]) == 2

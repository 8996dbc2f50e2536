"""Where the tests that run vLLM's own code find an interpreter that has vLLM."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
#: What ``tests/conformance/vllm_env.sh`` links in the checkout (git-ignored).
CHECKOUT_VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def vllm_python() -> str | None:
    """``$KVTEST_VLLM_PYTHON``, else the checkout's ``.venv-vllm``, else None (the test
    skips, or fails under CI)."""
    configured = os.environ.get("KVTEST_VLLM_PYTHON")
    if configured:
        return configured
    return str(CHECKOUT_VLLM_PYTHON) if CHECKOUT_VLLM_PYTHON.exists() else None


def run_vllm_driver(driver: Path, *args: str, timeout_s: float) -> list[Any]:
    """Run ``driver``, a script importing vLLM, in :func:`vllm_python`'s interpreter and
    return what it printed, one JSON value a line. No interpreter: the test skips, or
    fails under CI; one that cannot import vLLM: skips; the driver failing or running
    past ``timeout_s``: fails."""
    python = vllm_python()
    if python is None or not Path(python).exists():
        message = f"no vLLM interpreter at {python} (set KVTEST_VLLM_PYTHON)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    try:
        done = subprocess.run(
            [python, str(driver), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the vLLM driver {driver.name} ran past {timeout_s:g} s")
    if done.returncode != 0 and "ModuleNotFoundError" in done.stderr:
        pytest.skip(f"{python} cannot import vLLM: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]

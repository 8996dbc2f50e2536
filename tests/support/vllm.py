"""Where the tests that run vLLM's own code find an interpreter that has vLLM."""

from __future__ import annotations

import os
from pathlib import Path

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

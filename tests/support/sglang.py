"""Where the tests that run SGLang's own code find an interpreter that has SGLang."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: What ``tests/conformance/sglang_env.sh`` links in the checkout (git-ignored).
CHECKOUT_SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"


def sglang_python() -> str | None:
    """``$KVTEST_SGLANG_PYTHON``, else the checkout's ``.venv-sglang``, else None (the
    test skips, or fails under CI)."""
    configured = os.environ.get("KVTEST_SGLANG_PYTHON")
    if configured:
        return configured
    return str(CHECKOUT_SGLANG_PYTHON) if CHECKOUT_SGLANG_PYTHON.exists() else None


def require_sglang_python() -> str:
    """:func:`sglang_python`, or the test skips (fails under ``CI=true``) saying how to
    make one."""
    python = sglang_python()
    if python is not None:
        return python
    reason = (
        "no SGLang interpreter: run `bash tests/conformance/sglang_env.sh` (makes "
        ".venv-sglang) or set KVTEST_SGLANG_PYTHON to a Python with sglang 0.5.23"
    )
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)

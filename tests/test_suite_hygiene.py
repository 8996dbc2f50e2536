"""The test suite's own habits: a developer's Redis db 0 left alone, the vLLM venv found
where vllm_env.sh links it, one ``eventually``, and a collection that imports no heavy
reference library."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import vllm

ROOT = Path(__file__).resolve().parents[1]


def test_the_shared_redis_defaults_to_db_15() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVTEST_REDIS_URL"}
    done = subprocess.run(
        [sys.executable, "-c", "from tests.redis_fixtures import REDIS_URL; print(REDIS_URL)"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "redis://127.0.0.1:6379/15"
    assert 'KVTEST_REDIS_URL="redis://127.0.0.1:$port/15"' in (ROOT / ".ci/run").read_text()


def test_the_vllm_interpreter_is_the_checkouts_venv_unless_told(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    python = tmp_path / ".venv-vllm" / "bin" / "python"
    monkeypatch.setattr(vllm, "CHECKOUT_VLLM_PYTHON", python)
    monkeypatch.delenv("KVTEST_VLLM_PYTHON", raising=False)
    assert vllm.vllm_python() is None
    python.parent.mkdir(parents=True)
    python.touch()
    assert vllm.vllm_python() == str(python)
    monkeypatch.setenv("KVTEST_VLLM_PYTHON", "/elsewhere/python")
    assert vllm.vllm_python() == "/elsewhere/python"


def test_no_test_module_has_its_own_eventually() -> None:
    copies = []
    for path in sorted(ROOT.glob("tests/**/*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(
            isinstance(node, ast.FunctionDef) and node.name == "eventually" for node in tree.body
        ):
            copies.append(str(path.relative_to(ROOT)))
    assert copies == [], "import kvindex.api.testing.eventually instead"


@pytest.mark.timeout(300)
def test_collection_imports_no_reference_library() -> None:
    """transformers is imported by the tests that use it (tests/support/reference.py);
    at module level every collection paid for it."""
    script = (
        "import sys, pytest\n"
        "code = pytest.main(['--collect-only', '-q', '-n', '0', '-p', 'no:cacheprovider'])\n"
        "print('transformers' in sys.modules, int(code))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.stdout.splitlines()[-1] == "False 0", done.stdout[-2000:] + done.stderr[-2000:]

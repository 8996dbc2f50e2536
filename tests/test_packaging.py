"""kvindex packaged as Python users expect (issue 30, item 4): a license file and an SPDX
license expression, one place the version is written, every file the package needs at
run time (Lua scripts, C headers, PEP 561 markers) in the wheel, and a public API that
type-checks: ``mypy --strict`` on a user's script that uses the client is clean."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

from kvindex.api.version import __version__

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SUBPACKAGES = ("events", "indexer", "scoring", "api")


def test_license_is_an_spdx_expression_with_its_text_shipped() -> None:
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    # setuptools reads the SPDX string and license-files from 77 on.
    assert "setuptools>=77" in PYPROJECT["build-system"]["requires"]


def test_the_version_is_written_once() -> None:
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    attr = PYPROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "kvindex.api.version.__version__"
    assert importlib.metadata.version("kvindex") == __version__
    assert f"## [{__version__}]" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")


def _package_of(path: Path) -> str:
    relative = path.parent.relative_to(ROOT)
    return ".".join(("kvindex", *relative.parts))


def test_every_file_the_package_needs_is_in_it() -> None:
    """Each folder under the four subpackages that holds code or data is a package, and
    every file in it that is not Python or C source matches its package data (the wheel
    holds what this names: checked by building one in .ci/versions)."""
    setuptools = PYPROJECT["tool"]["setuptools"]
    packages, data = set(setuptools["packages"]), setuptools["package-data"]
    missing = []
    for top in SUBPACKAGES:
        assert (ROOT / top / "py.typed").is_file(), f"{top}/py.typed"
        for path in (ROOT / top).rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            package = _package_of(path)
            if package not in packages:
                missing.append(f"{path.relative_to(ROOT)}: package {package} not listed")
            elif path.suffix not in (".py", ".c", ".so") and not any(
                fnmatch.fnmatch(path.name, pattern) for pattern in data.get(package, ())
            ):
                missing.append(f"{path.relative_to(ROOT)}: not in {package}'s package data")
    assert missing == []


USER_SCRIPT = """
import asyncio

from kvindex.api.client import AsyncClient, Client, NoCapacity


def best_pod(url: str, tokens: list[int]) -> str | None:
    with Client(url, timeout=2.0) as client:
        answer = client.score(model="m", token_ids=tokens)
        ranked = sorted(answer.pods, key=lambda pod: pod.matched_blocks, reverse=True)
        return ranked[0].pod if ranked else None


async def route(url: str) -> str:
    async with AsyncClient(url) as client:
        try:
            decision = await client.route(model="m", token_ids=[1, 2, 3])
        except NoCapacity as exc:
            return f"full, retry in {exc.retry_after}"
        await client.done(decision.route_id)
        return decision.pod


print(best_pod("http://127.0.0.1:8080", [1, 2]), asyncio.run(route("http://127.0.0.1:8080")))
"""


def _mypy() -> str:
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    assert mypy is not None, "mypy is in the test extra"
    return mypy


def _linked(folder: Path) -> None:
    """kvindex laid out under ``folder`` as installed, its subpackages linked, not built."""
    (folder / "kvindex").mkdir(parents=True)
    for top in SUBPACKAGES:
        (folder / "kvindex" / top).symlink_to(ROOT / top)


def test_a_users_script_using_the_client_passes_mypy_strict(tmp_path: Path) -> None:
    """In a site-packages of its own, where mypy trusts only packages marked typed
    (PEP 561) and reports no error inside them."""
    mypy = _mypy()
    env = tmp_path / "venv"
    venv.create(env, with_pip=False)
    _linked(next(env.glob("lib/python*/site-packages")))
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT, encoding="utf-8")
    checked = subprocess.run(
        [mypy, "--strict", "--no-incremental", "--python-executable", str(env / "bin/python"),
         str(script)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_public_api_modules_pass_mypy_strict(tmp_path: Path) -> None:
    """The client and the types it answers with, checked as source: what a user's
    editor or type checker sees of them is what they declare."""
    _linked(tmp_path / "src")
    modules = ("kvindex.api.client", "kvindex.api.http.schemas", "kvindex.scoring.scorer")
    checked = subprocess.run(
        [_mypy(), "--strict", "--no-incremental", "--follow-imports=silent",
         *(arg for module in modules for arg in ("-m", module))],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(tmp_path / "src")},
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_build_runs_the_paths_its_run_is_for() -> None:
    """Under ``CI=true`` the README's venv runs every compiled part: a build that lost
    one (no compiler, no OpenSSL headers) would pass with its differential tests skipped.
    .ci/run's second venv, built with ``KVINDEX_PURE_PYTHON=1`` and run with
    ``KVTEST_PURE_PYTHON=1``, runs none of them."""
    from kvindex.api.serve import cli
    from kvindex.api.version import implementations
    from kvindex.indexer.redis.compiled import implementation as redis_lookup

    assert cli.unknown_variables({"KVINDEX_PURE_PYTHON": "1"}) == []  # setup.py reads it
    pure = os.environ.get("KVTEST_PURE_PYTHON") == "1"
    if not pure and os.environ.get("CI") != "true":
        pytest.skip("a developer's build may lack a compiler: checked under CI=true")
    parts = [*implementations().split(", "), f"{redis_lookup()} redis lookup"]
    compiled = [part for part in parts if part.startswith("compiled ")]
    assert len(parts) == 7
    assert compiled == ([] if pure else parts), implementations()

"""pyproject declares what kvindex imports and nothing it does not (issue 14: PyYAML was
imported through msgspec.yaml but undeclared, sortedcontainers declared but unused)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("events", "indexer", "scoring", "api")
# Extras for people, not for the package's own imports.
TOOL_EXTRAS = {"test", "dev", "bench"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return normalize(re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0])


def imported_modules() -> dict[str, str]:
    """Top-level third-party modules the installed packages import, with one file each."""
    found: dict[str, str] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ("kvindex", "__future__"):
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core = {requirement_name(r) for r in project["dependencies"]}
    extras = {
        requirement_name(r)
        for name, requirements in project["optional-dependencies"].items()
        if name not in TOOL_EXTRAS
        for r in requirements
        if not r.startswith("kvindex[")
    }
    return core, extras


def test_every_imported_distribution_is_declared() -> None:
    core, extras = declared()
    distributions = importlib.metadata.packages_distributions()
    undeclared = []
    for module, where in sorted(imported_modules().items()):
        names = {normalize(d) for d in distributions.get(module, [module])}
        if not names & (core | extras):
            undeclared.append(f"{module} ({where})")
    assert undeclared == []


def test_every_core_dependency_is_used() -> None:
    core, _ = declared()
    distributions = importlib.metadata.packages_distributions()
    used = {normalize(d) for m in imported_modules() for d in distributions.get(m, [m])}
    sources = "\n".join(
        p.read_text(encoding="utf-8") for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
    )
    # PyYAML is imported by msgspec.yaml, for the YAML config file.
    if "msgspec.yaml" in sources:
        used.add("pyyaml")
        assert "pyyaml" in core, "msgspec.yaml needs PyYAML at run time"
    assert core - used == set()
    assert "sortedcontainers" not in core

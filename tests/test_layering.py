"""The layout's rules, checked on the source (docs/design.md, "Layout"): dependencies
point one way, packages have no front doors, the bottom is light, and no class spreads
its state over mixin modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Each package may import those after it, never those before it.
LAYERS = ("api", "scoring", "indexer", "events")


def _modules() -> list[tuple[str, Path]]:
    return [(top, path) for top in LAYERS for path in sorted((ROOT / top).rglob("*.py"))]


def _kvindex_imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("kvindex.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)] if node.module.startswith("kvindex.") else []
    return found


def test_dependencies_point_one_way() -> None:
    """api -> scoring -> indexer -> events, counting every import, lazy ones included."""
    upward = []
    for top, path in _modules():
        rank = LAYERS.index(top)
        for line, module in _kvindex_imports(ast.parse(path.read_text(encoding="utf-8"))):
            target = module.split(".")[1]
            if target in LAYERS and LAYERS.index(target) < rank:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert upward == []


def test_packages_have_no_front_doors() -> None:
    """An ``__init__`` holds a docstring and nothing else: importing one module of a
    package never loads its siblings."""
    doors = []
    for _, path in _modules():
        if path.name != "__init__.py":
            continue
        body = ast.parse(path.read_text(encoding="utf-8")).body
        code = [
            n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
        ]
        if code:
            doors.append(str(path.relative_to(ROOT)))
    assert doors == []


def test_the_errors_module_loads_nothing_else() -> None:
    """Every package raises into ``kvindex.events.errors``; importing it must stay cheap."""
    probe = (
        "import sys; import kvindex.events.errors; "
        "print(sorted(m for m in sys.modules if m.startswith(('kvindex', 'zmq', 'numpy', "
        "'msgspec', 'kubernetes', 'httpx'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.strip()
    assert loaded == "['kvindex', 'kvindex.events', 'kvindex.events.errors']"


@pytest.mark.parametrize("top", LAYERS)
def test_no_class_is_spread_over_mixin_modules(top: str) -> None:
    """A method annotating ``self`` with another class is a mixin reading state defined
    elsewhere (STYLE.md, "One class owns its state, in one file")."""
    mixins = []
    for path in sorted((ROOT / top).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.args:
                first = node.args.args[0]
                if first.arg == "self" and first.annotation is not None:
                    mixins.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert mixins == []


def test_no_class_is_assembled_from_several_of_ours() -> None:
    """A class with two or more kvindex classes as bases is assembled from mixins. Errors
    are the exception: each takes its package's type and its kind (``events/errors.py``)."""
    classes = [
        (path, node)
        for _, path in _modules()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef)
    ]
    bases = {
        node.name: [b.id for b in node.bases if isinstance(b, ast.Name)] for _, node in classes
    }
    errors = {"Exception", "BaseException"}
    while True:  # every class deriving, through ours, from an exception
        more = {
            n
            for n, bs in bases.items()
            if n not in errors
            and any(b in errors or b.endswith(("Error", "Exception")) for b in bs)
        }
        if not more:
            break
        errors |= more
    assembled = []
    for path, node in classes:
        ours = [b for b in bases[node.name] if b in bases]
        if len(ours) >= 2 and node.name not in errors:
            assembled.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}{ours}")
    assert assembled == []

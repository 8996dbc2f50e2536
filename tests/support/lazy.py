"""Client packages some tests drive kvindex with, imported on first use.

``openai`` takes about a second to import and ``kubernetes`` a quarter of one; imported
at module level they were paid by every collection of the suite, even one that runs
none of the tests using them. A test that touches one where it is not installed skips,
as the module-level ``pytest.importorskip`` skipped the whole file.
"""

from __future__ import annotations

from importlib.util import find_spec
from types import ModuleType
from typing import Any

import pytest


class LazyModule:
    """Stands in for a module: the first attribute read imports it (or skips the test)."""

    def __init__(self, name: str, reason: str | None = None) -> None:
        self._name = name
        self._reason = reason
        self._module: ModuleType | None = None

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):
            # Collection probes every module-level object for pytest's own attributes;
            # answering those must not import the module.
            raise AttributeError(attribute)
        if self._module is None:
            self._module = pytest.importorskip(self._name, reason=self._reason)
        return getattr(self._module, attribute)


def installed(name: str) -> bool:
    """Whether ``name`` can be imported, without importing it."""
    return find_spec(name) is not None

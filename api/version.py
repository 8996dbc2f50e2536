"""kvindex's version, from the installed package's metadata (pyproject.toml is the one
place it is written)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("kvindex")
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0+unknown"

"""kvindex's version, from the installed package's metadata (pyproject.toml is the one
place it is written), and which of its optional compiled parts run."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from kvindex.api.json_tokens import implementation as token_reader
from kvindex.indexer.compiled import describe
from kvindex.scoring.route_pass import implementation as route_loop

try:
    VERSION = version("kvindex")
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0+unknown"


def implementations() -> str:
    """Which implementations this process runs, as ``kvindex --version`` and the startup
    line say it: the memory table, the hashing and the KV-event payload reader
    (:func:`kvindex.indexer.compiled.describe`), how a JSON body's token ids are read
    (:func:`kvindex.api.json_tokens.implementation`) and /route's candidate loop
    (:func:`kvindex.scoring.route_pass.implementation`)."""
    return f"{describe()}, {token_reader()} token_ids, {route_loop()} route loop"

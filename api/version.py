"""kvindex's version, and which of its optional compiled parts run.

``__version__`` is the one place the version is written: pyproject.toml reads it from
here when a wheel is built (statically, without importing this module), and a release
is the commit that sets it, tagged ``v<version>`` (CHANGELOG.md says how)."""

from __future__ import annotations

from kvindex.api.json_tokens import implementation as token_reader
from kvindex.indexer.compiled import describe
from kvindex.scoring.route_pass import implementation as route_loop

__version__ = "0.1.0"
VERSION = __version__


def implementations() -> str:
    """Which implementations this process runs, as ``kvindex --version`` and the startup
    line say it: the memory table, the hashing and the KV-event payload reader
    (:func:`kvindex.indexer.compiled.describe`), how a JSON body's token ids are read
    (:func:`kvindex.api.json_tokens.implementation`) and /route's candidate loop
    (:func:`kvindex.scoring.route_pass.implementation`)."""
    return f"{describe()}, {token_reader()} token_ids, {route_loop()} route loop"

"""kvindex's version, and which of its optional compiled parts run.

``__version__`` is the one place the version is written: pyproject.toml reads it from
here when a wheel is built (statically, without importing this module), and a release
is the commit that sets it, tagged ``v<version>`` (CHANGELOG.md says how)."""

from __future__ import annotations

from kvindex.api.http.json_tokens import implementation as token_reader
from kvindex.events.ingest.drain import implementation as receive
from kvindex.events.wire.scanned import implementation as payloads
from kvindex.indexer import compiled
from kvindex.scoring.route.one_pass import implementation as route_loop

__version__ = "0.1.0"
VERSION = __version__


def implementations() -> str:
    """Which implementations this process runs, as ``kvindex --version`` and the startup
    line say it: the memory table and the hashing (:mod:`kvindex.indexer.compiled`), the
    KV-event payload reader and receive (:mod:`kvindex.events.wire.scanned`,
    :mod:`kvindex.events.ingest.drain`), how a JSON body's token ids are read
    (:mod:`kvindex.api.http.json_tokens`) and /route's candidate loop
    (:mod:`kvindex.scoring.route.one_pass`)."""
    return (
        f"{compiled.implementation()} table, {compiled.hashing()} hashing, "
        f"{payloads()} payloads, {receive()} receive, "
        f"{token_reader()} token_ids, {route_loop()} route loop"
    )

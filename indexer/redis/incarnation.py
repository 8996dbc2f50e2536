"""Noticing that Redis lost the shared index, and what every replica says until it is
rebuilt.

A Redis without persistence that restarts comes back empty, and so does one that is
flushed or failed over to an empty replica. Nothing in the index says so by itself: an
empty index reads like pods that hold nothing, and the streams carry on as ``live``. So
a token is written next to the index (``<prefix>:{index}:incarnation``) the first time
a replica meets it, and every replica checks it at each lease round: gone, or another
token than the one this replica knows, means the index it wrote is lost. (A Redis
restarted *with* its data keeps the token, so only a real loss is reported.)

:class:`IndexIncarnation` (used by :class:`~kvindex.indexer.redis.leases.RedisLeases` on its
thread only) says what happens after a loss, and what goes unnoticed.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvindex.indexer.redis.keys import KeySpace
from kvindex.indexer.redis.scripts import SCRIPTS

log = logging.getLogger(__name__)

_SCRIPT = SCRIPTS["incarnation"]

#: Rebuild states: waiting for the owner, history that could not be fetched, done.
REBUILDING, INCOMPLETE, LIVE = "rebuilding", "incomplete", "live"


@dataclass(frozen=True, slots=True)
class RebuildMark:
    """A stream whose entries were lost with the index and are not rebuilt (yet):
    shown as its state at ``/index/pods`` and as a warning in ``/score``. ``model`` is
    empty while no owner has reported the stream (it then concerns every model)."""

    member: str
    model: str
    state: str
    reason: str


class IndexIncarnation:
    """The token this replica knows and the rebuild marks last read (see the module).

    After a loss every stream owes its whole history again: its owner re-acquires it as a
    rebuild (:class:`~kvindex.events.ingest.gate.Claim` ``rebuild``) and catches up by replay from
    the engine's first buffered batch, or marks it ``incomplete`` where it cannot. The
    rebuild states live in Redis (``<prefix>:{index}:rebuilds``, member -> state and model)
    so that every replica - not only the owner - warns while a stream is rebuilding, and
    stops when its owner reports it ``live``.

    A replica that starts after the loss never knew the old token and cannot notice it;
    another replica that did notice records the streams it knows. In Redis Cluster the
    token lives on one node: a node that loses its data alone goes unnoticed here.
    """

    def __init__(self, keys: KeySpace) -> None:
        self._keys = (keys.incarnation, keys.rebuilds)
        self.token: str | None = None
        self.losses = 0
        self._marks: dict[str, RebuildMark] = {}

    def command(self, members: Collection[str], states: Mapping[str, tuple[str, str]]) -> tuple:
        """This round's script call: ``members`` are the streams this replica knows,
        ``states`` (member -> (state, model)) the rebuild states its streams reached."""
        argv: list[Any] = [self.token or "", uuid.uuid4().hex, len(members), *members]
        for member, (state, model) in states.items():
            argv += [member, f"{state}\t{model}"]
        return _SCRIPT.args(self._keys, argv)

    def settle(self, reply: list[Any]) -> bool:
        """Take the script's answer; True when it says the index was lost."""
        lost, token, *entries = reply
        if lost:
            self.losses += 1
            log.warning(
                "the Redis index is lost (its incarnation token %s is gone: Redis restarted "
                "without persistence, or was flushed); every stream is rebuilt from its "
                "engine's replay buffer, and /score warns until it is",
                self.token,
            )
        self.token = token.decode() if isinstance(token, bytes) else str(token)
        marks = {}
        for at in range(0, len(entries), 2):
            member = entries[at].decode()
            state, _, model = entries[at + 1].decode().partition("\t")
            marks[member] = RebuildMark(member, model, _shown(state), _reason(state))
        self._marks = marks
        return bool(lost)

    def marks(self) -> dict[str, RebuildMark]:
        """Member -> its rebuild mark, as read at the last round (no Redis call)."""
        return self._marks


def _shown(state: str) -> str:
    """The stream state operators see: a rebuild in progress is a ``resync``."""
    return INCOMPLETE if state == INCOMPLETE else "resync"


def _reason(state: str) -> str:
    if state == INCOMPLETE:
        return (
            "Redis lost the index and the engine's replay buffer no longer holds all of "
            "this stream's history; entries may be missing until its engine clears or "
            "restarts"
        )
    return "Redis lost the index; its entries are being rebuilt from the engine's replay buffer"

"""Which pod computed each client session's latest turn, learned from the KV events.

An engine names, on each GPU ``BlockStored``, the session of the request that stored the
blocks (:mod:`kvindex.events.wire.sessions`). The member whose stream last carried such
a store for a session is where that session's latest turn was computed, so its history
is most likely still cached there. ``/route`` uses it where the prompt itself cannot be
scored (an image chat, a prompt it cannot tokenize): the session's next turn goes back
to that pod.

It is a hint, not ownership: several sessions share blocks, and a session's blocks may
have been evicted since. Entries are forgotten when their member is reset (restart,
removal, ``AllBlocksCleared``), and the least recently stored past :data:`MAX_SESSIONS`.

Thread-safety: the applier thread (through :class:`~kvindex.indexer.ingest.Ingestor`)
is the only writer; ``/route`` reads from the HTTP threads. Every method takes the one
lock, held for a few dict operations.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

#: The most (model, session) entries kept; past it the least recently stored goes first.
MAX_SESSIONS = 262_144


class SessionPods:
    """(model, session id) -> the member that last stored GPU blocks for it, in the
    order they were last stored (oldest first)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self._max = max_sessions
        self._lock = threading.Lock()
        self._members: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._by_member: dict[str, set[tuple[str, str]]] = {}  # for forget(): no scan

    def __len__(self) -> int:
        with self._lock:
            return len(self._members)

    def stored(self, model: str, member: str, sessions: Iterable[str]) -> None:
        """``member`` stored GPU blocks of ``model`` for each of ``sessions``: it is
        now where each of them was last computed."""
        with self._lock:
            members, by_member = self._members, self._by_member
            for session in sessions:
                key = (model, session)
                old = members.get(key)
                if old is not None:
                    members.move_to_end(key)
                    if old == member:
                        continue
                    self._unlink(old, key)
                members[key] = member
                by_member.setdefault(member, set()).add(key)
            while len(members) > self._max:
                key, old = members.popitem(last=False)
                self._unlink(old, key)

    def forget(self, member: str) -> int:
        """``member``'s cache is gone (restart, removal, cleared): its sessions are
        homeless. How many were forgotten."""
        with self._lock:
            keys = self._by_member.pop(member, ())
            for key in keys:
                del self._members[key]
            return len(keys)

    def member_of(self, model: str, session: str) -> str | None:
        """The member that last stored GPU blocks of ``model`` for ``session``, or None."""
        with self._lock:
            return self._members.get((model, session))

    def _unlink(self, member: str, key: tuple[str, str]) -> None:
        keys = self._by_member[member]
        keys.discard(key)
        if not keys:
            del self._by_member[member]

"""What a pod's doubted index entries are worth to ``/route``: the per-pod credit rule.

A pod's entries are in doubt when its stream is not in step with its engine, its events
arrive late (:data:`LAGGING`) or its block hashes do not match the index's. The doubt
concerns that pod alone: its load still counts and every other pod's prefix decides.
No credit where the entries may claim blocks the engine does not hold (:data:`NO_CREDIT`:
``hash_mismatch``, whose keys are meaningless, and ``gapped``, whose lost batches may
have held evictions), since crediting them sends requests to a cache that is not there.
Every other doubt keeps its matched prefix: the entries are a lower bound of the
engine's cache (``incomplete``, ``unheard``, ``replaying``, ``verifying``, ``resync``,
``restored``), or describe it as it was seconds ago (``lagging``).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import TypeVar

from kvindex.events.wire.identity import member_pod
from kvindex.indexer.pods import HASH_MISMATCH

#: The doubt of a pod whose events arrive later than ``--max-event-lag``.
LAGGING = "lagging"

#: Doubts whose entries earn no prefix credit (the module docstring says why).
NO_CREDIT = frozenset({HASH_MISMATCH, "gapped"})

M = TypeVar("M")


def credits_prefix(doubt: str | None) -> bool:
    """Whether a pod with ``doubt`` (None: none) is credited its matched prefix."""
    return doubt not in NO_CREDIT


def discredit(
    matches: MutableMapping[str, M],
    speculative: MutableMapping[str, int],
    doubts: Mapping[str, str],
) -> list[str]:
    """Drop from ``matches`` and ``speculative`` (keyed by index member: a pod or one
    of its data-parallel ranks) the entries of the pods in ``doubts`` (pod -> doubt)
    whose doubt earns no credit; the members dropped, in order."""
    if not doubts:
        return []
    dropped = []
    for member in [*matches, *(m for m in speculative if m not in matches)]:
        if not credits_prefix(doubts.get(member_pod(member))):
            matches.pop(member, None)
            speculative.pop(member, None)
            dropped.append(member)
    return dropped

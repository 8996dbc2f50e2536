"""What a pod's doubted index entries are worth to ``/route``: the per-pod credit rule.

A pod's entries are in doubt when its stream is not in step with its engine (a stream
state other than ``live``), its events arrive late (:data:`LAGGING`, above
``--max-event-lag``) or its block hashes do not match what the index computes
(:data:`~kvindex.indexer.pods.HASH_MISMATCH`). A doubt concerns that pod alone: its
load still counts, every other pod's prefix still decides, and only what its own
entries claim is weighed by the rule below.

- No credit where the entries may claim blocks the engine does not hold, so crediting
  them would send requests (and home sessions) to a cache that is not there:
  ``hash_mismatch`` (keys computed under another algorithm, seed or block size: a match
  is meaningless) and ``gapped`` (lost batches may have held its evictions or an
  ``AllBlocksCleared``).
- Credit for what is matched where the entries are a lower bound of the engine's cache:
  ``incomplete`` (history before some seq is missing), ``unheard`` (nothing heard since
  kvindex started), ``replaying`` (catching up), ``verifying`` (its position being
  proven), ``resync`` (a failed delivery being retried) and ``restored`` (a snapshot,
  there to keep routing warm across kvindex's own restart; the engine's next events or
  restart correct it). A matched block was reported by the engine; what is missing only
  makes the pod look colder than it is.
- Credit for ``lagging``: the entries describe the cache as it was seconds ago; the
  newest blocks are missing (a lower bound) and the evictions not yet seen are at the
  cache's least recently used end, rarely a live prefix. The warning names the lag.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import TypeVar

from kvindex.events.identity import member_pod
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

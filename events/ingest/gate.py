"""Which streams this process may apply: the seam for several replicas sharing one index.

When many kvindex replicas write one shared index (Redis), each engine stream must be
applied by exactly one of them at a time, or two replicas would interleave the same
stream's stores and removals. The subscriber asks a :class:`StreamGate` before it
applies a stream's batches, and tells it what it applied. ``events/`` only knows this
protocol; the implementation (leases in Redis) lives in ``indexer/``. Without a gate
(one replica, memory backend) every stream is owned.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from kvindex.events.wire.identity import StreamId


class Ownership(enum.Enum):
    OWNED = "owned"
    #: Another replica applies this stream: drop its batches (they are counted).
    NOT_OWNED = "not_owned"
    #: The gate cannot tell now (its store is unreachable and this replica's lease could
    #: have lapsed): keep the batches queued, apply nothing, ask again shortly.
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Claim:
    """The gate's answer for one stream.

    ``epoch`` changes every time this replica (re)acquires the stream. When the
    subscriber sees a new epoch it must not trust what it tracked locally (another
    replica may have applied batches meanwhile): it resumes after ``resume_after``, the
    last seq applied by whoever owned the stream before (None: unknown, so it catches up
    from the engine's first buffered batch). ``resume_digest`` is the payload digest of
    that batch when the gate stored it: the subscriber then replays from
    ``resume_after`` itself and checks the digest, so a position that belongs to an
    earlier engine incarnation is detected (reset) instead of trusted.

    ``rebuild``: the shared index lost this stream's entries (Redis came back empty):
    the whole history is owed again, so the subscriber catches up from the engine's
    first buffered batch, and what it cannot fetch leaves the stream ``incomplete``.
    """

    ownership: Ownership
    epoch: int = 0
    resume_after: int | None = None
    resume_digest: bytes | None = None
    rebuild: bool = False


OWNED = Claim(Ownership.OWNED)
NOT_OWNED = Claim(Ownership.NOT_OWNED)
UNKNOWN = Claim(Ownership.UNKNOWN)


class StreamGate(Protocol):
    """Called from the subscriber's applier thread; every method must be cheap (no I/O
    on the caller's thread) and must not raise."""

    def claim(self, stream: StreamId) -> Claim:
        """May this replica apply ``stream`` now? Also registers interest in it: a gate
        tries to acquire streams it is asked about."""

    def committed(self, stream: StreamId, seq: int, digest: bytes | None = None) -> None:
        """Batches of ``stream`` up to ``seq`` are applied to the index; ``digest`` is
        the payload digest of batch ``seq`` (:func:`kvindex.events.ingest.recovery.payload_digest`),
        to be handed back as ``Claim.resume_digest``."""

    def settled(self, stream: StreamId, epoch: int, model: str, state: str) -> None:
        """``stream``, owned under ``epoch``, is between recoveries in ``state``
        (``live``, ``verifying``, ``gapped`` or ``incomplete``); called when that
        changes. A gate shared by several replicas tells the others how a rebuild ends."""

    def release(self, stream: StreamId) -> None:
        """This replica no longer wants ``stream`` (its pod was removed)."""

    def unheard(self, pod: str | None = None) -> list[StreamId]:
        """Streams (of ``pod``, or all) whose entries this replica restored, e.g. from a
        snapshot, and that no batch was heard from since. When such a pod is removed
        there is no stream to reset, so the subscriber resets these."""

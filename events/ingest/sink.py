"""The seam between the wire and whatever consumes it (the index).

``events/`` knows nothing about the index: it hands ordered, de-duplicated batches to a
:class:`BatchSink`. The indexer implements the sink; tests implement it with a list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.scanned import ScannedBatch
from kvindex.events.wire.vllm import EventBatch


@dataclass(slots=True)
class Delivery:
    """One batch, or a run of consecutive batches, in stream order, ready to apply.

    ``seq`` is the engine's sequence number (the first one's when ``batches`` > 1: the
    delivery holds seqs ``seq`` .. :attr:`last_seq`); within a stream, deliveries arrive
    with strictly increasing, non-overlapping seqs (duplicates from replay are already
    dropped). ``batch`` is an EventBatch, or a ScannedBatch standing in for one or for
    ``batches`` consecutive ones (:meth:`ScannedBatch.merge`: their events in order, ``ts``
    the last one's); its ``events`` are decoded on first use, and
    :mod:`kvindex.events.wire.runs` reads either without decoding them. Applying a delivery of
    several batches must leave what applying them one by one leaves.
    """

    stream: StreamId
    model: str
    seq: int
    batch: EventBatch | ScannedBatch
    received_at: float
    replayed: bool = False
    batches: int = 1

    @property
    def last_seq(self) -> int:
        return self.seq + self.batches - 1

    def split(self) -> list[Delivery]:
        """One Delivery per engine batch (itself when it holds one)."""
        if self.batches == 1:
            return [self]
        parts = self.batch.parts()  # type: ignore[union-attr]  # only a ScannedBatch merges
        return [
            Delivery(self.stream, self.model, self.seq + i, part, self.received_at, self.replayed)
            for i, part in enumerate(parts)
        ]


class BatchSink(Protocol):
    """Receives every stream's batches in order; called from one thread only."""

    def deliver(self, deliveries: Sequence[Delivery]) -> None:
        """Apply these batches, in the order given."""

    def reset(self, stream: StreamId, reason: str) -> None:
        """Forget everything this stream's engine holds.

        Called before the first batch after an engine restart (``seq`` went backwards),
        and when a pod is removed (``reason`` says which).
        """

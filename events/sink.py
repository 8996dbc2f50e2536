"""The seam between the wire and whatever consumes it (the index).

``events/`` knows nothing about the index: it hands ordered, de-duplicated batches to a
:class:`BatchSink`. The indexer implements the sink; tests implement it with a list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvindex.events.identity import StreamId
from kvindex.events.scanned import ScannedBatch
from kvindex.events.wire import EventBatch


@dataclass(slots=True)
class Delivery:
    """One batch, in stream order, ready to apply.

    ``seq`` is the engine's sequence number; within a stream, deliveries arrive with
    strictly increasing ``seq`` (duplicates from replay are already dropped). ``batch``
    is an EventBatch, or a ScannedBatch standing in for one (its ``events`` are decoded
    on first use; :mod:`kvindex.events.runs` reads either without decoding them).
    """

    stream: StreamId
    model: str
    seq: int
    batch: EventBatch | ScannedBatch
    received_at: float
    replayed: bool = False


class BatchSink(Protocol):
    """Receives every stream's batches in order; called from one thread only."""

    def deliver(self, deliveries: Sequence[Delivery]) -> None:
        """Apply these batches, in the order given."""

    def reset(self, stream: StreamId, reason: str) -> None:
        """Forget everything this stream's engine holds.

        Called before the first batch after an engine restart (``seq`` went backwards),
        and when a pod is removed (``reason`` says which).
        """

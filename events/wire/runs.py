"""A batch as runs of like events: the form the ingest path consumes.

An engine's batch is mostly a row of events that differ only in their hashes (one
scheduler step stores blocks for several requests, on one medium, in one KV-cache
group). Consumers that treat such events alike - the indexer decides where an event
goes from its tag, medium, group, spec and locality, and whether it starts a chain -
can do that once per run and take the run's hashes as one ``uint64`` buffer, instead
of paying Python per event and per hash.

:func:`runs_of` gives every batch in that form: a
:class:`~kvindex.events.wire.scanned.ScannedBatch` already is (the compiled scanner built
it); an :class:`~kvindex.events.wire.vllm.EventBatch` (decoded by msgspec, or built in a
test) is grouped here, with the same result for the same payload
(``tests/test_events_scan.py``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NamedTuple

from kvindex.events.wire.scanned import ScannedBatch
from kvindex.events.wire.vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    hashes_to_ints,
)

#: Run tags.
STORED, REMOVED, CLEARED = 0, 1, 2
TAG_NAMES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class Run(NamedTuple):
    """Consecutive events of one batch that are alike in every field below.

    ``first`` and ``count``: the events' positions in the batch; ``start`` and
    ``stop``: their hashes' positions in the batch's hash buffer. ``parent_none``: a
    BlockStored with no parent (the start of a chain). ``block_size``: a BlockStored's
    ``block_size``, or 0 when its token ids were decoded and are empty (raw token ids,
    as received off the wire, always count as carried). The rest are the events' own
    fields; None where the event type has none (BlockRemoved: ``block_size``,
    ``kind``, ``window``; AllBlocksCleared: all).
    """

    tag: int
    first: int
    count: int
    start: int
    stop: int
    parent_none: bool
    block_size: int | None
    medium: str | None
    group_idx: int | None
    kind: str | None
    window: int | None
    locality: str | None


class BatchRuns(NamedTuple):
    """A batch's runs (plain tuples with :class:`Run`'s fields, or Runs) and its block
    hashes as native ``uint64`` bytes."""

    runs: Sequence[tuple]
    hashes: bytes | memoryview


def runs_of(batch: EventBatch | ScannedBatch) -> BatchRuns:
    """The batch as runs; raises ValueError for a hash outside ``[0, 2**64)`` (possible
    only in a batch built in-process: the wire cannot carry one)."""
    if type(batch) is ScannedBatch:
        return (batch.runs, batch.hashes)  # type: ignore[return-value]  # a BatchRuns
    runs: list[Run] = []
    hashes = array("Q")
    last: tuple | None = None
    for index, event in enumerate(batch.events):
        key = _key(event)
        if key is None:
            continue  # not an event (a batch built in-process): nothing to index
        start = len(hashes)
        block_hashes = getattr(event, "block_hashes", ())
        try:
            hashes.extend(hashes_to_ints(block_hashes))
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"block hashes must be integers in [0, 2**64): {exc}") from None
        if key == last:
            runs[-1] = runs[-1]._replace(count=runs[-1].count + 1, stop=len(hashes))
        else:
            runs.append(Run(key[0], index, 1, start, len(hashes), *key[1:]))
            last = key
    return BatchRuns(runs, memoryview(hashes).cast("B"))


def _key(event: Event) -> tuple | None:
    if isinstance(event, BlockStored):
        return (
            STORED,
            event.parent_block_hash is None,
            event.block_size if event.token_ids else 0,
            event.medium,
            event.group_idx,
            event.kv_cache_spec_kind,
            event.kv_cache_spec_sliding_window,
            event.locality,
        )
    if isinstance(event, BlockRemoved):
        return (REMOVED, False, None, event.medium, event.group_idx, None, None, event.locality)
    if isinstance(event, AllBlocksCleared):
        return (CLEARED, False, None, None, None, None, None, None)
    return None


def event_at(batch: EventBatch | ScannedBatch, index: int) -> Event:
    """One event of the batch (a ScannedBatch decodes just that one)."""
    if type(batch) is ScannedBatch:
        return batch.event(index)
    return batch.events[index]


def event_count(batch: EventBatch | ScannedBatch) -> int:
    if type(batch) is ScannedBatch:
        return batch.n_events
    return len(batch.events)


def tag_counts(batch: EventBatch | ScannedBatch) -> tuple[int, int, int]:
    """How many BlockStored, BlockRemoved and AllBlocksCleared events the batch holds,
    without decoding a ScannedBatch's events."""
    counts = [0, 0, 0]
    if type(batch) is ScannedBatch:
        for run in batch.runs:
            counts[run[0]] += run[2]
    else:
        for event in batch.events:
            if isinstance(event, BlockStored):
                counts[STORED] += 1
            elif isinstance(event, BlockRemoved):
                counts[REMOVED] += 1
            elif isinstance(event, AllBlocksCleared):
                counts[CLEARED] += 1
    return counts[0], counts[1], counts[2]

"""The applier's fast path: a stream's messages that apply in order, as one delivery.

Most of the time a stream's turn is simply its next messages, in order, each one what the
stream expects next: the sequence check, the delivery, the ingestor's pass over the
batch's runs and the backend's apply then cost the same for a run of them as for one.
:func:`in_order_end` finds such a run and :func:`apply_run` applies it as one
:class:`~kvindex.events.ingest.sink.Delivery` of its merged batches, recording what the applier's
message-by-message loop would have recorded. Anything else (a gap, a restart, a first
contact, a silence to verify, a batch msgspec decoded) takes that loop.
"""

from __future__ import annotations

import itertools

from kvindex.events.ingest.receiver import Arrival
from kvindex.events.ingest.sink import Delivery
from kvindex.events.ingest.stream import Stream
from kvindex.events.wire.scanned import ScannedBatch

#: A turn's messages; the flag says whether the tracker already recorded them as live.
Work = list[tuple[Arrival, bool]]


def in_order_end(stream: Stream, work: Work, i: int, silence_s: float) -> int:
    """Where the run of messages from ``work[i]`` that apply in order ends: live (not yet
    classified), decodable by the scanner, for one model, none after a silence of
    ``silence_s`` (which asks for a verification). ``i`` when there is none."""
    arrival = work[i][0]
    if stream.recovery.unverified or not stream.tracker.applies_live(arrival.seq):
        return i  # a gap, a restart, a first contact...: the loop decides
    seq, model, last_at = arrival.seq, arrival.model, stream.last_live_at
    layout = None  # of the batches with events: one per delivery
    end = i
    for arrival, observed in itertools.islice(work, i, None):
        decoded = arrival.decoded
        if (
            observed
            or arrival.seq != seq
            or decoded is None
            or type(decoded.batch) is not ScannedBatch
            or arrival.model != model
            or (last_at is not None and arrival.received_at - last_at >= silence_s)
        ):
            break
        if decoded.batch.n_events:
            if layout is None:
                layout = decoded.layout
            elif decoded.layout is not layout:
                break
        last_at = arrival.received_at
        seq += arrival.batches
        end += 1
    return end


def apply_run(stream: Stream, work: Work, i: int, end: int, pending: list[Delivery]) -> None:
    """Record ``work[i:end]`` (see :func:`in_order_end`) as applied and queue it in
    ``pending`` as one delivery."""
    arrivals = [arrival for arrival, _ in itertools.islice(work, i, end)]
    first, last = arrivals[0], arrivals[-1]
    count = sum(arrival.batches for arrival in arrivals)
    last_seq = first.seq + count - 1
    stream.tracker.live_run(first.seq, count)
    stream.last_live_at = last.received_at
    stream.recovery.pending_anchor = (last_seq, last.payload)
    parts = [arrival.decoded.batch for arrival in arrivals]  # type: ignore[union-attr]
    batch = parts[0] if len(parts) == 1 else ScannedBatch.merge(parts)
    if batch.n_events:
        stream.layout = batch.layout
    pending.append(
        Delivery(stream.sid, first.model, first.seq, batch, first.received_at, False, count)
    )

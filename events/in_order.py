"""The applier's fast path: a stream's messages that apply in order, as one delivery.

Most of the time a stream's turn (up to ``batches_per_turn`` messages) is simply its next
messages, in order, each one what the stream expects next: the sequence check, the
delivery, the ingestor's pass over the batch's runs and the backend's apply then cost
the same for a run of them as for one. :meth:`InOrderRuns._in_order` finds such a run,
and :meth:`InOrderRuns._apply_run` applies it as one :class:`~kvindex.events.sink.Delivery`
of its batches (:meth:`~kvindex.events.scanned.ScannedBatch.merge`), recording what the
message-by-message loop of :meth:`~kvindex.events.applier.Applier._process` would have
recorded. Anything else (a gap, a restart, a first contact, a silence to verify, a
batch msgspec decoded) takes that loop. A mixin of :class:`~kvindex.events.applier.Applier`,
on the applier thread.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from kvindex.events.receiver import Arrival
from kvindex.events.scanned import ScannedBatch
from kvindex.events.sink import Delivery
from kvindex.events.stream import Stream

if TYPE_CHECKING:
    from kvindex.events.applier import Applier

#: A turn's messages; the flag says whether the tracker already recorded them as live.
Work = list[tuple[Arrival, bool]]


class InOrderRuns:
    """The fast path (module docstring): a mixin of the applier, on its thread."""

    def _in_order(self: Applier, stream: Stream, work: Work, i: int) -> int:
        """Where the run of messages from ``work[i]`` that apply in order, one after
        another, ends: live (not yet classified), decodable by the scanner, for one
        model, none after a silence that asks for a verification. What the loop in
        :meth:`_process` would apply one by one, :meth:`_apply_run` applies as one
        delivery; anything else takes that loop."""
        arrival = work[i][0]
        if stream.recovery.unverified or not stream.tracker.applies_live(arrival.seq):
            return i  # a gap, a restart, a first contact...: the loop decides
        seq, model, last_at = arrival.seq, arrival.model, stream.last_live_at
        silence_s = self._config.verify_after_silence_s
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

    def _apply_run(
        self: Applier, stream: Stream, work: Work, i: int, end: int, pending: list[Delivery]
    ) -> None:
        """Apply ``work[i:end]`` (see :meth:`_in_order`) as one delivery."""
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

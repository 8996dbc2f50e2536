"""The applier's one inbox: per-stream lanes of messages plus a queue of commands.

Every other thread talks to the applier only through here. The receiver appends each
message to its stream's *lane* (bounded: when full the newest message is dropped and the
highest dropped seq remembered, so replay can fetch it later); replay workers and
control calls (``forget_pod``, ``connect``) post *commands*. The applier waits on one
condition for either. A lane per stream, rather than one shared FIFO, is what keeps a
flooding pod from crowding every other pod's messages out of a bounded queue.

The lane's counters (received, overflows, last arrival) are written here, under the
inbox lock, by the receiver; the stream state the applier derives from messages is the
applier's alone (:mod:`kvindex.events.ingest.stream`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from kvindex.events.ingest.receiver import Arrival
from kvindex.events.ingest.status import ReasonCounts
from kvindex.events.wire.identity import StreamId


class Lane:
    """One stream's waiting messages and what the receiver counted for it.

    An Arrival may stand for several consecutive messages (``Arrival.batches``); the
    lane's length and capacity count messages."""

    __slots__ = (
        "dropped_until",
        "last_received_at",
        "nbytes",
        "overflows",
        "queue",
        "queued",
        "received",
        "sid",
    )

    def __init__(self, sid: StreamId) -> None:
        self.sid = sid
        self.queue: collections.deque[Arrival] = collections.deque()
        self.queued = 0  # messages in the queue
        self.nbytes = 0  # what they hold (Arrival.nbytes)
        self.received = 0
        self.overflows = 0
        self.dropped_until: int | None = None  # highest seq dropped by overflow
        self.last_received_at: float | None = None

    def __len__(self) -> int:
        return self.queued


class Inbox:
    """Lanes and commands, under one condition.

    ``capacity`` bounds each lane's messages. ``budget`` bounds what all lanes' messages
    hold together (bytes, :attr:`Arrival.nbytes`): past it, a message is dropped only
    from a lane holding more than its share (the budget over the lanes with messages
    waiting), so a flooding pod cannot crowd the others out; all of them together stay
    under twice the budget. ``max_lanes`` bounds how many lanes may exist (the applier
    admits or refuses every new one; this cap only bounds memory while it has not looked
    yet). ``on_overflow(sid, capacity)`` and ``on_refused(sid)`` are called outside the
    lock for logging and counting.
    """

    def __init__(
        self,
        capacity: int,
        max_lanes: int,
        errors: ReasonCounts,
        on_overflow: Callable[[StreamId, int], None],
        on_refused: Callable[[StreamId], None],
        budget: int = 1 << 62,
    ) -> None:
        self.capacity = capacity
        self.budget = budget
        self._bytes = 0  # every lane's nbytes
        self._busy = 0  # lanes with messages waiting
        self._max_lanes = max_lanes
        self._errors = errors
        self._on_overflow = on_overflow
        self._on_refused = on_refused
        self._cond = threading.Condition()
        self._lanes: dict[StreamId, Lane] = {}
        self._touched: dict[StreamId, None] = {}  # an ordered set: lanes with new messages
        self._commands: list[object] = []
        self._waiting = False
        self._stopping = False

    # -- producers (receiver, replay workers, control calls) ---------------------------

    def put_arrivals(self, arrivals: list[Arrival]) -> None:
        """Append each message to its stream's lane (receiver thread)."""
        overflowed: list[tuple[StreamId, int]] = []
        refused: list[StreamId] = []
        capacity = self.capacity
        with self._cond:
            lanes = self._lanes
            for arrival in arrivals:
                sid = arrival.stream
                lane = lanes.get(sid)
                if lane is None:
                    if len(lanes) >= self._max_lanes:
                        refused.append(sid)
                        continue
                    lane = lanes[sid] = Lane(sid)
                count = arrival.batches
                lane.received += count
                lane.last_received_at = arrival.received_at
                size = arrival.nbytes
                if self._fits(lane, count, size):
                    self._queue(lane, arrival, count, size)
                    self._touched[sid] = None
                    continue
                # Keep the oldest messages that fit, drop the newest: the queue stays
                # contiguous and the gap is recovered by replay.
                dropped = 0
                for one in arrival.split():
                    size = one.nbytes
                    if not dropped and self._fits(lane, 1, size):
                        self._queue(lane, one, 1, size)
                        self._touched[sid] = None
                        continue
                    dropped += 1
                    if lane.dropped_until is None or one.seq > lane.dropped_until:
                        lane.dropped_until = one.seq
                lane.overflows += dropped
                overflowed.append((sid, dropped))
            if self._waiting:
                self._cond.notify()
        for sid, dropped in overflowed:
            self._errors.add("queue_overflow", dropped)
            self._on_overflow(sid, capacity)
        for sid in refused:
            self._errors.add("too_many_streams")
            self._on_refused(sid)

    def _fits(self, lane: Lane, count: int, size: int) -> bool:
        if lane.queued + count > self.capacity:
            return False
        if self._bytes + size <= self.budget:
            return True
        share = self.budget // (self._busy + (lane.queued == 0))
        return lane.nbytes + size <= share

    def _queue(self, lane: Lane, arrival: Arrival, count: int, size: int) -> None:
        if not lane.queued:
            self._busy += 1
        lane.queue.append(arrival)
        lane.queued += count
        lane.nbytes += size
        self._bytes += size

    def _taken(self, lane: Lane, count: int, size: int) -> None:
        lane.queued -= count
        lane.nbytes -= size
        self._bytes -= size
        if count and not lane.queued:
            self._busy -= 1

    @property
    def queued_bytes(self) -> int:
        """What every lane's messages hold, together."""
        return self._bytes

    def post(self, command: object) -> None:
        """Queue a command for the applier (any thread)."""
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # -- the applier -------------------------------------------------------------------

    def wait(self, timeout_s: float) -> tuple[list[object], list[StreamId]] | None:
        """Commands and lanes with new messages since the last call, after waiting up to
        ``timeout_s`` for any; None once stopping."""
        with self._cond:
            if not self._stopping and not self._commands and not self._touched and timeout_s > 0:
                self._waiting = True
                self._cond.wait(timeout_s)
                self._waiting = False
            if self._stopping:
                return None
            commands, self._commands = self._commands, []
            touched = list(self._touched)
            self._touched.clear()
        return commands, touched

    def drain_commands(self) -> list[object]:
        with self._cond:
            commands, self._commands = self._commands, []
        return commands

    def lane(self, sid: StreamId) -> Lane | None:
        with self._cond:
            return self._lanes.get(sid)

    def open(self, sid: StreamId) -> Lane:
        """``sid``'s lane, opened before its first message (a configured pod's stream)."""
        with self._cond:
            lane = self._lanes.get(sid)
            if lane is None:
                lane = self._lanes[sid] = Lane(sid)
            return lane

    def peek(self, lane: Lane) -> Arrival | None:
        with self._cond:
            return lane.queue[0] if lane.queue else None

    def pop(self, lane: Lane, n: int) -> list[Arrival]:
        """The lane's oldest arrivals, up to ``n`` messages (at least one arrival)."""
        with self._cond:
            queue = lane.queue
            taken: list[Arrival] = []
            count = size = 0
            while queue and (not taken or count + queue[0].batches <= n):
                arrival = queue.popleft()
                count += arrival.batches
                size += arrival.nbytes
                taken.append(arrival)
            self._taken(lane, count, size)
            return taken

    def take_all(self, lane: Lane) -> list[Arrival]:
        """Every waiting message, one Arrival each; also forgets the dropped range (the
        caller owns it)."""
        with self._cond:
            taken = list(lane.queue)
            lane.queue.clear()
            self._taken(lane, lane.queued, lane.nbytes)
            lane.dropped_until = None
        return [one for arrival in taken for one in arrival.split()]

    def take_dropped(self, lane: Lane) -> int | None:
        """The highest seq overflow dropped, once the lane has drained (then forgotten)."""
        with self._cond:
            dropped = lane.dropped_until
            if dropped is None or lane.queue:
                return None
            lane.dropped_until = None
        return dropped

    def peek_dropped(self, lane: Lane) -> int | None:
        with self._cond:
            return lane.dropped_until

    def set_dropped(self, lane: Lane, seq: int | None) -> None:
        with self._cond:
            lane.dropped_until = seq

    def close(self, sid: StreamId) -> Lane | None:
        """Remove a lane (its stream is gone or refused); return it, messages and all."""
        with self._cond:
            self._touched.pop(sid, None)
            lane = self._lanes.pop(sid, None)
            if lane is not None:  # its messages go with it (the caller counts them)
                self._bytes -= lane.nbytes
                self._busy -= lane.queued > 0
            return lane

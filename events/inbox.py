"""The applier's one inbox: per-stream lanes of messages plus a queue of commands.

Every other thread talks to the applier only through here. The receiver appends each
message to its stream's *lane* (bounded: when full the newest message is dropped and the
highest dropped seq remembered, so replay can fetch it later); replay workers and
control calls (``forget_pod``, ``connect``) post *commands*. The applier waits on one
condition for either. A lane per stream, rather than one shared FIFO, is what keeps a
flooding pod from crowding every other pod's messages out of a bounded queue.

The lane's counters (received, overflows, last arrival) are written here, under the
inbox lock, by the receiver; the stream state the applier derives from messages is the
applier's alone (:mod:`kvindex.events.stream`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from kvindex.events.identity import StreamId
from kvindex.events.receiver import Arrival
from kvindex.events.status import ReasonCounts


class Lane:
    """One stream's waiting messages and what the receiver counted for it.

    An Arrival may stand for several consecutive messages (``Arrival.batches``); the
    lane's length and capacity count messages."""

    __slots__ = (
        "dropped_until",
        "last_received_at",
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
        self.received = 0
        self.overflows = 0
        self.dropped_until: int | None = None  # highest seq dropped by overflow
        self.last_received_at: float | None = None

    def __len__(self) -> int:
        return self.queued


class Inbox:
    """Lanes and commands, under one condition.

    ``capacity`` bounds each lane; ``max_lanes`` bounds how many lanes may exist (the
    applier admits or refuses every new one; this cap only bounds memory while it has
    not looked yet). ``on_overflow(sid, capacity)`` and ``on_refused(sid)`` are called
    outside the lock for logging and counting.
    """

    def __init__(
        self,
        capacity: int,
        max_lanes: int,
        errors: ReasonCounts,
        on_overflow: Callable[[StreamId, int], None],
        on_refused: Callable[[StreamId], None],
    ) -> None:
        self.capacity = capacity
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
                room = capacity - lane.queued
                if count > room:
                    # Keep the oldest messages that fit, drop the newest: the queue stays
                    # contiguous and the gap is recovered by replay.
                    last = arrival.seq + count - 1
                    lane.overflows += count - max(room, 0)
                    if lane.dropped_until is None or last > lane.dropped_until:
                        lane.dropped_until = last
                    overflowed.append((sid, count - max(room, 0)))
                    if room <= 0:
                        continue
                    kept = arrival.split()[:room]
                    lane.queue.extend(kept)
                    lane.queued += room
                else:
                    lane.queue.append(arrival)
                    lane.queued += count
                self._touched[sid] = None
            if self._waiting:
                self._cond.notify()
        for sid, dropped in overflowed:
            self._errors.add("queue_overflow", dropped)
            self._on_overflow(sid, capacity)
        for sid in refused:
            self._errors.add("too_many_streams")
            self._on_refused(sid)

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

    def peek(self, lane: Lane) -> Arrival | None:
        with self._cond:
            return lane.queue[0] if lane.queue else None

    def pop(self, lane: Lane, n: int) -> list[Arrival]:
        """The lane's oldest arrivals, up to ``n`` messages (at least one arrival)."""
        with self._cond:
            queue = lane.queue
            taken: list[Arrival] = []
            count = 0
            while queue and (not taken or count + queue[0].batches <= n):
                arrival = queue.popleft()
                count += arrival.batches
                taken.append(arrival)
            lane.queued -= count
            return taken

    def take_all(self, lane: Lane) -> list[Arrival]:
        """Every waiting message, one Arrival each; also forgets the dropped range (the
        caller owns it)."""
        with self._cond:
            taken = list(lane.queue)
            lane.queue.clear()
            lane.queued = 0
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
            return self._lanes.pop(sid, None)

"""What the subscriber keeps about one engine stream, as plain data.

A :class:`Stream` is owned by the applier thread: only that thread writes it. Other
threads (``Subscriber.streams()`` for /index/pods and metrics) may read its fields for a
status snapshot, which can then be a few batches stale but is never written from there.
Messages reach the applier through the stream's :class:`~kvindex.events.ingest.inbox.Lane`,
replay results and control calls through the inbox's command queue.

Everything a recovery decision depends on that belongs to *one engine incarnation* (the
replay in flight, the replay cooldown, retry backoff, undelivered ranges, loss marks,
the last applied batch) lives in :class:`Recovery`, which is replaced as a whole when the
engine restarts: a new engine never inherits its predecessor's cooldown or gaps.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field

from kvindex.events.ingest.inbox import Lane
from kvindex.events.ingest.receiver import Arrival
from kvindex.events.ingest.recovery import Anchor
from kvindex.events.ingest.sequence import SequenceTracker
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.vllm import Layout


class JobKind(enum.Enum):
    """Why a replay runs; decides what an unfillable range means."""

    #: Batches went missing mid-stream: unfillable ones are lost (``gapped``).
    GAP = "gap"
    #: First contact or after a restart: seqs before the engine's buffer are history
    #: this index lacks (``incomplete``), not a loss kvindex caused.
    CATCH_UP = "catch_up"
    #: Prove the incarnation (after a reconnect): only the anchor is needed.
    VERIFY = "verify"
    #: A new owner resumes after the position the gate stored (a takeover, a restored
    #: snapshot): unverifiable or unfillable means ``incomplete``, not a restart.
    RESUME = "resume"
    #: A replay found the engine restarted and no live batch of the new one waits:
    #: fetch whatever it buffers; nothing in particular is owed, but history before its
    #: buffer (or a fetch that failed) is ``incomplete``.
    RESTARTED = "restarted"
    #: A configured pod not heard from since kvindex started (``unheard``): fetch
    #: whatever it buffers, from seq 0, so its engine proves what it holds without
    #: waiting for its next batch. History before its buffer is ``incomplete``; a fetch
    #: that failed leaves it ``unheard``.
    PROVE = "prove"


@dataclass(frozen=True, slots=True, eq=False)
class ReplayJob:
    """One replay fetch: every buffered batch from ``start`` on, needed up to
    ``need_until``. ``anchor`` (when set, at seq ``start``) is the batch this stream
    applied last, whose digest the reply must repeat to prove the same incarnation."""

    stream: Stream
    start: int
    need_until: int
    kind: JobKind
    anchor: Anchor | None = None


@dataclass(slots=True)
class Recovery:
    """Per-incarnation recovery state of a stream (reset with the engine)."""

    #: The replay whose result is awaited (None: none in flight).
    replay_job: ReplayJob | None = None
    #: Until then gaps are declared lost at once: the replay endpoint failed recently.
    cooldown_until: float = 0.0
    #: Paused until then (sink failure backoff, gate unknown); None: not paused.
    stalled_until: float | None = None
    #: Last seq of a failed delivery: fetched again by replay at the retry.
    resync_until: int | None = None
    backoff: float = 0.0
    #: Batches were lost mid-stream (state ``gapped``).
    gapped: bool = False
    #: History this index lacks that cannot be fetched (state ``incomplete``).
    incomplete: bool = False
    #: The highest seq covered by a loss mark: an AllBlocksCleared after it clears them.
    lost_through: int = -1
    #: The position is not proven to belong to the engine now publishing: verify it
    #: (replay the anchor) before reporting the stream live.
    unverified: bool = False
    #: The last batch delivered (or consumed) by the sink: the incarnation check.
    anchor: Anchor | None = None
    #: ``(seq, payload)`` of the last batch applied in the turn being delivered (becomes
    #: ``anchor`` once the delivery succeeded; a tuple, not an Anchor: once per batch).
    pending_anchor: tuple[int, bytes] | None = None

    @property
    def blocked(self) -> bool:
        return self.replay_job is not None or self.stalled_until is not None


#: The per-stream counters, summed by ``Subscriber.totals``.
COUNTERS = (
    "received",
    "delivered",
    "duplicates",
    "gaps",
    "missed_batches",
    "replays_ok",
    "replays_failed",
    "restarts",
    "queue_overflows",
    "decode_errors",
    "sink_errors",
    "not_owner",
)


@dataclass(slots=True, eq=False)
class Stream:
    """One engine stream (a pod's data-parallel rank) as the applier tracks it."""

    sid: StreamId
    lane: Lane
    model: str
    replay_endpoint: str | None
    #: The topic its live messages carry (replies of vLLM >= 0.26 must carry it too).
    topic: bytes | None = None
    #: Its pod is configured (connect mode) or discovered: never evicted for idling.
    pinned: bool = False
    #: Whether anything of its engine reached kvindex since it started: a live batch
    #: or a clean replay. A stream opened for a configured pod before either is
    #: ``unheard``: its engine may hold a warm cache the index knows nothing of.
    heard: bool = True
    #: Messages taken from the lane that must wait (for a replay, a retry); the flag
    #: says whether the tracker already recorded them as received live.
    held: collections.deque[tuple[Arrival, bool]] = field(default_factory=collections.deque)
    tracker: SequenceTracker = field(default_factory=SequenceTracker)
    layout: Layout = Layout.ARRAY
    recovery: Recovery = field(default_factory=Recovery)
    first_seq: int | None = None
    last_seq: int = -1
    last_batch_ts: float | None = None
    #: When the last live message the applier took was received (silence detection).
    last_live_at: float | None = None
    created_at: float = 0.0
    delivered: int = 0
    duplicates: int = 0
    gaps: int = 0
    missed_batches: int = 0
    replays_ok: int = 0
    replays_failed: int = 0
    restarts: int = 0
    decode_errors: int = 0
    sink_errors: int = 0
    not_owner: int = 0
    # With a gate: the epoch this replica owns the stream under (None: not owned),
    # whether another replica applies it, and the last seq seen meanwhile.
    epoch: int | None = None
    standby: bool = False
    standby_seq: int | None = None
    #: (epoch, state) last told to the gate's ``settled``.
    settled: tuple[int, str] | None = None

    @property
    def received(self) -> int:
        return self.lane.received

    @property
    def queue_overflows(self) -> int:
        return self.lane.overflows

    @property
    def last_received_at(self) -> float | None:
        return self.lane.last_received_at

    @property
    def last_active_at(self) -> float:
        last = self.lane.last_received_at
        return self.created_at if last is None else last

    @property
    def blocked(self) -> bool:
        return self.recovery.blocked

    @property
    def state(self) -> str:
        """``standby``, ``verifying``, ``replaying``, ``unheard``, ``resync``,
        ``gapped``, ``incomplete`` or ``live`` (see StreamStatus)."""
        rec = self.recovery
        if self.standby:
            return "standby"
        job = rec.replay_job
        if job is not None:
            return "verifying" if job.anchor is not None else "replaying"
        if not self.heard:
            return "unheard"
        if rec.stalled_until is not None:
            return "resync"
        if rec.gapped:
            return "gapped"
        if rec.incomplete:
            return "incomplete"
        if rec.unverified:
            return "verifying"
        return "live"

    def fresh_recovery(self) -> None:
        """A new engine incarnation: nothing of the old one's recovery state applies."""
        self.recovery = Recovery()

"""Stream ownership under a :class:`~kvindex.events.gate.StreamGate`, as decisions.

With several replicas sharing one index the applier asks the gate before applying a
stream. What it then does is decided here, without I/O:

* **owned under the epoch it knows**: go on;
* **owned under a new epoch** (just acquired, or re-acquired after the lease lapsed):
  local sequence state is not trusted (another replica may have applied batches in
  between); resume after the seq the gate says was applied last
  (:func:`plan_takeover`), fetching by replay what went by meanwhile. When the gate
  also stored that batch's digest, the replay starts *at* that seq and must repeat the
  digest: a mismatch is a restart (reset), an engine that no longer has it leaves the
  stream ``incomplete`` (its entries are kept, but not reported complete). A
  **rebuild** (the shared index lost the stream's entries) owes the whole history:
  caught up from the engine's first buffered batch, ``incomplete`` without a replay;
* **not owned**: another replica applies it; drop its batches (counted ``not_owner``),
  remember the last seq seen, stand by;
* **unknown** (the gate's store is unreachable): keep everything queued, apply
  nothing, ask again shortly.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvindex.events.gate import Claim, Ownership, StreamGate
from kvindex.events.receiver import Arrival
from kvindex.events.recovery import Anchor
from kvindex.events.stream import JobKind, Stream

if TYPE_CHECKING:
    from kvindex.events.applier import Applier

log = logging.getLogger("kvindex.events.subscriber")

#: How often ownership is re-checked for every stream (the gate answers from memory).
_OWNERSHIP_CHECK_S = 0.5
#: How soon a stream whose ownership is unknown asks the gate again.
_GATE_RETRY_S = 0.1


class Step(enum.Enum):
    KEEP = "keep"
    TAKE_OVER = "take_over"
    STAND_BY = "stand_by"
    WAIT = "wait"


def ownership_step(claim: Claim, epoch: int | None) -> Step:
    """What the applier does with a stream it knows under ``epoch``, given ``claim``."""
    if claim.ownership is Ownership.OWNED:
        return Step.KEEP if claim.epoch == epoch else Step.TAKE_OVER
    if claim.ownership is Ownership.NOT_OWNED:
        return Step.STAND_BY
    return Step.WAIT


@dataclass(frozen=True, slots=True)
class TakeoverPlan:
    """How a stream resumes under a new owner.

    ``expected`` / ``highest_live``: the sequence tracker's new position. ``replay``:
    ``(start, need_until)`` to fetch, of ``kind``; ``anchored`` when its first batch must
    repeat the gate's digest. ``lost`` batches are declared lost (no replay possible),
    then the tracker skips to ``skip_to``. ``incomplete_through``: the stored position
    cannot be verified; the stream is ``incomplete`` up to there. ``dropped_until``: the
    newest seq seen beyond the waiting messages, fetched once they are applied.
    """

    expected: int | None
    highest_live: int | None
    replay: tuple[int, int] | None = None
    kind: JobKind | None = None
    anchored: bool = False
    lost: int = 0
    skip_to: int | None = None
    incomplete_through: int | None = None
    dropped_until: int | None = None


def plan_takeover(
    after: int | None,
    digest: bytes | None,
    seen: int | None,
    last_waiting: int | None,
    can_replay: bool,
    rebuild: bool = False,
) -> TakeoverPlan:
    """Plan a takeover that resumes after ``after`` (None: nothing stored, catch up from
    the engine's first buffered batch) with the stored batch's ``digest`` (None: not
    stored). ``seen`` is the newest seq this replica knows the engine published;
    ``last_waiting`` the newest of the live messages still waiting to be applied.
    ``rebuild``: the index lost everything up to ``seen``, so history that cannot be
    fetched is ``incomplete`` (waiting messages catch up on first contact)."""
    highest: int | None = None
    if after is not None or seen is not None:
        highest = max(-1 if after is None else after, -1 if seen is None else seen)
    expected = None if after is None else after + 1
    incomplete: int | None = None
    if after is not None and digest is not None:
        if can_replay:
            until = after if seen is None else max(after, seen)
            return TakeoverPlan(expected, highest, (after, until), JobKind.RESUME, anchored=True)
        incomplete = after  # the stored position cannot be proven to be this engine's
    dropped = None
    if last_waiting is not None and seen is not None and seen > last_waiting:
        dropped = seen  # fetched once the waiting messages are applied
    if seen is None or (after is not None and seen <= after) or last_waiting is not None:
        return TakeoverPlan(expected, highest, incomplete_through=incomplete, dropped_until=dropped)
    if can_replay:
        if after is None:
            return TakeoverPlan(expected, highest, (0, seen), JobKind.CATCH_UP)
        return TakeoverPlan(
            expected, highest, (after + 1, seen), JobKind.GAP, incomplete_through=incomplete
        )
    if after is None:
        return TakeoverPlan(expected, highest, incomplete_through=seen if rebuild else None)
    return TakeoverPlan(
        expected, highest, lost=seen - after, skip_to=seen + 1, incomplete_through=incomplete
    )


class OwnershipHandling:
    """The applier's side of the gate: acts on :func:`ownership_step` and
    :func:`plan_takeover`. A mixin of :class:`~kvindex.events.applier.Applier` (it
    works on the applier's stream table, on the applier thread)."""

    _gate: StreamGate | None
    _ownership_check_at: float

    def _owns(self: Applier, stream: Stream) -> bool:
        """Whether this replica may apply ``stream`` now, acting on any change."""
        gate = self._gate
        if gate is None:
            return True
        claim = gate.claim(stream.sid)
        step = ownership_step(claim, stream.epoch)
        if step is Step.KEEP:
            return True
        if step is Step.TAKE_OVER:
            self._take_over(stream, claim)
            return True
        if step is Step.STAND_BY:
            self._stand_by(stream)
        else:
            self._wait_for_gate(stream)
        return False

    def _check_ownership(self: Applier) -> None:
        """Every ``_OWNERSHIP_CHECK_S``: act on ownership changes of idle streams too,
        so a takeover replays what the previous owner missed without waiting for the
        pod's next batch, and a replica that lost a stream stops at once."""
        if self._gate is None:
            return
        now = self._clock()
        if now < self._ownership_check_at:
            return
        self._ownership_check_at = now + _OWNERSHIP_CHECK_S
        for stream in list(self._streams.values()):
            if stream.recovery.stalled_until is None or stream.standby:
                self._guarded(stream, self._owns)

    def _waiting(self: Applier, stream: Stream) -> list[Arrival]:
        """Every message of the stream not applied yet, oldest first; taken out."""
        arrivals = [a for a, _ in stream.held]
        stream.held.clear()
        arrivals.extend(self._inbox.take_all(stream.lane))
        self._ready.pop(stream.sid, None)
        return arrivals

    def _stand_by(self: Applier, stream: Stream) -> None:
        """Another replica applies this stream: drop what is queued, remember the last
        seq seen (a later takeover replays from the owner's position up to it)."""
        arrivals = self._waiting(stream)
        if arrivals:
            # the newest (of equal stamps the last: messages received as one group)
            stream.standby_seq = max(reversed(arrivals), key=lambda a: a.received_at).seq
            stream.not_owner += len(arrivals)
            self._errors.add("not_owner", len(arrivals))
        if stream.standby:
            return
        log.info("KV events: %s is applied by another replica; standing by", stream.sid)
        stream.standby = True
        stream.epoch = None
        stream.tracker.restart()
        self._forget_recovery(stream)

    def _forget_recovery(self: Applier, stream: Stream) -> None:
        """Drop this replica's recovery state of a stream whose ownership changed: the
        owner's stored position is the truth from now on."""
        stream.fresh_recovery()  # a replay in flight is discarded when it ends
        self._stalled.discard(stream.sid)
        self._pending_resets.pop(stream.sid, None)

    def _take_over(self: Applier, stream: Stream, claim: Claim) -> None:
        """This replica now owns the stream (again): forget local sequence state and
        resume after ``claim.resume_after``; fetch by replay what went by meanwhile."""
        sid, after = stream.sid, claim.resume_after
        tracker = stream.tracker
        dropped = self._inbox.peek_dropped(stream.lane)
        known = (stream.standby_seq, tracker.highest_live, stream.recovery.resync_until, dropped)
        seen = max((s for s in known if s is not None), default=None)
        stream.standby_seq = None
        if claim.rebuild:
            log.info("KV events: rebuilding %s: the index lost its entries", sid)
        else:
            log.info(
                "KV events: applying %s from here on (resuming after seq %s)",
                sid,
                "none" if after is None else after,
            )
        stream.epoch = claim.epoch
        stream.standby = False
        self._forget_recovery(stream)
        if claim.rebuild and self._can_replay(stream):
            # Batches applied between the loss and its notice come again in the replay:
            # start from nothing, or their blocks would count two copies. (A failed
            # reset is counted; the replay is still the better index.)
            self._try_reset(sid, "index_lost")
        # Batches at or below the position were applied by the previous owner.
        fresh = [a for a in self._waiting(stream) if after is None or a.seq > after]
        plan = plan_takeover(
            after,
            claim.resume_digest,
            seen,
            fresh[-1].seq if fresh else None,
            self._can_replay(stream),
            claim.rebuild,
        )
        tracker.restart()
        tracker.expected, tracker.highest_live = plan.expected, plan.highest_live
        stream.held.extend((a, False) for a in fresh)  # classified live again
        if plan.dropped_until is not None:
            self._inbox.set_dropped(stream.lane, plan.dropped_until)
        if plan.incomplete_through is not None:
            why = "cannot verify the stored position"
            if claim.rebuild:
                why = f"the index lost its entries; {self._no_replay_reason(stream)}"
            self._incomplete(stream, plan.incomplete_through, why)
        if plan.replay is not None and plan.kind is not None:
            start, until = plan.replay
            anchor = Anchor(after, digest=claim.resume_digest) if plan.anchored else None
            if anchor is not None:
                tracker.expected = start + 1
            self._start_replay(stream, start, until, plan.kind, anchor)
        elif plan.lost:
            self._lost(stream, plan.skip_to - 1, plan.lost, self._no_replay_reason(stream))
        if plan.skip_to is not None:
            tracker.skip_to(plan.skip_to)
        if after is not None and plan.anchored:
            stream.recovery.anchor = Anchor(after, digest=claim.resume_digest)
        self._refresh_ready(stream)

    def _wait_for_gate(self: Applier, stream: Stream) -> None:
        """Ownership unknown: keep everything queued and ask again shortly."""
        stream.recovery.stalled_until = self._clock() + _GATE_RETRY_S
        self._stalled.add(stream.sid)
        self._ready.pop(stream.sid, None)

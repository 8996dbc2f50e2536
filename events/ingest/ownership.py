"""Stream ownership under a :class:`~kvindex.events.ingest.gate.StreamGate`, as decisions.

With several replicas sharing one index the applier asks the gate before applying a
stream; what it then does is decided here, without I/O: go on, stand by while another
replica applies it, wait while the gate cannot tell (:func:`ownership_step`), or take
it over from the position the gate stored (:func:`plan_takeover`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvindex.events.ingest.gate import Claim, Ownership
from kvindex.events.ingest.stream import JobKind


class Step(enum.Enum):
    KEEP = "keep"
    TAKE_OVER = "take_over"
    STAND_BY = "stand_by"
    WAIT = "wait"


def ownership_step(claim: Claim, epoch: int | None) -> Step:
    """What the applier does with a stream it knows under ``epoch``, given ``claim``.

    * **owned under the epoch it knows**: go on (``KEEP``);
    * **owned under a new epoch** (just acquired, or re-acquired after the lease
      lapsed): local sequence state is not trusted, another replica may have applied
      batches in between (``TAKE_OVER``, :func:`plan_takeover`);
    * **not owned**: another replica applies it; drop its batches (counted
      ``not_owner``), remember the last seq seen (``STAND_BY``);
    * **unknown** (the gate's store is unreachable): keep everything queued, apply
      nothing, ask again shortly (``WAIT``).
    """
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
    fetched is ``incomplete`` (waiting messages catch up on first contact).

    When the gate stored the batch's digest, the replay starts *at* that seq and must
    repeat the digest: a mismatch is a restart (reset), an engine that no longer has it
    leaves the stream ``incomplete`` (its entries are kept, but not reported complete).
    A rebuild owes the whole history: caught up from the engine's first buffered batch,
    ``incomplete`` without a replay.
    """
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

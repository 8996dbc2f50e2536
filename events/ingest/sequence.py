"""Per-stream sequence tracking: a pure state machine, no sockets, no clocks.

Every vLLM engine numbers its batches 0, 1, 2, ... and starts again at 0 when its
process restarts. PUB/SUB delivers a connection's messages in order but drops them
silently past the high-water mark, so the seq numbers are the only evidence of what
happened; :class:`SequenceTracker` reads them (the rules are in its docstring).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    """What to do with a message, as decided by :class:`SequenceTracker`."""

    APPLY = "apply"
    DUPLICATE = "duplicate"  # already applied (via replay): drop it
    GAP = "gap"  # seqs missing_from..missing_to were lost
    RESTART = "restart"  # the engine restarted: clear its entries, then re-classify
    FIRST_CONTACT = "first_contact"  # joined late: seqs 0..missing_to were never seen


@dataclass(frozen=True, slots=True)
class Verdict:
    """An :class:`Action` plus, for GAP and FIRST_CONTACT, the missing seqs (inclusive)."""

    action: Action
    missing_from: int = 0
    missing_to: int = -1

    @property
    def missing(self) -> int:
        return max(0, self.missing_to - self.missing_from + 1)


#: The most batches a gap may lose and still read as a gap. vLLM numbers one batch per
#: scheduler step that produced events and keeps only the last ``buffer_steps`` (10,000
#: by default) for replay, so a longer gap can be counted but never fetched; and 2**24
#: (16.7 M) steps, almost each storing new blocks, is far more than any engine's cache
#: holds, so nothing indexed before such a jump can still be cached. Reading it as a new
#: incarnation (clear, then catch up or mark the stream incomplete) loses nothing true;
#: counting it would let one bad seq frame (2**64 - 1) add 1.8e19 missed batches.
MAX_PLAUSIBLE_GAP = 1 << 24


def plausible_gap(expected: int, seq: int) -> bool:
    """Whether seqs ``expected`` .. ``seq - 1`` can have been lost by one engine."""
    return seq - expected <= MAX_PLAUSIBLE_GAP


_APPLY = Verdict(Action.APPLY)
_DUPLICATE = Verdict(Action.DUPLICATE)
_RESTART = Verdict(Action.RESTART)


class SequenceTracker:
    """Sequence state of one engine stream.

    ``expected`` is the next seq to apply (None before the first one); ``highest_live``
    the highest seq received on the live socket (None likewise). The tracker only
    classifies; the caller reports what it did with :meth:`applied`, :meth:`skip_to`,
    :meth:`rewind` and :meth:`restart`. A live seq that is:

    * the one expected → apply it;
    * higher → messages were lost (a gap): fetch them by replay, or accept the loss;
    * at or below a seq already *received live* → the engine restarted. Live delivery
      is in order and never repeats, so a repeat can only be a new process counting
      from 0;
    * more than :data:`MAX_PLAUSIBLE_GAP` above the next expected seq → not a loss any
      engine could have had: a new incarnation (or a corrupt seq frame), handled like a
      restart, never counted as that many missed batches;
    * below the next expected seq but above every seq received live → a replay already
      applied it: a duplicate. This is why two numbers are tracked: a replay can move
      the next seq to apply past the live stream;
    * the first seq ever seen, above 0 → the subscriber joined late: catch up by replay
      from 0 when the engine still buffers it.
    """

    __slots__ = ("expected", "highest_live")

    def __init__(self) -> None:
        self.expected: int | None = None
        self.highest_live: int | None = None

    def live(self, seq: int) -> Verdict:
        """Classify and record a seq received on the live socket.

        RESTART is not recorded: call :meth:`restart`, then :meth:`live` again with the
        same seq to classify it against the new engine.
        """
        if self.highest_live is not None and seq <= self.highest_live:
            return _RESTART
        if self.expected is not None and not plausible_gap(self.expected, seq):
            return _RESTART
        self.highest_live = seq
        return self.position(seq)

    def applies_live(self, seq: int) -> bool:
        """Whether :meth:`live` would say APPLY for ``seq`` (nothing is recorded)."""
        if self.highest_live is not None and seq <= self.highest_live:
            return False
        expected = self.expected
        return seq == 0 if expected is None else seq == expected

    def live_run(self, seq: int, count: int) -> None:
        """Record ``count`` consecutive seqs from ``seq``, received live and applied, when
        :meth:`applies_live` holds for ``seq``: what :meth:`live` then :meth:`applied`
        would record one by one."""
        self.highest_live = seq + count - 1
        self.expected = seq + count

    def position(self, seq: int) -> Verdict:
        """Classify a seq against the next one to apply, without recording anything.

        Used for replayed batches and for live messages already recorded by :meth:`live`
        that had to wait (for a replay, a retry) before they could be applied.
        """
        expected = self.expected
        if expected is None:
            if seq == 0:
                return _APPLY
            return Verdict(Action.FIRST_CONTACT, 0, seq - 1)
        if seq == expected:
            return _APPLY
        if seq < expected:
            return _DUPLICATE
        return Verdict(Action.GAP, expected, seq - 1)

    def applied(self, seq: int) -> None:
        """``seq`` was applied (or consumed as undecodable): expect the next one."""
        self.expected = seq + 1

    def skip_to(self, seq: int) -> None:
        """Accept that everything before ``seq`` is lost (or was never available)."""
        if self.expected is None or seq > self.expected:
            self.expected = seq

    def rewind(self, seq: int) -> None:
        """Deliveries from ``seq`` on failed: they must be applied again (by replay)."""
        if self.expected is None or seq < self.expected:
            self.expected = seq

    def restart(self) -> None:
        """The engine restarted: its numbering starts over."""
        self.expected = None
        self.highest_live = None

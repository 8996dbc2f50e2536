"""The per-stream sequence state machine, without sockets."""

from __future__ import annotations

from kvindex.events.ingest.sequence import (
    MAX_PLAUSIBLE_GAP,
    Action,
    SequenceTracker,
    Verdict,
    plausible_gap,
)


def apply_all(tracker: SequenceTracker, seqs: list[int]) -> list[Action]:
    actions = []
    for seq in seqs:
        verdict = tracker.live(seq)
        actions.append(verdict.action)
        if verdict.action is Action.APPLY:
            tracker.applied(seq)
    return actions


def test_in_order_from_zero() -> None:
    assert apply_all(SequenceTracker(), [0, 1, 2]) == [Action.APPLY] * 3


def test_gap_reports_missing_range() -> None:
    tracker = SequenceTracker()
    apply_all(tracker, [0, 1])
    verdict = tracker.live(5)
    assert verdict == Verdict(Action.GAP, 2, 4)
    assert verdict.missing == 3


def test_first_contact_after_zero() -> None:
    tracker = SequenceTracker()
    verdict = tracker.live(7)
    assert verdict == Verdict(Action.FIRST_CONTACT, 0, 6)
    tracker.skip_to(7)
    assert tracker.position(7).action is Action.APPLY


def test_backwards_is_a_restart() -> None:
    tracker = SequenceTracker()
    apply_all(tracker, [0, 1, 2])
    assert tracker.live(0).action is Action.RESTART
    assert tracker.live(2).action is Action.RESTART  # a repeat is a restart too
    tracker.restart()
    assert tracker.live(0).action is Action.APPLY


def test_restart_to_nonzero_is_first_contact_again() -> None:
    tracker = SequenceTracker()
    apply_all(tracker, [0, 1, 2, 3])
    assert tracker.live(1).action is Action.RESTART
    tracker.restart()
    assert tracker.live(1) == Verdict(Action.FIRST_CONTACT, 0, 0)


def test_live_messages_covered_by_replay_are_duplicates_not_restarts() -> None:
    tracker = SequenceTracker()
    apply_all(tracker, [0])
    assert tracker.live(3).action is Action.GAP
    for seq in (1, 2, 3, 4, 5):  # the replay brought 1..5, beyond the live stream
        assert tracker.position(seq).action is Action.APPLY
        tracker.applied(seq)
    assert tracker.position(3).action is Action.DUPLICATE  # the held trigger message
    assert tracker.live(4).action is Action.DUPLICATE
    assert tracker.live(5).action is Action.DUPLICATE
    assert tracker.live(6).action is Action.APPLY


def test_replay_starting_late_reports_gap() -> None:
    tracker = SequenceTracker()
    apply_all(tracker, [0])
    assert tracker.position(4) == Verdict(Action.GAP, 1, 3)


def test_rewind_and_skip() -> None:
    tracker = SequenceTracker()
    apply_all(tracker, [0, 1, 2, 3])
    tracker.rewind(2)  # deliveries of 2 and 3 failed
    assert tracker.expected == 2
    assert tracker.live(4) == Verdict(Action.GAP, 2, 3)
    tracker.skip_to(4)
    assert tracker.position(4).action is Action.APPLY
    tracker.skip_to(1)  # never moves backwards
    assert tracker.expected == 4
    tracker.rewind(9)  # nor forwards
    assert tracker.expected == 4


def test_an_implausible_jump_forward_is_a_restart_not_a_gap() -> None:
    tracker = SequenceTracker()
    apply_all(tracker, [0, 1, 2])
    assert tracker.live(2**64 - 1).action is Action.RESTART  # not GAP(3, 2**64 - 2)
    assert tracker.highest_live == 2  # not recorded, like any restart
    tracker.restart()
    assert tracker.live(2**64 - 1) == Verdict(Action.FIRST_CONTACT, 0, 2**64 - 2)
    tracker.skip_to(2**64 - 1)
    tracker.applied(2**64 - 1)
    assert tracker.live(3).action is Action.RESTART  # the next real batch: back again


def test_the_largest_plausible_gap_is_still_a_gap() -> None:
    tracker = SequenceTracker()
    apply_all(tracker, [0])
    last_plausible = 1 + MAX_PLAUSIBLE_GAP
    assert tracker.live(last_plausible + 1).action is Action.RESTART
    assert tracker.live(last_plausible) == Verdict(Action.GAP, 1, MAX_PLAUSIBLE_GAP)
    assert plausible_gap(1, last_plausible) and not plausible_gap(1, last_plausible + 1)

"""Recovery decisions (events/ingest/recovery.py, events/ingest/ownership.py, and the stream table's
eviction choices in events/ingest/stream_table.py), without sockets."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest

from kvindex.events.ingest.gate import NOT_OWNED, UNKNOWN, Claim, Ownership
from kvindex.events.ingest.ownership import Step, ownership_step, plan_takeover
from kvindex.events.ingest.recovery import (
    Anchor,
    AnchorCheck,
    ReplayRequest,
    check_replay,
    payload_digest,
)
from kvindex.events.ingest.stream import JobKind
from kvindex.events.ingest.stream_table import eviction_victim, idle_victims


def batch(n: int) -> bytes:
    """A well-formed payload, distinct per ``n``."""
    return msgspec.msgpack.encode([float(n), [["BlockStored", [n], None, [1] * 16, 16]], 0])


def replies(*seqs: int) -> list[tuple[int, bytes]]:
    return [(seq, batch(seq)) for seq in seqs]


# -- replay replies ------------------------------------------------------------------


def test_a_clean_reply_is_accepted_in_order() -> None:
    check = check_replay(ReplayRequest(3, 5), replies(3, 4, 5, 6))
    assert [s for s, _ in check.batches] == [3, 4, 5, 6]
    assert check.rejected == {} and check.anchor is AnchorCheck.NOT_ASKED and not check.foreign


def test_a_buffer_that_no_longer_reaches_back_is_not_an_error() -> None:
    check = check_replay(ReplayRequest(3, 9), replies(7, 8, 9))
    assert [s for s, _ in check.batches] == [7, 8, 9] and check.rejected == {}


@pytest.mark.parametrize(
    ("seqs", "accepted", "rejected"),
    [
        ((2, 3, 4), [3, 4], {"seq_out_of_range": 1}),  # before the asked seq
        ((10**12, 3, 4), [3, 4], {"seq_out_of_range": 1}),  # far ahead, first
        ((3, 10**12, 4), [3, 4], {"seq_out_of_range": 1}),  # far ahead, in the middle
        ((3, 5, 4), [3, 4], {"seq_out_of_range": 1}),  # not contiguous
        ((3, 4, 4, 3, 5), [3, 4, 5], {"seq_repeated": 2}),
        ((7,), [], {"seq_out_of_range": 1}),  # past one after the last needed seq
    ],
)
def test_out_of_range_seqs_are_rejected_and_counted(seqs, accepted, rejected) -> None:
    check = check_replay(ReplayRequest(3, 5), replies(*seqs))
    assert [s for s, _ in check.batches] == accepted
    assert check.rejected == rejected


def test_bad_payloads_and_wrong_topics_are_rejected() -> None:
    got = [(3, batch(3)), (4, b"\xc1garbage"), (4, batch(4)), (5, batch(5))]
    topics = [b"kv@a@m", b"kv@a@m", b"kv@a@m", b"kv@b@m"]
    check = check_replay(ReplayRequest(3, 5, topic=b"kv@a@m"), got, topics)
    assert [s for s, _ in check.batches] == [3, 4]
    assert check.rejected == {"bad_payload": 1, "wrong_topic": 1}
    # Replies without a topic frame (vLLM <= 0.25) cannot be checked, and are not rejected.
    assert check_replay(ReplayRequest(3, 5, topic=b"kv@a@m"), got[:1], [None]).rejected == {}


@pytest.mark.parametrize(
    ("anchor_payload", "seqs", "expected"),
    [
        (batch(2), (2, 3), AnchorCheck.MATCH),
        (b"another engine's seq 2", (2, 3), AnchorCheck.MISMATCH),
        (batch(2), (3, 4), AnchorCheck.ABSENT),
        (batch(2), (), AnchorCheck.ABSENT),
    ],
)
def test_the_anchor_proves_or_disproves_the_incarnation(anchor_payload, seqs, expected) -> None:
    check = check_replay(ReplayRequest(2, 3, Anchor(2, anchor_payload)), replies(*seqs))
    assert check.anchor is expected
    assert check.restarted is (expected is not AnchorCheck.MATCH)
    assert 2 not in [s for s, _ in check.batches]  # the anchor is applied already


def test_replies_that_disagree_with_held_live_batches_are_foreign() -> None:
    live = {4: payload_digest(batch(4))}
    assert not check_replay(ReplayRequest(3, 3, live=live), replies(3, 4)).foreign
    other = [(3, batch(3)), (4, batch(40))]
    assert check_replay(ReplayRequest(3, 3, live=live), other).foreign


def test_anchor_digest_is_computed_once_and_only_when_asked() -> None:
    anchor = Anchor(5, b"payload")
    assert anchor.digest == payload_digest(b"payload") and len(anchor.digest) == 16
    assert Anchor(5, digest=b"x" * 16).digest == b"x" * 16
    assert Anchor(5).digest is None


# -- the stream table ------------------------------------------------------------------


@dataclass
class Facts:
    pinned: bool = False
    delivered: int = 1
    last_active_at: float = 0.0


def test_eviction_prefers_unknown_streams_then_the_idlest_unpinned_one() -> None:
    table = {
        "real": Facts(pinned=True, last_active_at=0.0),
        "idle": Facts(last_active_at=10.0),
        "idler": Facts(last_active_at=5.0),
        "busy": Facts(last_active_at=99.0),
    }
    assert eviction_victim(table.items(), now=100.0, min_idle_s=10.0) == "idler"
    table["never"] = Facts(delivered=0, last_active_at=99.5)
    assert eviction_victim(table.items(), now=100.0, min_idle_s=10.0) == "never"
    # Nothing unpinned that is unknown or idle long enough: refuse the newcomer.
    active = {"real": Facts(pinned=True), "busy": Facts(last_active_at=99.0)}
    assert eviction_victim(active.items(), now=100.0, min_idle_s=10.0) is None


def test_idle_eviction_spares_pinned_streams() -> None:
    table = {"pinned": Facts(pinned=True), "quiet": Facts(), "recent": Facts(last_active_at=95)}
    assert idle_victims(table.items(), now=100.0, idle_s=10.0) == ["quiet"]


# -- ownership ---------------------------------------------------------------------------


def test_ownership_steps() -> None:
    assert ownership_step(Claim(Ownership.OWNED, 3), 3) is Step.KEEP
    assert ownership_step(Claim(Ownership.OWNED, 4), 3) is Step.TAKE_OVER
    assert ownership_step(Claim(Ownership.OWNED, 1), None) is Step.TAKE_OVER
    assert ownership_step(NOT_OWNED, 3) is Step.STAND_BY
    assert ownership_step(UNKNOWN, 3) is Step.WAIT


def test_takeover_without_digest_replays_what_went_by() -> None:
    plan = plan_takeover(after=1, digest=None, seen=4, last_waiting=None, can_replay=True)
    assert (plan.expected, plan.highest_live, plan.replay, plan.kind) == (2, 4, (2, 4), JobKind.GAP)
    plan = plan_takeover(after=None, digest=None, seen=4, last_waiting=None, can_replay=True)
    assert (plan.expected, plan.replay, plan.kind) == (None, (0, 4), JobKind.CATCH_UP)
    plan = plan_takeover(after=1, digest=None, seen=4, last_waiting=None, can_replay=False)
    assert (plan.lost, plan.skip_to, plan.replay) == (3, 5, None)
    plan = plan_takeover(after=1, digest=None, seen=6, last_waiting=5, can_replay=True)
    assert plan.replay is None and plan.dropped_until == 6  # fetched after the waiting ones


def test_a_rebuild_owes_the_whole_history() -> None:
    """The shared index lost the stream's entries: caught up from seq 0 by replay, and
    without one the history is incomplete (never a takeover that claims nothing is owed)."""
    plan = plan_takeover(None, None, seen=4, last_waiting=None, can_replay=True, rebuild=True)
    assert (plan.replay, plan.kind, plan.incomplete_through) == ((0, 4), JobKind.CATCH_UP, None)
    plan = plan_takeover(None, None, seen=4, last_waiting=None, can_replay=False, rebuild=True)
    assert (plan.replay, plan.incomplete_through) == (None, 4)
    plan = plan_takeover(None, None, seen=4, last_waiting=None, can_replay=False)
    assert plan.incomplete_through is None  # nothing was stored, nothing is known lost


def test_takeover_with_digest_verifies_from_the_stored_seq() -> None:
    plan = plan_takeover(after=7, digest=b"d", seen=None, last_waiting=None, can_replay=True)
    assert (plan.replay, plan.kind, plan.anchored) == ((7, 7), JobKind.RESUME, True)
    plan = plan_takeover(after=7, digest=b"d", seen=9, last_waiting=9, can_replay=True)
    assert (plan.replay, plan.anchored) == ((7, 9), True)
    # No replay endpoint: the position cannot be verified, so the stream is incomplete.
    plan = plan_takeover(after=7, digest=b"d", seen=None, last_waiting=None, can_replay=False)
    assert plan.replay is None and plan.incomplete_through == 7

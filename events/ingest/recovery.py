"""Recovery decisions as pure functions: a stream's facts and an input in, a verdict out.

Like :mod:`kvindex.events.ingest.sequence`, nothing here touches a socket, a clock or a thread;
the applier does the I/O a verdict asks for. The decision here: whether a replay's
replies can be trusted and still come from the same engine (:func:`check_replay`).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from kvindex.events.wire.vllm import BatchEnvelope, decode_bounded

#: Bytes of the payload digest kept per stream (blake2b; collisions are irrelevant at
#: this size, the check is against accidents and restarts, not adversaries).
DIGEST_BYTES = 16

_ENVELOPE = msgspec.msgpack.Decoder(BatchEnvelope)


def payload_digest(payload: bytes) -> bytes:
    """A short digest of one batch's raw payload bytes."""
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest()


class Anchor:
    """The last batch a stream applied: its seq and (lazily) its payload digest.

    Hashing every live payload would cost ingest throughput for nothing; the digest is
    computed only when a check or the gate needs it.
    """

    __slots__ = ("_digest", "_payload", "seq")

    def __init__(self, seq: int, payload: bytes | None = None, digest: bytes | None = None):
        self.seq = seq
        self._payload = payload
        self._digest = digest

    @property
    def digest(self) -> bytes | None:
        if self._digest is None and self._payload is not None:
            self._digest = payload_digest(self._payload)
            self._payload = None
        return self._digest

    def __repr__(self) -> str:
        return f"Anchor({self.seq})"


class AnchorCheck(enum.Enum):
    """What a replay said about the anchor."""

    NOT_ASKED = "not_asked"  # the job had no anchor to verify
    MATCH = "match"  # same seq, same digest: same incarnation
    MISMATCH = "mismatch"  # same seq, other payload: the engine restarted
    ABSENT = "absent"  # the engine no longer has it: continuity cannot be proven


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """What a replay was asked for and what its answer must agree with."""

    start: int
    need_until: int
    anchor: Anchor | None = None  # at ``start`` when set
    topic: bytes | None = None  # the stream's live topic, when known
    #: Digests of live batches this stream holds, by seq: overlapping replies must match.
    live: Mapping[int, bytes] = field(default_factory=dict)


@dataclass(slots=True)
class ReplayCheck:
    """The verdict on one replay's replies.

    ``batches`` are the replies to apply, consecutive and after the anchor; ``rejected``
    counts discarded replies by reason; ``foreign`` is set when a reply disagreed with a
    live batch (then nothing may be applied).
    """

    batches: list[tuple[int, bytes]]
    rejected: dict[str, int]
    anchor: AnchorCheck
    foreign: bool = False

    @property
    def restarted(self) -> bool:
        """The engine is not the incarnation this stream's position belongs to."""
        return self.anchor in (AnchorCheck.MISMATCH, AnchorCheck.ABSENT)


def check_replay(
    request: ReplayRequest,
    replies: Sequence[tuple[int, bytes]],
    topics: Sequence[bytes | None] = (),
) -> ReplayCheck:
    """Validate a replay's ``(seq, payload)`` replies (``topics`` parallel, None where
    the layout has none) against ``request``.

    An engine's replay buffer is contiguous, so a good reply is a run of consecutive
    seqs starting at or after the asked seq and no later than one past the last needed
    seq, each payload a batch envelope, each topic (vLLM >= 0.26 sends it) the stream's
    own. Anything else is discarded and counted by reason (``seq_out_of_range``,
    ``seq_repeated``, ``bad_payload``, ``wrong_topic``): a far-ahead seq must never move
    the stream's position (it would drop every later live batch as a duplicate).

    The wire has no incarnation id, and an engine that restarts and passes its old seq
    before kvindex hears from it looks like a plain gap. So a gap's replay starts *at*
    the last applied seq (the anchor) and the reply's batch at that seq must have the
    same digest: a different digest is a restart; an anchor the engine no longer has
    cannot prove continuity and is treated as one too. Replayed batches that overlap
    live ones this stream holds must also agree, or the reply came from another engine
    and none of it is indexed (``foreign``).
    """
    anchor = request.anchor
    check = ReplayCheck([], {}, AnchorCheck.NOT_ASKED if anchor is None else AnchorCheck.ABSENT)
    rejected = check.rejected
    previous: int | None = None
    for i, (seq, payload) in enumerate(replies):
        topic = topics[i] if i < len(topics) else None
        # The next seq a contiguous buffer can send: one past the previous reply, or for
        # the first one anything up to one past the last seq needed.
        limit = request.need_until + 1 if previous is None else previous + 1
        if topic is not None and request.topic is not None and topic != request.topic:
            reason = "wrong_topic"
        elif previous is not None and seq <= previous:
            reason = "seq_repeated"
        elif seq < request.start or seq > limit:
            reason = "seq_out_of_range"
        elif not _well_formed(payload):
            reason = "bad_payload"
        else:
            reason = None
        if reason is not None:
            rejected[reason] = rejected.get(reason, 0) + 1
            continue
        previous = seq
        digest: bytes | None = None
        if anchor is not None and seq == anchor.seq:
            digest = payload_digest(payload)
            check.anchor = AnchorCheck.MATCH if digest == anchor.digest else AnchorCheck.MISMATCH
            continue
        known = request.live.get(seq)
        if known is not None and known != (digest or payload_digest(payload)):
            check.foreign = True
        check.batches.append((seq, payload))
    if anchor is not None and anchor.digest is None and check.anchor is AnchorCheck.MISMATCH:
        check.anchor = AnchorCheck.ABSENT  # nothing to compare with: not proven either way
    return check


def _well_formed(payload: bytes) -> bool:
    try:
        decode_bounded(_ENVELOPE, payload)
    except msgspec.DecodeError:
        return False
    return True

"""Stream ownership across kvindex replicas: one lease per engine stream, in Redis.

Several replicas share one Redis index, and in connect mode every replica receives every
pod's stream. Exactly one of them may apply a stream at a time; that one holds the
stream's lease, a key set-if-absent with an expiry (``SET NX PX``) and extended by a
compare-and-extend script while the holder lives. When a holder dies its lease expires
after ``ttl_s`` and a replica that still receives the stream takes it at its next
attempt, resuming after the position the previous holder stored - the last seq it
applied - by asking the engine to replay the rest.

:class:`RedisLeases` has the keys, the rebuilds after a lost index and the safety rule.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvindex.events.ingest.gate import NOT_OWNED, UNKNOWN, Claim, Ownership
from kvindex.events.wire.identity import StreamId
from kvindex.indexer.backend import BackendError
from kvindex.indexer.redis.backend import RedisBackend
from kvindex.indexer.redis.incarnation import INCOMPLETE, LIVE, IndexIncarnation, RebuildMark
from kvindex.indexer.redis.scripts import SCRIPTS

log = logging.getLogger(__name__)

_LEASE, _RELEASE = SCRIPTS["lease"], SCRIPTS["lease_release"]
#: The holder fences itself after this share of the TTL without a successful renewal.
_FENCE = 0.8
#: /index/pods reads the lease holders at most this often.
_OWNERS_TTL_S = 1.0

#: A stream's applied position: the last seq and its payload digest (None: not known).
_Position = tuple[int, bytes | None]


def default_replica_id() -> str:
    """``hostname:pid``: unique per process; the hostname is the pod name in Kubernetes."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(slots=True)
class _Lease:
    """What this replica knows about one stream's lease."""

    member: str
    wanted_at: float  # last claim() (monotonic); streams nobody asks about are dropped
    owned: bool = False
    epoch: int = 0
    resume_after: int | None = None
    resume_digest: bytes | None = None
    renewed_at: float = float("-inf")  # when the last successful renewal was sent
    holder: str | None = None  # last known holder when not ours
    pending: _Position | None = None  # applied position not yet written
    releasing: bool = False
    rebuild: bool = False  # the index lost its entries: the next epoch rebuilds them
    rebuilding: bool = False  # the current epoch is such a rebuild
    rebuild_state: tuple[str, str] | None = None  # (state, model) not yet written


class RedisLeases:
    """A :class:`~kvindex.events.ingest.gate.StreamGate` backed by Redis leases.

    ``interval_s`` (default ``ttl_s / 5``, at most 1 s) paces renewals and acquisition
    attempts. Call :meth:`start` before use and :meth:`close` at shutdown (it writes
    final positions and releases every lease, so another replica takes over at its next
    round instead of waiting for the TTL).

    Keys (one hash tag per stream, so both live in one slot of a cluster):
    ``<prefix>:stream:{<member>}:lease`` = replica id, ``...:pos`` = last applied seq,
    ``...:digest`` = the payload digest (hex) of that batch when known, so the next owner can
    check that the engine still is the incarnation that published it.

    When Redis loses the index (:mod:`kvindex.indexer.redis.incarnation`, checked in the same
    round trip as the renewals), every stream this replica owns is re-acquired as a
    rebuild: a new epoch whose claim says the whole history is owed again.

    Safety: the holder stops applying once ``0.8 * ttl_s`` has passed since its last
    successful renewal was *sent* (a fence on the local monotonic clock), before anyone else
    can acquire; positions are written only by the lease holder, in the same script that
    extends the lease. All Redis I/O runs on one background thread; the subscriber's calls
    (:meth:`claim`, :meth:`committed`) only read and write memory.
    """

    def __init__(
        self,
        backend: RedisBackend,
        replica_id: str | None = None,
        ttl_s: float = 5.0,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be > 0, got {ttl_s}")
        self.replica_id = replica_id or default_replica_id()
        self.ttl_s = ttl_s
        self.interval_s = interval_s or min(1.0, ttl_s / 5)
        self.backend = backend
        self._connection = backend.connection
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._epochs = itertools.count(1)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._owners: tuple[float, dict[str, str]] = (float("-inf"), {})
        self.incarnation = IndexIncarnation(backend.keys)
        self._on_marks_changed: Callable[[], None] | None = None
        self.errors = 0

    def keys(self, member: str) -> tuple[str, str, str]:
        """The stream's lease, position and digest keys: the lease scripts' ``KEYS``."""
        keys = self.backend.keys.stream(member)
        return keys.lease, keys.position, keys.digest

    # -- StreamGate (applier thread; memory only) ------------------------------------------

    def unheard(self, pod: str | None = None) -> list[StreamId]:
        """None: leases restore nothing locally (a stored position belongs to the shared
        index, and whichever replica owns the stream resets it)."""
        return []

    def claim(self, stream: StreamId) -> Claim:
        member = stream.member
        now = self._clock()
        with self._lock:
            lease = self._leases.get(member)
            if lease is None:
                lease = self._leases[member] = _Lease(member, now)
                self._wake.set()  # try to acquire it now rather than at the next tick
            lease.wanted_at = now
            lease.releasing = False
            if lease.owned:
                if now - lease.renewed_at < _FENCE * self.ttl_s:
                    return Claim(
                        Ownership.OWNED,
                        lease.epoch,
                        lease.resume_after,
                        lease.resume_digest,
                        rebuild=lease.rebuilding,
                    )
                return UNKNOWN  # our lease may have lapsed: apply nothing until renewed
            return NOT_OWNED if lease.holder is not None else UNKNOWN

    def committed(self, stream: StreamId, seq: int, digest: bytes | None = None) -> None:
        with self._lock:
            lease = self._leases.get(stream.member)
            if lease is not None and lease.owned:
                lease.pending = (seq, digest)

    def settled(self, stream: StreamId, epoch: int, model: str, state: str) -> None:
        """Record where an owned stream's rebuild stands (written at the next round):
        only streams rebuilding, or marked in Redis, are reported."""
        if state in ("gapped", "incomplete"):
            rebuild_state = INCOMPLETE
        elif state == "live":
            rebuild_state = LIVE
        else:
            return  # still verifying: not settled yet
        member = stream.member
        with self._lock:
            lease = self._leases.get(member)
            if lease is None or not lease.owned or lease.epoch != epoch:
                return
            if lease.rebuilding or member in self.incarnation.marks():
                lease.rebuild_state = (rebuild_state, model)

    def release(self, stream: StreamId) -> None:
        with self._lock:
            lease = self._leases.get(stream.member)
            if lease is not None:
                lease.releasing = True
        self._wake.set()

    # -- what operators and metrics see ----------------------------------------------------

    def marks(self) -> dict[str, RebuildMark]:
        """Member -> why its entries are not known complete since Redis lost the index,
        for every stream any replica rebuilds (as read at the last round; no Redis call)."""
        return self.incarnation.marks()

    def owned(self) -> dict[str, bool]:
        """Per stream this replica knows, whether it applies it now (no Redis call)."""
        now = self._clock()
        with self._lock:
            return {
                m: lease.owned and now - lease.renewed_at < _FENCE * self.ttl_s
                for m, lease in self._leases.items()
            }

    def owners(self) -> dict[str, str]:
        """Member → replica id holding its lease, for every member in the index or
        known here; read from Redis (cached a second). Raises BackendUnavailable."""
        now = self._clock()
        expires, cached = self._owners
        if now < expires:
            return cached
        with self._lock:
            members = set(self._leases)
        members.update(self.backend.members())
        ordered = sorted(members)
        replies = self._connection.pipeline("owners", [("GET", self.keys(m)[0]) for m in ordered])
        owners = {m: r.decode() for m, r in zip(ordered, replies, strict=True) if r}
        self._owners = (now + _OWNERS_TTL_S, owners)
        return owners

    # -- the lease thread ------------------------------------------------------------------

    def start(self, on_marks_changed: Callable[[], None] | None = None) -> None:
        """Start the lease thread; ``on_marks_changed`` is called (on it) when the
        rebuild marks change, so that answers cached from the old ones are dropped."""
        self._on_marks_changed = on_marks_changed
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvindex-leases", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop renewing; write final positions and release every lease held."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with self._lock:
            held = [lease for lease in self._leases.values() if lease.owned]
            for lease in held:
                lease.owned = False
        commands = [
            _RELEASE.args(self.keys(lease.member), [self.replica_id, *_pos(lease.pending)])
            for lease in held
        ]
        try:
            self._connection.pipeline("leases", commands)
        except BackendError as exc:
            log.warning("could not release %d stream lease(s): %s", len(held), exc)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stopping.is_set():
                break
            try:
                self.tick()
            except Exception:  # never let the lease thread die: renewals are what it is for
                self.errors += 1
                log.exception("stream lease round failed")

    def tick(self) -> None:
        """One round: check the index's incarnation (writing rebuild states), renew
        what is held (writing positions), try to acquire what is wanted, release what
        is no longer wanted. One pipeline."""
        now = self._clock()
        interest_s = max(30.0, 3 * self.ttl_s)
        ttl_ms = str(int(self.ttl_s * 1000))
        with self._lock:
            for member, lease in list(self._leases.items()):
                if not lease.owned and now - lease.wanted_at > interest_s:
                    del self._leases[member]  # the stream is gone from here
            plan = [(lease, lease.pending) for lease in self._leases.values()]
            rebuilt = {
                lease.member: lease.rebuild_state
                for lease in self._leases.values()
                if lease.rebuild_state is not None
            }
        commands = [self.incarnation.command([lease.member for lease, _ in plan], rebuilt)]
        for lease, pending in plan:
            keys = self.keys(lease.member)
            if lease.releasing:
                commands.append(_RELEASE.args(keys, [self.replica_id, *_pos(pending)]))
            else:
                position = _pos(pending) if lease.owned else ("", "")
                commands.append(_LEASE.args(keys, [self.replica_id, ttl_ms, *position]))
        sent_at = self._clock()
        try:
            checked, *results = self._connection.pipeline("leases", commands, partial=True)
        except BackendError as exc:
            self.errors += 1
            log.debug("stream leases: Redis unreachable: %s", exc)
            return
        lost = False
        if isinstance(checked, BackendError):
            self.errors += 1
            rebuilt = {}  # not written: sent again next round
        else:
            marks = self.incarnation.marks()
            lost = self.incarnation.settle(checked)
            if self.incarnation.marks() != marks and self._on_marks_changed is not None:
                self._on_marks_changed()
        if lost:  # after the marks are in place: reads answer again, with warnings
            self.backend.index_lost()
        with self._lock:
            for lease in self._leases.values():
                if lost:
                    lease.rebuild = True
                    lease.rebuild_state = None  # of the index that is gone
                elif lease.rebuild_state is not None and lease.rebuild_state == rebuilt.get(
                    lease.member
                ):
                    lease.rebuild_state = None  # written
            for (lease, pending), result in zip(plan, results, strict=True):
                if isinstance(result, BackendError):
                    self.errors += 1
                    continue
                self._settle(lease, pending, result, sent_at)

    def _settle(
        self, lease: _Lease, pending: _Position | None, result: object, sent_at: float
    ) -> None:
        """Record one command's answer (under the lock)."""
        if lease.releasing:
            if lease.owned:
                log.info("released the lease of %s", lease.member)
            self._leases.pop(lease.member, None)
            return
        status, value, *stored_digest = result  # type: ignore[misc]
        if status == 0:
            if lease.owned:
                log.warning("lost the lease of %s to replica %s", lease.member, value.decode())
            lease.owned = False
            lease.holder = value.decode()
            lease.rebuild = lease.rebuilding = False  # the holder rebuilds it
            return
        if status == 1 and lease.owned and not lease.rebuild:  # same epoch, still valid
            lease.renewed_at = sent_at
            if lease.pending == pending:
                lease.pending = None
            return
        # Newly ours - free, expired (the lease lapsed while Redis was away), or ours
        # already under this replica id from an answer we never saw: a new epoch, since
        # someone else may have applied batches in between.
        lease.owned = True
        lease.holder = None
        lease.epoch = next(self._epochs)
        lease.renewed_at = sent_at
        lease.pending = None
        lease.rebuilding, lease.rebuild = lease.rebuild, False
        if lease.rebuilding:  # a position stored since the loss says nothing of the rest
            lease.resume_after, lease.resume_digest = None, None
        else:
            lease.resume_after, lease.resume_digest = _parse_pos(value, *stored_digest)
        after = "none" if lease.resume_after is None else lease.resume_after
        log.info(
            "acquired the lease of %s (%s)",
            lease.member,
            "rebuilding: the index was lost" if lease.rebuilding else f"resuming after seq {after}",
        )


def _pos(position: _Position | None) -> tuple[str, str]:
    """The position and digest arguments of the lease scripts ('' = none)."""
    if position is None:
        return "", ""
    seq, digest = position
    return str(seq), "" if digest is None else digest.hex()


def _parse_pos(value: bytes, digest: bytes = b"") -> _Position | tuple[None, None]:
    """A stored position and its digest; an unreadable one is no position (resume from
    the engine's first buffered batch), an unreadable digest no digest."""
    if not value:
        return None, None
    try:
        seq = int(value)
    except ValueError:
        log.warning("unreadable stream position %r; resuming from the engine's buffer", value)
        return None, None
    try:
        return seq, bytes.fromhex(digest.decode()) if digest else None
    except ValueError:
        return seq, None

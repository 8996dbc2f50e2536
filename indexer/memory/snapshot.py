"""Memory-backend snapshots: restart without losing entries, and say so when history is
missing.

The memory backend lives in the process; without a snapshot a restart forgets every
entry, and engines that published more than their replay buffer (vLLM keeps 10,000
batches), or idle pods, would come back incomplete while their streams read ``live``.
With ``--snapshot PATH`` the service writes the index, the ingestor's per-member state
and, per stream, the last applied seq and payload digest to one file (every
``--snapshot-interval`` seconds, and at shutdown before and after the drain), restores
it at start, and resumes every stream by replay after its snapshot seq.

:class:`Snapshotter`'s docstring names the three parts and what operators see.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvindex.events.ingest.gate import Claim, Ownership
from kvindex.events.ingest.recovery import DIGEST_BYTES
from kvindex.events.ingest.sink import BatchSink, Delivery
from kvindex.events.ingest.status import StreamStatus
from kvindex.events.wire.identity import MAX_MEMBER_CHARS, MAX_MODEL_CHARS, StreamId, normalize_pod
from kvindex.events.wire.runs import CLEARED, tag_counts
from kvindex.events.wire.vllm import MAX_DP_RANK
from kvindex.indexer.memory.snapshot_file import SnapshotError, read_snapshot, write_snapshot

if TYPE_CHECKING:
    from kvindex.indexer.ingest import Ingestor
    from kvindex.indexer.memory.backend import MemoryBackend

log = logging.getLogger(__name__)

#: Subscriber stream states whose history is known to be missing.
INCOMPLETE_STATES = frozenset({"gapped", "incomplete"})
#: The largest seq the wire's 8-byte frame can carry.
_MAX_SEQ = 2**64 - 1
#: The epoch of every claim: one replica applies everything, ownership never changes.
_EPOCH = 1


@dataclass(slots=True)
class StreamPosition:
    """Where a stream's applied history ends: the last applied seq and its payload
    digest (None when the subscriber gave none), and the stream's model."""

    seq: int
    digest: bytes | None
    model: str


@dataclass(frozen=True, slots=True)
class StreamMark:
    """Why a stream's entries are not known complete, as /index/pods and /score say."""

    member: str
    model: str
    state: str  # "restored" (not heard since the restart) or "incomplete"
    reason: str


class SnapshotGate:
    """A StreamGate for a single replica that resumes restored streams, plus the cut.

    Once a snapshot was restored, or refused, the gate is strict: streams without a
    restored position resume after seq -1, i.e. their whole history is needed (the
    index claims continuity with its past, or knows it lost it), so a stream whose
    engine no longer buffers seq 0 is marked incomplete rather than live. On a first
    start (no snapshot file yet) streams join late as without snapshots.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._positions: dict[StreamId, StreamPosition] = {}
        self._unheard: set[StreamId] = set()  # restored, not claimed since
        self._incomplete: dict[StreamId, str] = {}  # restored incomplete: the reason
        self._claims: dict[StreamId, Claim] = {}
        self._in_flight: dict[StreamId, str] = {}  # delivered, not committed: the model
        self._strict = False

    # -- restore ------------------------------------------------------------------------

    def restore(self, streams: Iterable[tuple[StreamId, StreamPosition, bool]]) -> None:
        """Positions from a snapshot: (stream, position, recorded as incomplete)."""
        with self._cond:
            for stream, position, incomplete in streams:
                self._positions[stream] = position
                self._unheard.add(stream)
                if incomplete:
                    self._incomplete[stream] = "recorded incomplete in the snapshot"
            self._strict = True

    def restore_failed(self) -> None:
        """The snapshot could not be used: every stream's whole history is needed."""
        with self._cond:
            self._strict = True

    # -- StreamGate (the subscriber's applier thread) ----------------------------------

    def claim(self, stream: StreamId) -> Claim:
        with self._cond:
            claim = self._claims.get(stream)
            if claim is not None:
                return claim
            position = self._positions.get(stream) if stream in self._unheard else None
            self._unheard.discard(stream)
            if position is not None:
                claim = Claim(Ownership.OWNED, _EPOCH, position.seq, position.digest)
                log.info("resuming %s after seq %d (from the snapshot)", stream, position.seq)
            else:
                claim = Claim(Ownership.OWNED, _EPOCH, -1 if self._strict else None)
            self._claims[stream] = claim
            return claim

    def committed(self, stream: StreamId, seq: int, digest: bytes | None = None) -> None:
        with self._cond:
            model = self._in_flight.pop(stream, None)
            if model is None:
                known = self._positions.get(stream)
                model = known.model if known is not None else ""
            self._positions[stream] = StreamPosition(seq, digest, model)
            self._cond.notify_all()

    def settled(self, stream: StreamId, epoch: int, model: str, state: str) -> None:
        """Nothing to share: one replica applies every stream."""

    def release(self, stream: StreamId) -> None:
        with self._cond:
            self._claims.pop(stream, None)
            self._unheard.discard(stream)

    def unheard(self, pod: str | None = None) -> list[StreamId]:
        with self._cond:
            return sorted(s for s in self._unheard if pod is None or s.pod == pod)

    def purged(self, member: str) -> None:
        """An operator dropped ``member``'s entries: its saved position and marks go too
        (when its engine is heard again, its whole history is needed)."""
        with self._cond:
            for stream in [s for s in self._positions if s.member == member]:
                del self._positions[stream]
                self._unheard.discard(stream)
                self._incomplete.pop(stream, None)

    # -- the sink side -------------------------------------------------------------------

    def wrap(self, inner: BatchSink) -> BatchSink:
        """The subscriber's sink: ``inner`` with deliveries and resets tracked for cuts."""
        return _CutSink(self, inner)

    def _begin(self, streams: Mapping[StreamId, str]) -> None:
        with self._cond:  # waits while a cut copies
            self._in_flight.update(streams)

    def _abort(self, streams: Iterable[StreamId]) -> None:
        with self._cond:
            for stream in streams:
                self._in_flight.pop(stream, None)
            self._cond.notify_all()

    def _cleared(self, streams: Iterable[StreamId]) -> None:
        """These streams' engines cleared their caches: what was missing is gone too."""
        with self._cond:
            for stream in streams:
                self._incomplete.pop(stream, None)

    def _reset_done(self, stream: StreamId) -> None:
        with self._cond:
            self._positions.pop(stream, None)
            self._incomplete.pop(stream, None)
            self._unheard.discard(stream)
            self._in_flight.pop(stream, None)
            self._cond.notify_all()

    # -- cuts ------------------------------------------------------------------------------

    def cut(
        self, capture: Callable[[], Any], timeout_s: float = 10.0
    ) -> tuple[Any, list[tuple[StreamId, StreamPosition, bool]]] | None:
        """Run ``capture`` (which copies the index) when no delivery is in flight,
        holding new ones back meanwhile; return its result with every stream's position
        and whether it is known incomplete. None when deliveries stayed in flight for
        ``timeout_s`` (a sink call stuck): no consistent cut now."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._in_flight, timeout_s):
                return None
            state = capture()
            streams = [
                (stream, position, stream in self._incomplete)
                for stream, position in self._positions.items()
            ]
        return state, streams

    # -- what operators see ------------------------------------------------------------

    def marks(self) -> dict[str, StreamMark]:
        """Member -> why its entries are not known complete (restored streams not heard
        since the restart, and streams recorded incomplete)."""
        with self._cond:
            out = {}
            for stream in self._unheard:
                position = self._positions[stream]
                out[stream.member] = StreamMark(
                    stream.member,
                    position.model,
                    "restored",
                    f"restored from the snapshot at seq {position.seq}; its engine has not "
                    "been heard since, so its entries are unverified",
                )
            for stream, reason in self._incomplete.items():
                position = self._positions.get(stream)
                out[stream.member] = StreamMark(
                    stream.member,
                    position.model if position is not None else "",
                    "incomplete",
                    f"{reason}; entries may be missing until its engine clears or restarts",
                )
            return out


class _CutSink:
    """The subscriber's sink: marks deliveries in flight until committed, and tells the
    gate about resets and cleared caches."""

    def __init__(self, gate: SnapshotGate, inner: BatchSink) -> None:
        self._gate = gate
        self._inner = inner

    def deliver(self, deliveries: Sequence[Delivery]) -> None:
        streams = {d.stream: d.model for d in deliveries}
        self._gate._begin(streams)
        try:
            self._inner.deliver(deliveries)
        except BaseException:
            self._gate._abort(streams)
            raise
        cleared = {
            d.stream
            for d in deliveries
            if tag_counts(d.batch)[CLEARED]  # counted without decoding a scanned batch
        }
        if cleared:
            self._gate._cleared(cleared)

    def reset(self, stream: StreamId, reason: str) -> None:
        self._gate._begin({stream: ""})
        try:
            self._inner.reset(stream, reason)
        except BaseException:
            self._gate._abort((stream,))
            raise
        self._gate._reset_done(stream)


class IndexImage:
    """The memory index, the ingestor's per-member state and every stream's position as
    one tree: taken as a consistent cut (for a snapshot file, or a peer's dump) and
    installed at start (from either). Holds no state of its own."""

    def __init__(
        self,
        backend: MemoryBackend,
        ingestor: Ingestor,
        gate: SnapshotGate,
        streams: Callable[[], Sequence[StreamStatus]] = list,
    ) -> None:
        self._backend = backend
        self._ingestor = ingestor
        self._gate = gate
        self._streams = streams

    def take(self) -> dict[str, Any] | None:
        """A consistent cut as a tree; None when deliveries stayed in flight (no cut now).
        A stream gapped or incomplete now is saved as incomplete."""
        incomplete = {s.member for s in self._streams() if s.state in INCOMPLETE_STATES}
        cut = self._gate.cut(self._capture)
        if cut is None:
            return None
        (index, ingest), streams = cut
        return {
            "saved_at": time.time(),
            "index": index,
            "ingest": ingest,
            "streams": [
                {
                    "pod": stream.pod,
                    "rank": stream.rank,
                    "model": position.model,
                    "seq": position.seq,
                    "digest": position.digest,
                    "incomplete": flagged or stream.member in incomplete,
                }
                for stream, position, flagged in streams
            ],
        }

    def _capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return self._backend.to_state(), self._ingestor.to_state()

    def install(self, tree: dict[str, Any], source: str) -> int:
        """Replace the (empty) index with ``tree`` and resume its streams from their saved
        positions; return how many. Raises SnapshotError (``invalid``) and leaves the
        index empty when the content does not fit together; call before the subscriber
        starts."""
        try:
            streams = _streams_of(tree)
            self._backend.from_state(tree["index"])
            try:
                self._ingestor.from_state(tree["ingest"])
            except Exception:
                self._backend.close()  # empty again: index and ingestor go together
                raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SnapshotError("invalid", f"{source}: content does not fit ({exc!r})") from None
        self._gate.restore(streams)
        return len(streams)


@dataclass(slots=True)
class SnapshotStats:
    """What the snapshotter did, for metrics and logs."""

    writes_ok: int = 0
    writes_failed: int = 0
    writes_skipped: int = 0  # no consistent cut in time
    last_ok_at: float | None = None  # wall clock
    last_seconds: float = 0.0
    last_bytes: int = 0
    restore: str = "none"  # restored, missing, or a SnapshotError reason
    restore_seconds: float = 0.0


class Snapshotter:
    """Writes consistent cuts of the memory index to ``path`` and restores them.

    ``streams`` returns the subscriber's stream states, so a stream that is gapped or
    incomplete when saved is restored as incomplete. Call :meth:`restore` before the
    subscriber starts, :meth:`start` for periodic snapshots, and :meth:`close` after the
    subscriber stopped (it writes the final snapshot).

    Three parts:

    * :class:`SnapshotGate` is the subscriber's :class:`~kvindex.events.ingest.gate.StreamGate`
      (one replica owns every stream) and wraps its sink. It records each stream's applied
      position (``committed``), answers the first claim of a restored stream with the
      snapshot's seq and digest to resume from, and takes **consistent cuts**: a delivery is
      "in flight" from the moment the sink is called until the subscriber commits its seq
      (or the call fails), and a cut waits for no delivery to be in flight and holds new
      ones back while it copies, so the positions saved match the index saved exactly.
    * :class:`IndexImage` turns a cut into one tree (index, ingest state, stream
      positions) and installs such a tree at start: the snapshot file's content, and what
      a peer's dump ships to a replica started with ``--peers``.
    * :class:`Snapshotter` writes cuts to the file (periodically, and a final one at
      shutdown) and restores them at start, never crashing on a bad file: it logs why,
      starts empty and makes the gate strict (every stream then needs its history from seq
      0, so none is reported complete that is not).

    What operators see (:meth:`SnapshotGate.marks`): a restored stream not heard since the
    restart is ``restored`` (its entries are unverified); a stream the snapshot recorded as
    incomplete (it was ``gapped`` or ``incomplete`` when saved) stays ``incomplete`` until
    its engine clears (AllBlocksCleared) or restarts.
    """

    def __init__(
        self,
        path: str | Path,
        interval_s: float,
        backend: MemoryBackend,
        ingestor: Ingestor,
        gate: SnapshotGate,
        streams: Callable[[], Sequence[StreamStatus]] = list,
    ) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self._backend = backend
        self._gate = gate
        self._image = IndexImage(backend, ingestor, gate, streams)
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = SnapshotStats()

    # -- restore ----------------------------------------------------------------------------

    def restore(self) -> str:
        """Load the snapshot, if any; return ``restored``, ``missing`` or why it was
        refused. Never raises for a bad file: logs one line saying why and what happens."""
        started = time.perf_counter()
        try:
            tree = read_snapshot(self.path)
            streams = self._image.install(tree, str(self.path))
        except SnapshotError as exc:
            if exc.reason == "missing":
                log.info("no snapshot at %s yet: starting with an empty index", self.path)
            else:
                self._refused(exc.reason, str(exc))
            self.stats.restore = exc.reason
            return exc.reason
        seconds = time.perf_counter() - started
        self.stats.restore, self.stats.restore_seconds = "restored", seconds
        stats = self._backend.stats()
        log.info(
            "restored the index from %s in %.2fs: %d keys, %d members, %d streams to resume "
            "by replay (saved at %s)",
            self.path,
            seconds,
            stats.keys,
            stats.members,
            streams,
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(tree.get("saved_at", 0)))),
        )
        return "restored"

    def _refused(self, reason: str, detail: str) -> None:
        aside = self.path.with_name(self.path.name + ".refused")
        try:
            self.path.replace(aside)
        except OSError:
            aside = self.path  # left in place; the next snapshot replaces it
        log.error(
            "cannot use snapshot %s (%s): %s. Starting with an empty index; every stream "
            "is marked incomplete unless its engine can replay its whole history. The file "
            "was kept as %s",
            self.path,
            reason,
            detail,
            aside,
        )
        self._gate.restore_failed()

    # -- writing ----------------------------------------------------------------------------

    def write(self) -> bool:
        """Take a consistent cut and write it; False (logged, counted) when it failed."""
        with self._write_lock:
            started = time.perf_counter()
            tree = self._image.take()
            if tree is None:
                self.stats.writes_skipped += 1
                log.warning("snapshot skipped: a delivery stayed in flight; retrying later")
                return False
            try:
                size = write_snapshot(self.path, tree)
            except OSError as exc:
                self.stats.writes_failed += 1
                log.error("cannot write snapshot %s: %s", self.path, exc)
                return False
            seconds = time.perf_counter() - started
            self.stats.writes_ok += 1
            self.stats.last_ok_at = time.time()
            self.stats.last_seconds, self.stats.last_bytes = seconds, size
            log.info(
                "wrote snapshot %s (%d bytes, %d streams) in %.2fs",
                self.path,
                size,
                len(tree["streams"]),
                seconds,
            )
            return True

    def start(self) -> None:
        if self._thread is None and self.interval_s > 0:
            self._thread = threading.Thread(target=self._run, name="kvindex-snapshot", daemon=True)
            self._thread.start()

    def write_now(self) -> None:
        """Write a snapshot at once, on a thread of its own (a shutdown's first one:
        taken before the drain, it cannot be lost to a drain that runs too long)."""
        thread = threading.Thread(target=self._write_logged, name="kvindex-snapshot-now")
        thread.daemon = True  # close() waits for it (the write lock), not the interpreter
        thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write_logged()

    def _write_logged(self) -> None:
        try:
            self.write()
        except Exception:  # never let the thread die: the next write tries again
            self.stats.writes_failed += 1
            log.exception("snapshot failed")

    def close(self) -> None:
        """Stop the periodic thread and write the final snapshot (call after the
        subscriber stopped, so the cut is the last state). A shutdown wrote one before
        its drain already (:meth:`write_now`); this one adds what was applied during the
        drain, and a SIGKILL while it is written leaves that one in place (the file is
        replaced atomically)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.write()
        except Exception:  # shutting down: say so, never raise into the shutdown path
            self.stats.writes_failed += 1
            log.exception("the final snapshot failed")


def _streams_of(tree: dict[str, Any]) -> list[tuple[StreamId, StreamPosition, bool]]:
    """The saved stream positions; ValueError unless each could have been written: a
    canonical pod id, a rank and seq the wire allows, a digest of the right size, a
    model name within bounds, each stream once."""
    out = []
    seen: set[StreamId] = set()
    for entry in tree["streams"]:
        digest, pod, model = entry["digest"], entry["pod"], entry["model"]
        if digest is not None and not (isinstance(digest, bytes) and len(digest) == DIGEST_BYTES):
            raise ValueError("a stream digest is not a payload digest")
        if not isinstance(pod, str) or len(pod) > MAX_MEMBER_CHARS or normalize_pod(pod) != pod:
            raise ValueError(f"stream pod {str(pod)[:80]!r} is not a pod id")
        if not isinstance(model, str) or len(model) > MAX_MODEL_CHARS:
            raise ValueError(f"stream model {str(model)[:80]!r} is not a model name")
        seq, rank = int(entry["seq"]), int(entry["rank"])
        if not -1 <= seq <= _MAX_SEQ or not 0 <= rank <= MAX_DP_RANK:
            raise ValueError(f"stream {pod} has seq {seq} or rank {rank} out of range")
        stream = StreamId(pod, rank)
        if stream in seen:
            raise ValueError(f"stream {stream} is saved twice")
        seen.add(stream)
        out.append((stream, StreamPosition(seq, digest, model), bool(entry["incomplete"])))
    return out

"""What the subscriber can tell about its streams, as plain data.

No metrics library here: the service reads these numbers and exports them (the metrics
wrapper lives in ``api/``). Counters only ever increase; states are derived.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StreamStatus:
    """A snapshot of one engine stream (a pod's data-parallel rank).

    ``state`` is one of:

    * ``"live"``: in sequence, and its position proven to belong to the engine now
      publishing: the index holds exactly what the engine reported;
    * ``"verifying"``: the position is being checked against the engine (a replay of the
      last applied seq, whose digest must match) after a gap, a reconnect, a silence
      or a takeover;
    * ``"replaying"``: fetching missed batches, or catching up on first contact;
    * ``"resync"``: waiting to retry after the sink failed (or the gate cannot tell who
      owns the stream);
    * ``"gapped"``: batches were lost mid-stream for good (no replay endpoint, replay
      failed, the buffer no longer had them): the index may lack some of this engine's
      blocks or keep some it evicted;
    * ``"incomplete"``: history before some seq cannot be fetched (kvindex joined or
      resumed after the engine's replay buffer, or could not verify the position it
      resumed from): the index may lack some of this engine's blocks;
    * ``"unheard"``: its pod is configured (connect mode), but nothing of its engine
      reached kvindex since it started, neither a batch nor a replay: the engine may
      hold a warm cache the index knows nothing of. With a replay endpoint kvindex
      asks for the engine's whole buffer at once (``replaying``), and the stream is
      ``live`` (or ``incomplete``) once it answered;
    * ``"standby"``: another kvindex replica applies this stream; ``not_owner`` counts
      the batches this one dropped for that reason;
    * ``"stopped"``: an ingest thread died (:class:`IngestHealth`), so no stream follows
      its engine any more; kvindex exits soon after.

    ``gapped`` and ``incomplete`` last until the engine sends AllBlocksCleared or
    restarts (its entries are then rebuilt from nothing), or the pod is forgotten.
    ``last_seq`` is the last seq delivered to the sink (-1 before any), ``first_seq`` the
    first one (> 0 when kvindex joined after the engine started and could not catch up).
    ``last_batch_ts`` is the engine's clock, ``last_received_at`` the subscriber's.
    """

    pod: str
    rank: int
    member: str
    model: str
    state: str
    last_seq: int
    first_seq: int | None
    last_batch_ts: float | None
    last_received_at: float | None
    received: int
    delivered: int
    duplicates: int
    gaps: int
    missed_batches: int
    replays_ok: int
    replays_failed: int
    restarts: int
    queue_overflows: int
    decode_errors: int
    sink_errors: int
    queue_depth: int
    layout: str
    replay_endpoint: str | None
    not_owner: int = 0


class ReasonCounts:
    """Thread-safe counts by reason (a short label such as ``"bad_topic"``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class IngestHealth:
    """Whether every ingest thread still runs; the first one to die says why, for good.

    Written by the thread that dies (its top level catches everything on its way out),
    read by any: a dead ingest thread leaves the index frozen while it still answers,
    so the service must say so (``/healthz``, ``/score`` warnings, stream states) and
    exit rather than serve it as live.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._failed = threading.Event()

    def failed(self, what: str) -> None:
        """``what`` (e.g. "receiver thread failed: RecursionError(...)") stopped ingest."""
        with self._lock:
            if self._failure is None:
                self._failure = what
        self._failed.set()

    @property
    def failure(self) -> str | None:
        """Why ingest stopped; None while every ingest thread runs."""
        return self._failure

    def wait(self, timeout_s: float | None = None) -> str | None:
        """Block until an ingest thread dies (or ``timeout_s`` passes); its failure."""
        self._failed.wait(timeout_s)
        return self._failure

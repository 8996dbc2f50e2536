"""Batches read by the compiled scanner (``events/wire/_wire_scan.c``), with msgspec kept for
everything else.

Decoding a payload with msgspec makes a Python int of every block hash and walks every
token id to skip it; the ingest path needs neither. The scanner walks the bytes once and
hands back the hashes as one native ``uint64`` buffer and the events grouped into runs
(:mod:`kvindex.events.wire.runs`). It recognises the batches of every vLLM release 0.9-0.33;
for anything else (a layout it does not model, bad input of any kind) :func:`scan`
returns None and the caller decodes with :class:`~kvindex.events.wire.vllm.BatchDecoder`,
which stays the reference: the scanner takes only what msgspec's typed decoder takes
whole, and a :class:`ScannedBatch`'s events are msgspec's own, decoded on first use.

``kvindex.events.wire._wire_scan`` is optional (setup.py): without a C compiler :data:`scanner`
is None, every payload takes the msgspec path, and ingest gives the same index
(``tests/test_events_scan.py`` runs both).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Sequence
from types import ModuleType

import msgspec

from kvindex.events.wire.vllm import BATCH_TYPES, EVENT_TYPES, Event, Layout

try:
    from kvindex.events.wire import _wire_scan as _compiled
except ImportError:  # built without a compiler: msgspec decodes every payload
    _compiled = None
#: What scan() returns changed with the drain (per-event spans, stamps): a module built
#: from older sources would be misread, so it is not used (rebuild: pip install -e .).
_API = ("scan", "merge", "drain", "bind")
if _compiled is not None and not all(hasattr(_compiled, name) for name in _API):
    _compiled = None

#: The compiled scanner, or None when every payload is decoded by msgspec. Tests swap it.
scanner: ModuleType | None = _compiled

#: Payloads at least this long are scanned with the GIL released, so the applier thread
#: can run on another core meanwhile (``bench_ingest.py`` unpinned shows the gain). A
#: tiny payload is not worth the release.
RELEASE_GIL_BYTES = 2048

_BATCHES = {layout: msgspec.msgpack.Decoder(t) for layout, t in BATCH_TYPES.items()}
_EVENTS = {layout: msgspec.msgpack.Decoder(t) for layout, t in EVENT_TYPES.items()}


def implementation() -> str:
    """``"compiled"`` or ``"msgspec"``: how this process reads payloads."""
    return "compiled" if scanner is not None else "msgspec"


class ScannedBatch:
    """One payload, or a run of consecutive payloads of one stream, as the scanner read
    it; stands in for an :class:`~kvindex.events.wire.vllm.EventBatch` (``ts``,
    ``data_parallel_rank``, ``events``).

    ``hashes`` holds every block hash of the BlockStored and BlockRemoved events as
    native ``uint64`` (a digest sent as bytes: its last 8 bytes, big-endian), in event
    order; ``runs`` groups the events (:class:`~kvindex.events.wire.runs.Run` fields, as plain
    tuples). ``events`` is msgspec's decode of the payloads, made on first use and kept;
    :meth:`event` decodes a single one.

    Several payloads (:attr:`batches` > 1: read as a group by the receiver's drain, or
    joined by the applier with :meth:`merge`) stand for their batches one after another: their
    events in order, runs joined where one continues another, ``ts`` the last one's
    (:attr:`timestamps` has each). What ingest makes of it is what it makes of the
    batches one by one (``tests/test_events_scan.py``, ``tests/test_ingest_runs.py``),
    for one pass of per-batch work instead of one per batch.
    """

    __slots__ = (
        "_decode_events",
        "_events",
        "_payloads",
        "_spans",
        "_stamps",
        "data_parallel_rank",
        "hashes",
        "layout",
        "n_events",
        "runs",
        "ts",
    )

    def __init__(self, payloads: tuple[bytes, ...], scanned: tuple) -> None:
        ts, stamps, rank, is_map, n_events, hashes, runs, spans = scanned
        self.ts: float = ts
        self.data_parallel_rank: int | None = rank
        self.layout = Layout.MAP if is_map else Layout.ARRAY
        self.n_events: int = n_events
        self.hashes: bytes = hashes
        self.runs: tuple[tuple, ...] = runs
        self._payloads = payloads
        self._stamps: bytes = stamps  # native doubles, one per payload
        self._spans: bytes = spans  # native uint32 (payload, start, stop) per event
        self._events: list[Event] | None = None
        # An engine whose events vLLM's structs misread (SGLang) decodes them itself
        self._decode_events: Callable[[bytes], list[Event]] | None = None

    def decode_events_with(self, decode: Callable[[bytes], list[Event]]) -> None:
        """Take :attr:`events` from ``decode`` (one payload -> its events), not from
        vLLM's structs: the scanner reads SGLang's hashes and spans as vLLM's, but not
        the fields where the engines differ."""
        self._decode_events = decode
        self._events = None

    @classmethod
    def merge(cls, parts: Sequence[ScannedBatch]) -> ScannedBatch:
        """Consecutive batches of one stream (in seq order; those with events all of one
        layout) as one."""
        assert _compiled is not None
        hashes, runs, spans = _compiled.merge(
            [p.hashes for p in parts],
            [p.runs for p in parts],
            [p._spans for p in parts],
            [len(p._payloads) for p in parts],
        )
        last = parts[-1]
        layout = next((p.layout for p in parts if p.n_events), last.layout)
        scanned = (
            last.ts,
            b"".join(p._stamps for p in parts),
            last.data_parallel_rank,
            layout is Layout.MAP,
            sum(p.n_events for p in parts),
            hashes,
            runs,
            spans,
        )
        merged = cls(tuple(itertools.chain.from_iterable(p._payloads for p in parts)), scanned)
        if parts[0]._decode_events is not None:
            merged.decode_events_with(parts[0]._decode_events)
        return merged

    @property
    def batches(self) -> int:
        """How many engine batches this stands for."""
        return len(self._payloads)

    @property
    def payloads(self) -> tuple[bytes, ...]:
        """The batches' raw payloads, in order."""
        return self._payloads

    @property
    def timestamps(self) -> list[float]:
        """Each batch's ``ts``, in order."""
        return list(memoryview(self._stamps).cast("d"))

    def parts(self) -> list[ScannedBatch]:
        """One ScannedBatch per batch (itself when it stands for one), scanned again."""
        if len(self._payloads) == 1:
            return [self]
        parts = [scan(payload) for payload in self._payloads]
        assert all(p is not None for p in parts)  # the scanner took them once
        if self._decode_events is not None:
            for part in parts:
                part.decode_events_with(self._decode_events)  # type: ignore[union-attr]
        return parts  # type: ignore[return-value]

    @property
    def events(self) -> list[Event]:
        """The batches' events, decoded by msgspec (the same structs the
        :class:`~kvindex.events.wire.vllm.BatchDecoder` makes)."""
        events = self._events
        if events is None:
            decoder = _BATCHES[self.layout]
            engine_decode = self._decode_events
            events = []
            if self.n_events:
                for payload in self._payloads:
                    if engine_decode is not None:
                        events += engine_decode(payload)
                    else:
                        events += decoder.decode(payload).events
            self._events = events
        return events

    def event(self, index: int) -> Event:
        """Event ``index`` alone, decoded by msgspec from its bytes."""
        if self._events is not None or self._decode_events is not None:
            return self.events[index]
        part, start, stop = struct.unpack_from("=III", self._spans, 12 * index)
        span = memoryview(self._payloads[part])[start:stop]
        return _EVENTS[self.layout].decode(span)

    def __repr__(self) -> str:
        return (
            f"ScannedBatch(ts={self.ts!r}, events={self.n_events}, runs={len(self.runs)}"
            f"{f', batches={self.batches}' if self.batches > 1 else ''})"
        )


def scan(payload: bytes) -> ScannedBatch | None:
    """The payload as a :class:`ScannedBatch`, or None when msgspec must decode it (no
    compiled scanner, or a payload the scanner does not take)."""
    compiled = scanner
    if compiled is None:
        return None
    scanned = compiled.scan(payload, len(payload) >= RELEASE_GIL_BYTES)
    if scanned is None:
        return None
    return ScannedBatch((payload,), scanned)

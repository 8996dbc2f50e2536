"""The applier's stream table: admission, eviction and removal of streams.

A stream is opened by its first message, unless its pod was just forgotten (stragglers
of a deleted pod must not re-create its entries) or the table is full. A full table
makes room by evicting the least recently active *unpinned* stream (its pod neither
configured in connect mode nor discovered) that never delivered a batch or has been
silent ``stream_evict_idle_s`` (:func:`~kvindex.events.recovery.eviction_victim`), so a
flood of made-up pods cannot lock a real one out for longer than that. Unpinned streams
silent for ``stream_idle_s`` are evicted too. Evicting a stream forgets its member: the
sink resets it (``stream_evicted``), as a removed pod's (``pod_removed``). A stream that
leaves the table, or is refused a place in it, is reported (``stream_closed``) so that
it stops counting against its sender's cap at the door.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvindex.events.identity import pod_host
from kvindex.events.recovery import eviction_victim, idle_victims
from kvindex.events.stream import COUNTERS, JobKind, Stream

if TYPE_CHECKING:
    from kvindex.events.applier import Applier
    from kvindex.events.identity import StreamId

log = logging.getLogger("kvindex.events.subscriber")

#: How often idle streams are looked for.
_IDLE_SCAN_S = 1.0
#: The highest seq the wire can carry: an unheard engine may be anywhere.
_ANY_SEQ = 2**64 - 1


class StreamTable:
    """A mixin of :class:`~kvindex.events.applier.Applier`: the table is written only on
    the applier thread; the lock makes other threads' copies of it consistent (the
    streams themselves they only read)."""

    _table_lock: threading.Lock
    _streams: dict[StreamId, Stream]
    _retired: dict[str, int]
    _forgotten: dict[str, float]
    _idle_scan_at: float
    _verify_at: dict[StreamId, float]
    _stream_closed: Callable[[StreamId], None]

    def streams(self: Applier) -> list[Stream]:
        with self._table_lock:
            return list(self._streams.values())

    def totals(self: Applier) -> dict[str, int]:
        with self._table_lock:
            totals = dict(self._retired)
            streams = list(self._streams.values())
        for stream in streams:
            for name in COUNTERS:
                totals[name] += getattr(stream, name)
        return totals

    def _arrived(self: Applier, sid: StreamId) -> None:
        stream = self._streams.get(sid)
        if stream is None:
            stream = self._admit(sid)
            if stream is None:
                return
        stream.heard = True
        self._refresh_ready(stream)

    def expect(self: Applier, sid: StreamId, model: str, replay_endpoint: str | None) -> None:
        """On the applier thread: a configured pod's stream, before its first message.

        Until its engine is heard (a batch, or a replay) the stream is ``unheard``: after
        a restart without a snapshot its engine may hold a warm cache the index lacks,
        and an idle engine would otherwise look empty, without a word, until it next
        publishes. With a replay endpoint, an engine still silent after
        ``verify_after_reconnect_s`` (a busy one is heard first, and catches up as on
        any first contact) is asked for its whole buffer, so it proves what it holds
        (see :meth:`_verify_when_due`). A stream restored from a snapshot is left to the
        gate: it resumes from its saved position when heard.
        """
        if sid in self._streams or (self._gate is not None and sid in self._gate.unheard(sid.pod)):
            return
        now = self._clock()
        stream = Stream(
            sid, self._inbox.open(sid), model, replay_endpoint, pinned=True, heard=False,
            created_at=now,
        )  # fmt: skip
        with self._table_lock:
            self._streams[sid] = stream
        log.info("KV events: expecting stream %s (model %s), not heard yet", sid, model)
        if replay_endpoint and self._config.catch_up_on_first_contact:
            self._verify_at[sid] = now + self._config.verify_after_reconnect_s

    def _prove(self: Applier, stream: Stream) -> None:
        """Ask an unheard stream's engine to replay its buffer from seq 0."""
        if not self._owns(stream) or stream.blocked or stream.heard:
            return
        if stream.tracker.expected not in (None, 0):
            return  # the gate placed it: its own resume proves it
        if not self._can_replay(stream):  # the endpoint failed recently: after the cooldown
            self._verify_at[stream.sid] = stream.recovery.cooldown_until
            return
        self._start_replay(stream, 0, _ANY_SEQ, JobKind.PROVE)

    def _admit(self: Applier, sid: StreamId) -> Stream | None:
        """A lane with no stream: open one, unless the pod was just forgotten or the
        table is full of streams that may not be evicted."""
        lane = self._inbox.lane(sid)
        first = None if lane is None else self._inbox.peek(lane)
        if lane is None or first is None:
            return None
        now = self._clock()
        quiet_until = self._forgotten.get(sid.pod)
        if quiet_until is not None:
            if first.received_at < quiet_until:
                self._refuse(sid, "forgotten_pod")
                return None
            del self._forgotten[sid.pod]
        if len(self._streams) >= self._config.max_streams:
            victim = self._victim(now)
            if victim is None:
                self._refuse(sid, "too_many_streams")
                self._ratelog.warning(
                    "too_many_streams",
                    "KV events: ignoring new stream %s, max_streams (%d) reached and no "
                    "stream may be evicted",
                    sid,
                    self._config.max_streams,
                )
                return None
            self._remove(self._streams[victim], "stream_evicted", "the stream table is full")
        stream = Stream(
            sid,
            lane,
            first.model,
            self._replay_endpoint(sid, first),
            topic=first.topic,
            pinned=self._pinned(first),
            created_at=now,
        )
        with self._table_lock:
            self._streams[sid] = stream
        log.info("KV events: new stream %s (model %s)", sid, first.model)
        return stream

    def _drop_expected(self: Applier, stream: Stream) -> None:
        """Drop a stream opened for a configured pod before its engine was heard (it
        holds nothing: no reset)."""
        with self._table_lock:
            if self._streams.get(stream.sid) is not stream:
                return
            del self._streams[stream.sid]
            for name in COUNTERS:
                self._retired[name] += getattr(stream, name)
        self._inbox.close(stream.sid)
        self._stream_closed(stream.sid)
        self._ready.pop(stream.sid, None)
        self._verify_at.pop(stream.sid, None)

    def _victim(self: Applier, now: float) -> StreamId | None:
        """The stream a full table gives up for a newcomer (None: none may go)."""
        while True:  # ends: each round pins a stream for good, or returns
            sid = eviction_victim(self._streams.items(), now, self._config.stream_evict_idle_s)
            if sid is None or not self._repinned(self._streams[sid]):
                return sid

    def _repinned(self: Applier, stream: Stream) -> bool:
        """Whether ``stream``'s pod was discovered since the stream opened (asked only
        of streams about to be evicted, so discovery is asked rarely); pins it if so."""
        if not stream.pinned and self._pod_known(stream.sid.pod):
            stream.pinned = True
        return stream.pinned

    def _refuse(self: Applier, sid: StreamId, reason: str) -> None:
        lane = self._inbox.close(sid)
        if lane is not None:
            self._errors.add(reason, max(1, len(lane)))
        self._stream_closed(sid)

    def _evict_idle(self: Applier) -> None:
        """Unpinned streams silent for ``stream_idle_s`` leave the table (and the index)."""
        now = self._clock()
        if now < self._idle_scan_at:
            return
        self._idle_scan_at = now + _IDLE_SCAN_S
        idle_s = self._config.stream_idle_s
        for sid in idle_victims(self._streams.items(), now, idle_s):
            stream = self._streams[sid]
            if stream.blocked or stream.held or self._repinned(stream):
                continue
            self._remove(stream, "stream_evicted", f"idle for {idle_s:g}s")

    def _remove(self: Applier, stream: Stream, reason: str, why: str) -> None:
        """Drop a stream from the table and reset it in the sink (``reason``)."""
        sid = stream.sid
        with self._table_lock:
            if self._streams.get(sid) is not stream:
                return
            del self._streams[sid]
            for name in COUNTERS:
                self._retired[name] += getattr(stream, name)
        self._inbox.close(sid)
        self._stream_closed(sid)
        self._ready.pop(sid, None)
        self._stalled.discard(sid)
        stream.recovery.replay_job = None  # a replay in flight is discarded when it ends
        if reason == "stream_evicted":
            self._errors.add("stream_evicted")
            log.info("KV events: evicted stream %s (%s)", sid, why)
        if self._gate is not None:
            self._gate.release(sid)
            if reason == "stream_evicted" and stream.epoch is None:
                return  # another replica applies it: its entries are not ours to reset
        self._pending_resets[sid] = reason
        self._try_reset(sid, reason)

    def forget(self: Applier, pod: str) -> None:
        """On the applier thread: drop the pod's streams, then reset them in the sink.
        Messages from the pod are ignored for ``forget_quiet_s``."""
        victims = [s for sid, s in self._streams.items() if sid.pod == pod]
        self._forgotten[pod] = self._clock() + self._config.forget_quiet_s
        for stream in victims:
            self._remove(stream, "pod_removed", "forgotten")
        # Restored (a snapshot) and not heard since: entries in the index, but no stream.
        restored = self._gate.unheard(pod) if self._gate is not None else []
        for sid in restored:
            self._pending_resets[sid] = "pod_removed"
        for sid in [s for s in self._pending_resets if s.pod == pod and s not in self._streams]:
            self._try_reset(sid, "pod_removed")
        log.info(
            "KV events: forgot pod %s (%d stream(s), %d restored and not heard since)",
            pod,
            len(victims),
            len(restored),
        )

    def reconnected(self: Applier, pod: str) -> None:
        """The pod's endpoint was (re)connected: its streams' positions must be proven
        to belong to the engine now publishing before they read ``live`` again. The
        next batch proves it; if none comes within ``verify_after_reconnect_s``, a
        replay of the anchor does (see :meth:`_verify_when_due`)."""
        self._reconnected_where(lambda sid: sid.pod == pod)

    def reconnected_host(self: Applier, host: str) -> None:
        """A bind-mode connection came from ``host``: one of its engines may be a new
        incarnation, and which pod it is shows only in its messages, so every stream
        of the host proves its position (a stream of another engine there just
        passes)."""
        marked = self._reconnected_where(lambda sid: pod_host(sid.pod).strip("[]") == host)
        if marked:
            log.info("KV events: an engine on %s connected; verifying %d stream(s)", host, marked)

    def _reconnected_where(self: Applier, chosen: Callable[[StreamId], bool]) -> int:
        due = self._clock() + self._config.verify_after_reconnect_s
        marked = 0
        for sid, stream in self._streams.items():
            if chosen(sid) and stream.recovery.anchor is not None and stream.replay_endpoint:
                stream.recovery.unverified = True
                self._verify_at[sid] = due
                marked += 1
        return marked

    def _verify_when_due(self: Applier) -> None:
        """Prove the position of streams a reconnect left unverified and no batch has
        come for. An engine that restarted and published only while nobody was
        subscribed would otherwise keep its old incarnation's entries, unverified, until
        it publishes again: the anchor's replay finds the restart and fetches the new
        engine's buffer."""
        if not self._verify_at:
            return
        now = self._clock()
        for sid, due in list(self._verify_at.items()):
            if due > now:
                continue
            del self._verify_at[sid]
            stream = self._streams.get(sid)
            if stream is not None and not stream.heard:
                self._guarded(stream, self._prove)
                continue
            if stream is None or not stream.recovery.unverified:
                continue
            if stream.blocked or stream.held or stream.lane.queue:
                continue  # a replay runs or a batch waits: that path verifies
            self._guarded(stream, self._verify_idle)

    def _verify_idle(self: Applier, stream: Stream) -> None:
        if not self._owns(stream) or not self._ensure_reset(stream):
            return
        if not self._can_replay(stream):  # the endpoint failed recently: after the cooldown
            self._verify_at[stream.sid] = stream.recovery.cooldown_until
            return
        self._verify(stream, [])
        self._refresh_ready(stream)

    def _next_verify(self: Applier) -> float:
        return min(self._verify_at.values(), default=float("inf"))

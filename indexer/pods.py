"""Per-pod state as operators see it at ``/index/pods``.

A pod's state is spread over three owners: its event streams (one per data-parallel
rank: sequence, gaps, replays, restarts), the index backend (blocks per model and tier)
and the hash check. The directory joins them per pod id at read time, so nothing is
stored twice and nothing can disagree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from kvindex.events.ingest.status import StreamStatus
from kvindex.events.wire.identity import member_pod
from kvindex.indexer.backend import IndexBackend, MemberStats, Tier
from kvindex.indexer.verify import CheckState, HashVerifier

#: A configured or discovered pod nothing was heard from since kvindex started.
UNHEARD = "unheard"
#: Why an unheard pod's entries say nothing of its cache (in warnings, /route, docs).
UNHEARD_REASON = (
    "not heard from since kvindex started: its engine may hold cached blocks the index "
    "does not know of until it publishes or replays its events"
)
#: The doubt of a pod whose block hashes do not match what the index computes.
HASH_MISMATCH = "hash_mismatch"
#: States in which a stream's entries may differ from what its engine holds.
_UNHEALTHY_STREAMS = frozenset({"gapped", "incomplete", "resync"})
#: States in which a stream is not known to be in step with its engine right now.
_NOT_IN_STEP = _UNHEALTHY_STREAMS | {"verifying", "replaying", "stopped"}
#: The key of warnings that concern every model (no model is named "": a topic's model
#: is never empty): a pod's whose model is not known yet, or, under pod "", every pod's.
EVERY_MODEL = ""
#: Worst first: the state a pod shows when its streams differ.
_STATE_ORDER = (
    "stopped",
    "gapped",
    "incomplete",
    "resync",
    "restored",
    UNHEARD,
    "verifying",
    "replaying",
    "live",
    "standby",
)
_STATE_RANK = {state: i for i, state in enumerate(_STATE_ORDER)}


class Mark(Protocol):
    """Why a stream's entries are not known complete, from outside the subscriber
    (a restored snapshot, an index lost in Redis): ``state`` overrides the stream's
    own; ``model`` empty: not known, the mark concerns every model."""

    member: str
    model: str
    state: str
    reason: str


class _Snapshot(NamedTuple):
    streams: Sequence[StreamStatus]
    discovered: Mapping[str, Mapping[str, Any]]
    members: dict[str, set[str]]  # pod -> its index members (the pod, its DP ranks)
    owners: Mapping[str, str]
    marks: Mapping[str, Mark]
    unheard: frozenset[str]  # expected pods with no stream here and nothing restored


def _stream_dict(s: StreamStatus) -> dict[str, Any]:
    return {
        "member": s.member,
        "rank": s.rank,
        "model": s.model,
        "state": s.state,
        "last_seq": s.last_seq,
        "first_seq": s.first_seq,
        "last_batch_ts": s.last_batch_ts,
        "last_received_at": s.last_received_at,
        "received": s.received,
        "delivered": s.delivered,
        "duplicates": s.duplicates,
        "gaps": s.gaps,
        "missed_batches": s.missed_batches,
        "replays_ok": s.replays_ok,
        "replays_failed": s.replays_failed,
        "restarts": s.restarts,
        "queue_overflows": s.queue_overflows,
        "decode_errors": s.decode_errors,
        "sink_errors": s.sink_errors,
        "not_owner": s.not_owner,
        "queue_depth": s.queue_depth,
        "layout": s.layout,
        "replay_endpoint": s.replay_endpoint,
    }


def warnings_of(
    by_model: dict[str, list[tuple[str, str]]], model: str, pods: Collection[str] | None
) -> list[str]:
    """The texts of ``model``'s (pod, text) warnings, only those of ``pods`` when given,
    and those under ``""``, which concern every model: of a pod whose model is not known
    yet (only if the pod is wanted), or of no pod at all (always)."""
    found = [*by_model.get(EVERY_MODEL, []), *(by_model.get(model, []) if model else [])]
    return [text for pod, text in found if pods is None or not pod or pod in pods]


class PodDirectory:
    """Joins stream status, index contents and hash checks per pod.

    ``streams`` returns this process's stream snapshots; ``discovered`` (optional)
    returns what discovery knows of each pod (Kubernetes name, namespace, address);
    ``owners`` (optional) returns which replica applies each member's stream when
    several kvindex replicas share one backend; ``marks`` (optional) returns streams
    whose entries are not known complete for reasons the subscriber cannot see (a
    restored snapshot), which override the stream's own state. ``expected`` (optional)
    returns the pods configured (``--zmq-connect``, ``--pod-role``) or discovered: one
    with no stream in this process and nothing restored is ``unheard``, its cache
    unknown, and says so like a stream that is; ``ingest_failure`` (optional) why
    ingestion stopped for good, a warning on every answer.
    """

    def __init__(
        self,
        backend: IndexBackend,
        streams: Callable[[], Sequence[StreamStatus]],
        verifier: HashVerifier | None = None,
        discovered: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
        owners: Callable[[], Mapping[str, str]] | None = None,
        clock: Callable[[], float] = time.time,
        warnings_ttl_s: float = 1.0,
        *,
        marks: Callable[[], Mapping[str, Mark]] | None = None,
        expected: Callable[[], Collection[str]] | None = None,
        ingest_failure: Callable[[], str | None] | None = None,
    ) -> None:
        self._ingest_failure = ingest_failure or (lambda: None)
        self._backend = backend
        self._streams = streams
        self._verifier = verifier
        self._discovered = discovered or dict
        self._owners = owners or dict
        self._marks = marks or dict
        self._expected = expected or frozenset
        self._clock = clock
        self._warnings_ttl = warnings_ttl_s
        self._warnings: tuple[float, dict[str, list[tuple[str, str]]]] = (float("-inf"), {})
        self._states: dict[str, str] = {}  # computed with the warnings

    def members_of(self, pod: str) -> list[str]:
        """Index members of ``pod`` (itself and its data-parallel ranks)."""
        return sorted(self._snapshot().members.get(pod, ()))

    def reports(self) -> list[dict[str, Any]]:
        snap = self._snapshot()
        pods = set(snap.members) | set(snap.discovered) | snap.unheard
        return [self._report(pod, snap) for pod in sorted(pods)]

    def report(self, pod: str) -> dict[str, Any] | None:
        snap = self._snapshot()
        known = pod in snap.members or pod in snap.discovered or pod in snap.unheard
        return self._report(pod, snap) if known else None

    def _snapshot(self) -> _Snapshot:
        """Streams, discovery, and index members grouped by pod: read once per request,
        not once per pod (each read is a lock, or a Redis round trip)."""
        streams = self._streams()
        members: dict[str, set[str]] = {}
        for member in self._backend.members():
            members.setdefault(member_pod(member), set()).add(member)
        for stream in streams:
            members.setdefault(stream.pod, set()).add(stream.member)
        marks = self._marks()
        for member in marks:
            members.setdefault(member_pod(member), set()).add(member)
        discovered = self._discovered()
        unheard = self._unheard(streams, marks, discovered)
        return _Snapshot(streams, discovered, members, self._owners(), marks, unheard)

    def _unheard(
        self,
        streams: Sequence[StreamStatus],
        marks: Mapping[str, Mark],
        discovered: Mapping[str, Mapping[str, Any]],
    ) -> frozenset[str]:
        """Configured or discovered pods with no stream here and nothing restored."""
        heard = {s.pod for s in streams} | {member_pod(m) for m in marks}
        return frozenset(set(self._expected()) | set(discovered)) - heard

    def _report(self, pod: str, snap: _Snapshot) -> dict[str, Any]:
        own_streams = [s for s in snap.streams if s.pod == pod]
        members = snap.members.get(pod, set())
        marks = [snap.marks[m] for m in sorted(members) if m in snap.marks]
        discovered, owners = snap.discovered, snap.owners
        blocks: dict[str, int] = {t.label: 0 for t in Tier}
        by_model: dict[str, dict[str, int]] = {}
        for member in sorted(members):
            stats = self._backend.member_stats(member) or MemberStats(member)
            for model, tiers in stats.blocks.items():
                model_blocks = by_model.setdefault(model, {t.label: 0 for t in Tier})
                for tier, count in tiers.items():
                    model_blocks[tier.label] += count
                    blocks[tier.label] += count
        models = sorted(set(by_model) | {s.model for s in own_streams if s.model})
        report: dict[str, Any] = {
            "pod": pod,
            "members": sorted(members),
            "models": models,
            "blocks": blocks,
            "blocks_by_model": by_model,
            "last_event_ts": max((s.last_batch_ts or 0.0 for s in own_streams), default=None)
            or None,
            "last_seq": {s.member: s.last_seq for s in own_streams},
            "gaps": sum(s.gaps for s in own_streams),
            "replays": {
                "ok": sum(s.replays_ok for s in own_streams),
                "failed": sum(s.replays_failed for s in own_streams),
            },
            "restarts": sum(s.restarts for s in own_streams),
            "stream_state": UNHEARD if pod in snap.unheard else _worst_state(own_streams, marks),
            "streams": _stream_dicts(own_streams, marks),
            "hash_check": {m: self._verifier.status(m).as_dict() for m in sorted(members)}
            if self._verifier is not None
            else {},
        }
        if pod in discovered:
            report["discovery"] = dict(discovered[pod])
        member_owners = {m: owners[m] for m in sorted(members) if m in owners}
        if member_owners:
            report["owners"] = member_owners
        return report

    def warnings(self, model: str, pods: Collection[str] | None = None) -> list[str]:
        """Problems that make scores for ``model`` untrustworthy (only those of
        ``pods``, when given), cached for a second: a hash mismatch means a pod's
        entries can never match; a gapped, incomplete or restored-but-unheard stream
        means its entries may be stale or missing."""
        return warnings_of(self.all_warnings(), model, pods)

    def marks_changed(self) -> None:
        """The marks changed: the next warnings are computed afresh, not cached."""
        self._warnings = (float("-inf"), {})

    def all_warnings(self) -> dict[str, list[tuple[str, str]]]:
        """Every model's warnings as (pod, text) pairs (those of pods whose model is
        not known under ``""``), cached for a second."""
        now = self._clock()
        expires, cached = self._warnings
        if now >= expires:
            cached, self._states = self._compute_warnings()
            self._warnings = (now + self._warnings_ttl, cached)
        return cached

    def stream_states(self) -> dict[str, str]:
        """The stream state of each pod (the worst of its streams, as /index/pods
        says) and member not ``live``, for the candidates of /score and /route (a
        live one is left out: the answer is then the same from every replica, whichever
        holds the stream); cached with the warnings."""
        self.all_warnings()
        return self._states

    def _compute_warnings(self) -> tuple[dict[str, list[tuple[str, str]]], dict[str, str]]:
        out: dict[str, list[tuple[str, str]]] = {}
        failure = self._ingest_failure()
        if failure is not None:
            out[EVERY_MODEL] = [
                (
                    "",
                    f"KV-event ingestion stopped ({failure}): the index no longer follows "
                    "any pod, scores may be stale; kvindex exits to be restarted",
                )
            ]
        marks = self._marks()
        streams = self._streams()
        states: dict[str, str] = {}
        by_pod: dict[str, set[str]] = {}
        for stream in streams:
            state = marks[stream.member].state if stream.member in marks else stream.state
            states[stream.member] = state
            by_pod.setdefault(stream.pod, set()).add(state)
        for mark in marks.values():
            states[mark.member] = mark.state
            by_pod.setdefault(member_pod(mark.member), set()).add(mark.state)
        for pod, pod_states in by_pod.items():
            states[pod] = _worst_of(pod_states)
        states = {name: state for name, state in states.items() if state != "live"}
        for pod in self._unheard(streams, marks, self._discovered()):
            states[pod] = UNHEARD
            out.setdefault(EVERY_MODEL, []).append((pod, f"pod {pod}: {UNHEARD_REASON}"))
        for mark in marks.values():
            out.setdefault(mark.model, []).append(
                (member_pod(mark.member), f"pod {mark.member}: stream {mark.state} ({mark.reason})")
            )
        for stream in streams:
            problems = []
            if self._verifier is not None:
                check = self._verifier.status(stream.member)
                if check.state is CheckState.MISMATCH:
                    problems.append(
                        f"pod {stream.member}: block hashes do not match ({check.diagnosis}); "
                        f"{check.action}"
                    )
            unmarked = stream.member not in marks
            if unmarked and stream.state in _UNHEALTHY_STREAMS:
                problems.append(
                    f"pod {stream.member}: event stream {stream.state} "
                    f"({stream.missed_batches} batches missed); its entries may be stale "
                    "or missing until the engine clears or restarts"
                )
            elif unmarked and stream.state == UNHEARD:
                problems.append(f"pod {stream.member}: event stream {UNHEARD} ({UNHEARD_REASON})")
            if problems:
                out.setdefault(stream.model, []).extend((stream.pod, p) for p in problems)
        return out, states

    def unheard_pods(self) -> frozenset[str]:
        """Configured or discovered pods with no stream here and nothing restored."""
        return self._unheard(self._streams(), self._marks(), self._discovered())

    def known_pods(self) -> set[str]:
        """Every pod the index, its streams or discovery know of (the owners of streams
        are not read: that is a Redis round trip nobody here needs)."""
        pods = {member_pod(m) for m in self._backend.members()}
        pods.update(stream.pod for stream in self._streams())
        pods.update(member_pod(m) for m in self._marks())
        pods.update(self._discovered())
        return pods

    def index_doubts(
        self, model: str, pods: Collection[str] | None = None
    ) -> dict[str, tuple[str, str]]:
        """Of ``pods``, those whose entries for ``model`` may differ from their engine's
        cache right now, each with its doubt and why: the stream state of a stream not in
        step (catching up, being verified, gapped, incomplete, resyncing) or of a mark (a
        restored snapshot not heard since), or :data:`HASH_MISMATCH` when its block
        hashes do not match. What a doubt costs the pod is the router's rule
        (``kvindex.scoring.route.doubt``). ``pods`` None: every pod."""
        wanted = None if pods is None else set(pods)
        doubts: dict[str, tuple[str, str]] = {}
        marks = self._marks()
        for mark in marks.values():
            pod = member_pod(mark.member)
            if (wanted is None or pod in wanted) and mark.model in (model, ""):
                why = f"stream {mark.member} {mark.state} ({mark.reason})"
                doubts.setdefault(pod, (mark.state, why))
        for stream in self._streams():
            if stream.model != model or (wanted is not None and stream.pod not in wanted):
                continue
            # A mismatch outranks any stream state: matches are then meaningless.
            if self._verifier is not None:
                check = self._verifier.status(stream.member)
                if check.state is CheckState.MISMATCH:
                    why = f"stream {stream.member}: block hashes do not match"
                    doubts[stream.pod] = (HASH_MISMATCH, why)
                    continue
            if stream.state not in _NOT_IN_STEP or stream.member in marks:
                continue
            held = doubts.get(stream.pod)  # a pod's ranks: the worst stream state says
            if held is None or _worse(stream.state, held[0]):
                doubts[stream.pod] = (stream.state, f"stream {stream.member} {stream.state}")
        return doubts


def _stream_dicts(streams: Sequence[StreamStatus], marks: Sequence[Mark]) -> list[dict[str, Any]]:
    """Each stream as /index/pods shows it; a mark overrides its state and adds its
    reason; a marked stream the subscriber has not seen is listed from the mark."""
    by_member = {m.member: m for m in marks}
    out = []
    for stream in streams:
        entry = _stream_dict(stream)
        mark = by_member.pop(stream.member, None)
        if mark is not None:
            entry["state"], entry["state_reason"] = mark.state, mark.reason
        out.append(entry)
    for mark in by_member.values():
        entry = {"member": mark.member, "model": mark.model, "state": mark.state}
        out.append({**entry, "state_reason": mark.reason})
    return out


def _worse(state: str, than: str) -> bool:
    """Whether stream ``state`` is worse than the doubt ``than`` (a state, or a hash
    mismatch, worse than any)."""
    if than == HASH_MISMATCH:
        return False
    last = len(_STATE_ORDER)
    return _STATE_RANK.get(state, last) < _STATE_RANK.get(than, last)


def _worst_state(streams: Sequence[StreamStatus], marks: Sequence[Mark] = ()) -> str | None:
    marked = {m.member: m.state for m in marks}
    states = {marked.get(s.member, s.state) for s in streams} | set(marked.values())
    return _worst_of(states) if states else None


def _worst_of(states: set[str]) -> str:
    return next((state for state in _STATE_ORDER if state in states), min(states))

"""Replay workers: fetch a stream's missed batches off the applier thread.

A replay can take its whole timeout (a dead pod, a wrong port), so it runs on a small
pool of worker threads and its result comes back to the applier as a command in the
inbox: a slow or dead replay endpoint delays nothing but its own stream, and no worker
ever touches stream state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from kvindex.events.config import SubscriberConfig
from kvindex.events.identity import IdentityError, parse_topic
from kvindex.events.recovery import (
    Anchor,
    AnchorCheck,
    ReplayCheck,
    ReplayRequest,
    check_replay,
    payload_digest,
)
from kvindex.events.replay import ReplayResult, fetch_replay
from kvindex.events.sequence import Action
from kvindex.events.sink import Delivery
from kvindex.events.status import IngestHealth
from kvindex.events.stream import JobKind, ReplayJob, Stream

if TYPE_CHECKING:
    from kvindex.events.applier import Applier

log = logging.getLogger("kvindex.events.subscriber")


@dataclass(frozen=True, slots=True)
class ReplayDone:
    """A command: the replay ``job`` ended with ``result`` at ``received_at``."""

    job: ReplayJob
    result: ReplayResult
    received_at: float


class ReplayWorkers:
    """Runs :func:`fetch_replay` for jobs; posts a :class:`ReplayDone` for each."""

    def __init__(
        self: Applier,
        config: SubscriberConfig,
        context: zmq.Context,
        post: Callable[[object], None],
        clock: Callable[[], float],
        health: IngestHealth,
    ) -> None:
        self._config = config
        self._health = health
        self._ctx = context
        self._post = post
        self._clock = clock
        self._executor = ThreadPoolExecutor(
            max_workers=config.replay_workers, thread_name_prefix="kvindex-replay"
        )

    def submit(self, job: ReplayJob, endpoint: str) -> bool:
        """Start fetching; False when the pool is shut down (stopping)."""
        try:
            self._executor.submit(self._run, job, endpoint)
        except RuntimeError:
            return False
        return True

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _run(self: Applier, job: ReplayJob, endpoint: str) -> None:
        try:
            try:
                result = fetch_replay(
                    endpoint,
                    job.start,
                    timeout_s=self._config.replay_timeout_s,
                    max_batches=self._config.replay_max_batches,
                    context=self._ctx,
                )
            except Exception as exc:
                result = ReplayResult(reason="error", detail=repr(exc))
            self._post(ReplayDone(job, result, self._clock()))
        except BaseException as exc:
            # The pool would keep the exception in a future nobody reads, and the stream
            # would wait for this job's answer for ever: as loud as a dead thread.
            sid = job.stream.sid
            log.exception("replay worker failed; %s waits for a replay that never ends", sid)
            self._health.failed(f"replay worker failed: {exc!r}")
            raise


class ReplayRecovery:
    """The applier's side of replay: start a job, then validate and apply its result
    (:func:`~kvindex.events.recovery.check_replay`), acting on what the anchor check
    says. A mixin of :class:`~kvindex.events.applier.Applier` (it works on the
    applier's streams, on the applier thread)."""

    _workers: ReplayWorkers

    def _can_replay(self: Applier, stream: Stream) -> bool:
        return bool(stream.replay_endpoint) and self._clock() >= stream.recovery.cooldown_until

    @staticmethod
    def _no_replay_reason(stream: Stream) -> str:
        if stream.replay_endpoint:
            return f"replay endpoint {stream.replay_endpoint} failed recently"
        return "no replay endpoint"

    def _start_replay(
        self: Applier,
        stream: Stream,
        start: int,
        until: int,
        kind: JobKind,
        anchor: Anchor | None = None,
    ) -> None:
        endpoint = stream.replay_endpoint
        if not endpoint:  # callers check _can_replay; never fetch from nowhere
            return
        job = ReplayJob(stream, start, until, kind, anchor)
        stream.recovery.replay_job = job
        self._ready.pop(stream.sid, None)
        if not self._workers.submit(job, endpoint):  # stopping
            stream.recovery.replay_job = None

    def _finish_replay(self: Applier, done: ReplayDone) -> None:
        job, result = done.job, done.result
        stream = job.stream
        if self._streams.get(stream.sid) is not stream:
            return  # removed while the replay ran: discard everything it brought
        rec = stream.recovery
        if rec.replay_job is not job:
            return  # a restart or an ownership change made it moot
        rec.replay_job = None
        epoch = stream.epoch
        if not self._owns(stream) or stream.epoch != epoch:
            return  # nothing applied: the gap is found, and fetched, again once owned
        if job.kind is JobKind.PROVE and self._named_elsewhere(stream, result.topics):
            return
        check = check_replay(
            ReplayRequest(job.start, job.need_until, job.anchor, stream.topic, self._live(stream)),
            result.batches,
            result.topics,
        )
        self._count_bad_replies(stream, job, result, check)
        # Bad replies are survivable when the anchor proved the endpoint right; otherwise
        # the reply as a whole cannot be trusted to say anything about the engine.
        tainted = (
            bool(check.rejected or result.bad_replies) and check.anchor is not AnchorCheck.MATCH
        )
        if check.foreign:
            self._replay_failed(stream, job, result, "foreign")
        elif not result.complete:
            self._replay_failed(stream, job, result, result.reason)
        elif tainted:
            self._replay_failed(stream, job, result, "bad_reply")
        else:
            stream.replays_ok += 1
            stream.heard = True  # the engine answered: what it buffers is known now
        if check.foreign:
            check.batches.clear()  # another engine's batches: never indexed
        elif check.anchor is AnchorCheck.MISMATCH or (
            check.anchor is AnchorCheck.ABSENT
            and result.complete
            and not tainted
            # A resumed position the buffer has moved past is only unverifiable; a
            # clean reply with nothing at or after it means the engine's newest seq is
            # below it: the incarnation that published it is gone.
            and (job.kind is not JobKind.RESUME or not check.batches)
        ):
            self._unseen_restart(stream, job, check)
            return
        elif check.anchor is AnchorCheck.MATCH:
            rec.unverified = False
        elif job.kind is JobKind.RESUME and job.anchor is not None:
            self._incomplete(stream, job.anchor.seq, "the engine no longer has the stored seq")
        self._apply_replayed(stream, job, check, result, done.received_at)

    def _named_elsewhere(self: Applier, stream: Stream, topics: list[bytes | None]) -> bool:
        """Whether an expected stream's engine names itself otherwise: its replies'
        ``kv@<pod>@<model>`` topic (vLLM >= 0.26) wins over the configured pod, as for
        its live messages. Then its batches belong to that stream, which opens when it
        publishes, and this one (which holds nothing) is dropped."""
        for topic in topics:
            try:
                named = parse_topic(topic.decode(), self._config.default_serving_port)
            except (AttributeError, UnicodeDecodeError, IdentityError):
                continue  # no topic, or not the convention: the configured pod holds
            if named.pod != stream.sid.pod or named.model != stream.model:
                log.info(
                    "KV events: %s names itself %s (model %s) in its topic; dropping the "
                    "configured name %s (model %s) until it publishes",
                    stream.replay_endpoint, named.pod, named.model, stream.sid, stream.model,
                )  # fmt: skip
                self._drop_expected(stream)
                return True
        return False

    def _live(self: Applier, stream: Stream) -> dict[int, bytes]:
        """Digests of the live messages this stream holds, which replies must match."""
        return {a.seq: payload_digest(a.payload) for a, _ in stream.held if a.bad is None}

    def _count_bad_replies(
        self: Applier, stream: Stream, job: ReplayJob, result: ReplayResult, check: ReplayCheck
    ) -> None:
        if result.bad_replies:
            self._errors.add("bad_replay_reply", result.bad_replies)
        for reason, n in check.rejected.items():
            self._errors.add(f"bad_replay_{reason}", n)
        if check.rejected or result.bad_replies or check.foreign:
            self._ratelog.warning(
                "bad_replay_reply",
                "KV events: replay of %s from %s (seq %d..) sent bad replies: %s%s; "
                "they were discarded",
                stream.sid,
                stream.replay_endpoint,
                job.start,
                dict(check.rejected, malformed=result.bad_replies),
                "; its batches disagree with live ones (another engine?)" if check.foreign else "",
            )

    def _replay_failed(
        self: Applier, stream: Stream, job: ReplayJob, result: ReplayResult, why: str
    ) -> None:
        stream.replays_failed += 1
        # Do not stall this stream for a full timeout at every gap while its replay
        # endpoint is down: declare gaps lost at once until the cooldown ends.
        stream.recovery.cooldown_until = self._clock() + self._config.retry_max_s
        self._errors.add(f"replay_{why}")
        self._ratelog.warning(
            "replay_failed",
            "KV events: replay of %s from %s (seq %d..) ended with %s %s",
            stream.sid,
            stream.replay_endpoint,
            job.start,
            why,
            result.detail,
        )

    def _unseen_restart(self: Applier, stream: Stream, job: ReplayJob, check: ReplayCheck) -> None:
        """The replay's anchor disagrees (or is gone): the engine restarted without the
        stream seeing seq go back. Reset, then catch up the new engine from seq 0."""
        self._errors.add("unseen_restart")
        held = [(a, False) for a, _ in stream.held]  # to be classified against the new engine
        stream.held.clear()
        differs = check.anchor is AnchorCheck.MISMATCH
        self._note_restart(
            stream, f"replay of seq {job.start} {'differs' if differs else 'is gone'}"
        )
        stream.held.extend(held)
        if not held and self._ensure_reset(stream) and self._can_replay(stream):
            self._start_replay(stream, 0, job.need_until, JobKind.RESTARTED)
        self._refresh_ready(stream)

    def _apply_replayed(
        self: Applier,
        stream: Stream,
        job: ReplayJob,
        check: ReplayCheck,
        result: ReplayResult,
        received_at: float,
    ) -> None:
        tracker = stream.tracker
        incomplete = job.kind in (
            JobKind.CATCH_UP,
            JobKind.RESUME,
            JobKind.RESTARTED,
            JobKind.PROVE,
        )
        pending: list[Delivery] = []
        for seq, payload in check.batches:
            verdict = tracker.position(seq)
            action = verdict.action
            if action is Action.DUPLICATE:
                stream.duplicates += 1
                continue
            if action is Action.FIRST_CONTACT:
                # The buffer no longer reaches back to seq 0.
                self._incomplete(stream, seq - 1, "no longer in the engine's replay buffer")
                tracker.skip_to(seq)
            elif action is Action.GAP:
                why = "no longer in the engine's replay buffer"
                if incomplete:
                    self._incomplete(stream, verdict.missing_to, why)
                else:
                    self._lost(stream, verdict.missing_to, verdict.missing, why)
                tracker.skip_to(seq)
            self._apply(stream, seq, payload, stream.model, received_at, True, pending)
        if not self._flush(stream, pending):
            return
        expected = tracker.expected
        if job.kind is JobKind.PROVE:
            if not stream.heard:  # nothing is owed, but it is asked again after the cooldown
                self._verify_at[stream.sid] = stream.recovery.cooldown_until
        elif job.kind is JobKind.RESTARTED:
            clean = result.complete and not (check.rejected or result.bad_replies or check.foreign)
            if not clean and expected is None:  # nothing known of the new engine's history
                self._incomplete(stream, job.need_until, f"replay {result.reason}")
        elif job.kind is not JobKind.VERIFY and (expected is None or expected <= job.need_until):
            why = f"replay {'foreign' if check.foreign else result.reason}"
            first = expected if expected is not None else 0
            if incomplete and not (job.kind is JobKind.RESUME and expected is not None):
                self._incomplete(stream, job.need_until, why)
            else:
                self._lost(stream, job.need_until, job.need_until - first + 1, why)
            tracker.skip_to(job.need_until + 1)
        rec = stream.recovery
        expected = tracker.expected
        if rec.resync_until is not None and expected is not None and expected > rec.resync_until:
            rec.resync_until = None
        self._refresh_ready(stream)

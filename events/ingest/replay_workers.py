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

import zmq

from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.replay_client import ReplayResult, fetch_replay
from kvindex.events.ingest.status import IngestHealth
from kvindex.events.ingest.stream import ReplayJob

log = logging.getLogger("kvindex.events.ingest.subscriber")


@dataclass(frozen=True, slots=True)
class ReplayDone:
    """A command: the replay ``job`` ended with ``result`` at ``received_at``."""

    job: ReplayJob
    result: ReplayResult
    received_at: float


class ReplayWorkers:
    """Runs :func:`fetch_replay` for jobs; posts a :class:`ReplayDone` for each."""

    def __init__(
        self,
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

    def _run(self, job: ReplayJob, endpoint: str) -> None:
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

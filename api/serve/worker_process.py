"""One serving worker of ``kvindex serve --processes N`` (:mod:`kvindex.api.serve.worker_pool` says
why and how they fit together), started by the primary as

    python -m kvindex.api.serve.worker_process DIRECTORY HOST:PORT CHANNEL_FD

It answers ``POST /score`` from the shared tables with the primary's own code (a
:class:`~kvindex.api.serve.service.Service` over a
:class:`~kvindex.indexer.memory.shared_index.SharedIndexReader`, never started: no streams, no
scraping) and relays everything else to the primary over its Unix socket. A ``/score``
is relayed too while speculative entries live (only the primary has them) or when the
shared structure stayed busy (``SharedIndexBusy``).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import msgspec

from kvindex.api.http.hot_lane import HotLane
from kvindex.api.http.hot_path import Answer, HotPath, HotRoutes, Posted, Route
from kvindex.api.http.limits import RequestLimits, gateway_error_body
from kvindex.api.http.server import bind, serve
from kvindex.api.serve.logs import setup_logging
from kvindex.api.serve.primary_relay import Relay
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_derived import Settings
from kvindex.api.serve.worker_pool import Facts, frame
from kvindex.indexer.memory.shared_index import (
    FACTS_VERSION,
    SPECULATIVE_UNTIL,
    SharedIndexBusy,
    SharedIndexReader,
)
from kvindex.indexer.pods import warnings_of
from kvindex.scoring.scorer import ScoreResult

log = logging.getLogger("kvindex.worker")

#: How often a worker sends the primary what it answered (for /metrics).
REPORT_INTERVAL_S = 0.25


class ScoreReports:
    """A worker's stand-in for :class:`~kvindex.api.serve.service_metrics.ScoreMetrics`: what it
    answered, kept as records the primary counts (:meth:`take` empties it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[tuple[Any, ...]] = []

    def score_done(self, result: ScoreResult, seconds: float, warned: bool = False) -> None:
        record = ("score", result.model, result.prompt_blocks, result.best_matched_blocks)
        with self._lock:
            self._records.append((*record, seconds, warned))

    def score_rejected(self, code: str) -> None:
        with self._lock:
            self._records.append(("rejected", code))

    def refused(self, is_score: bool, code: str) -> None:
        with self._lock:
            self._records.append(("refused", is_score, code))

    def take(self) -> list[tuple[Any, ...]]:
        with self._lock:
            records, self._records = self._records, []
        return records


class SharedFacts:
    """The primary's published facts (models, warnings, hybrid layouts), reread when the
    control file's version moves; stands in for the pod directory's ``warnings``."""

    def __init__(self, directory: str, reader: SharedIndexReader, service: Service) -> None:
        self._path = os.path.join(directory, "facts")
        self._words = reader.control.words
        self._service = service
        self.version = -1
        self.facts = Facts([], {}, {})

    def refresh(self) -> None:
        version = int(self._words[FACTS_VERSION])
        if version == self.version:
            return
        try:
            with open(self._path, "rb") as src:
                self.facts = msgspec.msgpack.decode(src.read(), type=Facts)
        except (FileNotFoundError, msgspec.DecodeError):
            return  # being replaced: the next request reads it
        self.version = version
        layouts = self._service.ingestor.layouts
        for model, groups in self.facts.layouts.items():
            for group, (kind, window, block_size) in groups.items():
                layouts.learn(model, group, kind, window, block_size)

    def warnings(self, model: str, pods: Collection[str] | None = None) -> list[str]:
        # Reread here, not only where models are looked up: a /score for a configured
        # model never looks (Service.knows_model), and would carry the warnings of the
        # worker's first facts for ever (a stream gapped since, ingestion stopped).
        self.refresh()
        return warnings_of(self.facts.warnings, model, pods)

    def stream_states(self) -> dict[str, str]:
        return self.facts.states

    def unheard_pods(self) -> frozenset[str]:
        return frozenset()  # the primary's metrics say so


class PrimaryOnly(SharedIndexBusy):
    """A /score only the primary can answer (SGLang's published ids resolve through the
    map its ingestor keeps): relayed to it, as a /score on a busy shared index is."""


class WorkerService(Service):
    """A Service over the shared index that only scores: it never starts (no streams,
    no scraping), and the models it knows are the primary's."""

    def __init__(self, settings: Settings, directory: str) -> None:
        reader = SharedIndexReader(directory)
        super().__init__(settings, backend=reader)
        self.reader = reader
        self.facts = SharedFacts(directory, reader, self)
        self.directory = self.facts  # type: ignore[assignment]  # /score reads warnings and states only
        self.metrics = ScoreReports()  # type: ignore[assignment]
        self._models_key: tuple[int, int] = (-1, -1)
        self._worker_models: frozenset[str] = frozenset()

    def own_keys_of(self, published: list[int]) -> list[int | None]:
        raise PrimaryOnly("published block hashes are resolved by the ingesting process")

    def _models(self, max_age_s: float = 1.0) -> frozenset[str]:
        """The primary's known models and the shared tables' (a new model's table can
        come before the facts that name it), recomputed when either changes."""
        self.facts.refresh()
        key = (self.facts.version, self.reader.control.generation())
        if key != self._models_key:
            found = frozenset(self.facts.facts.models) | frozenset(self.reader.models())
            self._models_key, self._worker_models = key, found
        return self._worker_models


class WorkerRoutes(HotRoutes):
    """The lane's paths in a worker: ``/score`` answered here unless only the primary can
    answer it; ``/route`` and its ``done`` and ``first-token`` passed on to the primary
    from the lane (cheaper than the ASGI relay, and these are a gateway's hot path)."""

    def __init__(
        self, service: WorkerService, on_refusal: Callable[[str, str], None], relay: Relay
    ) -> None:
        super().__init__(service, on_refusal)
        self.inline = True
        self._relay = relay
        self._scored = self._exact["/score"]
        self._here = Route(self._score, self._relayed)
        self._passed_on = Route(_not_here, self._relayed)
        self._until = service.reader.control.floats[SPECULATIVE_UNTIL : SPECULATIVE_UNTIL + 1]

    def match(self, path: str) -> tuple[Route, str] | None:
        found = super().match(path)
        if found is None:
            return None
        route, argument = found
        return (self._here if route is self._scored else self._passed_on), argument

    def answer(self, route: Route, posted: Posted) -> Answer | None:  # type: ignore[override]
        """The answer, or None when the primary must give it (:meth:`answer_async`)."""
        if time.monotonic() < self._until[0]:
            return None
        try:
            return route.inline(posted)
        except SharedIndexBusy:
            return None
        except Exception as exc:
            return self.failed(exc, posted.path)

    async def _relayed(self, posted: Posted) -> Answer:
        return await self._relay.post(posted)


def _not_here(posted: Posted) -> None:
    """The inline answer of a path only the primary answers: none (it is relayed)."""
    return None


def _worker_settings(directory: str) -> Settings:
    """The primary's settings, less its event sources, discovery, snapshots and peers."""
    with open(os.path.join(directory, "settings.json"), "rb") as src:
        settings = msgspec.json.decode(src.read(), type=Settings)
    replace = msgspec.structs.replace
    return replace(
        settings,
        events=replace(settings.events, zmq_connect=[], zmq_bind=[]),
        k8s=replace(settings.k8s, namespace=[]),
        index=replace(settings.index, snapshot=None, peers=[]),
    )


def _report(channel: socket.socket, reports: ScoreReports, directory: str) -> None:
    """Send what was answered every REPORT_INTERVAL_S; stop this process when the
    primary's end closes (it went away; killed, it could not remove the shared
    directory itself)."""
    while True:
        readable, _, _ = select.select([channel], [], [], REPORT_INTERVAL_S)
        try:
            gone = bool(readable) and not channel.recv(4096)
        except OSError:  # reset: the primary was killed with reports unread
            gone = True
        records = reports.take()
        try:
            if records:
                channel.sendall(frame(msgspec.msgpack.encode(records)))
        except OSError:
            gone = True
        if gone:
            shutil.rmtree(directory, ignore_errors=True)  # what is mapped stays readable
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's graceful shutdown
            return


def main(argv: list[str]) -> int:
    directory, listen, channel_fd = argv
    settings = _worker_settings(directory)
    setup_logging(settings.log.format, settings.log.level)
    service = WorkerService(settings, directory)
    relay = Relay(os.path.join(directory, "primary.sock"))

    def refused_at(path: str, code: str) -> None:
        service.metrics.refused(path == "/score", code)

    routes = WorkerRoutes(service, refused_at, relay)
    http = settings.http
    # With --gateway the primary answers /v1 behind the relay; refusals here look the same.
    limits = RequestLimits.of(HotPath(routes, relay), http, refused_at, gateway_error_body)
    host, _, port = listen.rpartition(":")
    sock = bind(host.strip("[]"), int(port), reuse_port=True)
    channel = socket.socket(fileno=int(channel_fd))
    reports: ScoreReports = service.metrics  # type: ignore[assignment]
    threading.Thread(target=_report, args=(channel, reports, directory), daemon=True).start()
    serve(
        limits,
        sock,
        header_timeout_s=http.header_timeout,
        keep_alive_timeout_s=http.keep_alive_timeout,
        drain_timeout_s=http.drain_timeout,
        lane=HotLane(routes, limits),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

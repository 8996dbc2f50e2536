"""Prometheus metrics, as wrappers and collectors around parts that know nothing of them.

The subscriber, the ingestor, the hash check and the backend keep plain counters; a
collector reads them at scrape time, so the hot paths pay nothing for metrics. Only
what must be observed as it happens is recorded inline: score latency by the /score
handler, event lag by the wrapper around the sink (:mod:`kvindex.indexer.instrumented`).
Per-pod series carry only a pod label (and tier or state), so cardinality is bounded by
the number of pods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvindex.indexer.backend import MemberStats, Tier

if TYPE_CHECKING:
    from kvindex.api.http.offload import IndexWork
    from kvindex.api.serve.index_figures import IndexFigures
    from kvindex.api.serve.peers import PeerRecoveryStats
    from kvindex.events.ingest.subscriber import Subscriber
    from kvindex.indexer.ingest import Ingestor
    from kvindex.indexer.memory.snapshot import SnapshotGate, Snapshotter
    from kvindex.indexer.redis.backend import RedisBackend
    from kvindex.indexer.redis.leases import RedisLeases
    from kvindex.indexer.verify import HashVerifier
    from kvindex.scoring.scorer import ScoreResult

_SCORE_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.008, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_STREAM_STATES = (
    "live",
    "verifying",
    "replaying",
    "resync",
    "gapped",
    "incomplete",
    "standby",
    "unheard",
    "stopped",
)


class ScoreMetrics:
    """What /score records per request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvindex_score_requests",
            "Score requests by outcome (ok, or the error code of a refused request).",
            ["outcome"],
            registry=registry,
        )
        self.seconds = Histogram(
            "kvindex_score_seconds",
            "Time to answer a valid /score request (decode, tokenize, hash, lookup).",
            buckets=_SCORE_BUCKETS,
            registry=registry,
        )
        # Labelled by model only once the model is known (configured or seen in events),
        # so a client cannot grow the series by inventing model names.
        self.prompt_blocks = Counter(
            "kvindex_score_prompt_blocks",
            "Full blocks in scored prompts (denominator of the hit ratio), by model.",
            ["model"],
            registry=registry,
        )
        self.matched_blocks = Counter(
            "kvindex_score_matched_blocks",
            "Cached blocks of the best pod for each scored prompt (numerator of the hit "
            "ratio), by model.",
            ["model"],
            registry=registry,
        )
        self.warned = Counter(
            "kvindex_score_warnings",
            "Score answers that carried warnings: a pod's entries not known complete "
            "(stream gapped, incomplete, or restored and not heard since) or its hashes "
            "not matching.",
            registry=registry,
        )
        self.http_refused = Counter(
            "kvindex_http_refused",
            "Requests refused outside /score (bad input, limits, auth), by error code.",
            ["code"],
            registry=registry,
        )
        self._ok = self.requests.labels("ok")
        # Each model's two children, looked up once: labels() takes a lock and builds its
        # key on every call, and this runs for every answered /score. Only known models
        # are scored, so it is bounded.
        self._by_model: dict[str, tuple[Counter, Counter]] = {}

    def score_done(self, result: ScoreResult, seconds: float, warned: bool = False) -> None:
        self.count_score(
            result.model, result.prompt_blocks, result.best_matched_blocks, seconds, warned
        )

    def count_score(
        self, model: str, prompt_blocks: int, matched_blocks: int, seconds: float, warned: bool
    ) -> None:
        """One answered /score (also as a serving worker reported it, api/serve/worker_pool.py)."""
        self._ok.inc()
        if warned:
            self.warned.inc()
        self.seconds.observe(seconds)
        children = self._by_model.get(model)
        if children is None:
            children = self._by_model[model] = (
                self.prompt_blocks.labels(model),
                self.matched_blocks.labels(model),
            )
        children[0].inc(prompt_blocks)
        children[1].inc(matched_blocks)

    def score_rejected(self, code: str) -> None:
        self.requests.labels(code).inc()

    def refused(self, is_score: bool, code: str) -> None:
        """One refused request: /score's count as its outcome, the others by code."""
        if is_score:
            self.score_rejected(code)
        else:
            self.http_refused.labels(code).inc()


def register_process_metrics(registry: CollectorRegistry, version: str, backend: str) -> None:
    """``kvindex_build_info`` (what runs) and the process collector's RSS, CPU seconds and
    open file descriptors (what it costs), on the service's own registry."""
    info = Gauge(
        "kvindex_build_info",
        "1, labelled with the running kvindex version and index backend kind.",
        ["version", "backend"],
        registry=registry,
    )
    info.labels(version, backend.partition(":")[0].removesuffix("s")).set(1)
    ProcessCollector(registry=registry)


class ServiceCollector(Collector):
    """Reads the service's plain counters at scrape time."""

    def __init__(
        self,
        subscriber: Subscriber,
        ingestor: Ingestor,
        figures: Callable[[], IndexFigures | None],
        verifier: HashVerifier | None,
        clock: Callable[[], float] = time.time,
        unheard: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self._subscriber = subscriber
        self._ingestor = ingestor
        self._figures = figures  # bounded: a hung backend cannot hold the scrape
        self._verifier = verifier
        self._clock = clock
        self._unheard = unheard  # configured or discovered pods with no stream yet

    def describe(self) -> list:  # no fixed descriptions: collected fresh at each scrape
        return []

    def collect(self) -> Iterator:
        counts = self._ingestor.counts
        events = CounterMetricFamily(
            "kvindex_events", "KV events applied, by type.", labels=["type"]
        )
        for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            events.add_metric([kind], counts.events.get(kind, 0))
        yield events

        errors = CounterMetricFamily(
            "kvindex_event_errors",
            "Messages, events or blocks skipped, by reason (bad frames, bad payloads, overflow, "
            "unindexed groups, ...).",
            labels=["reason"],
        )
        reasons: dict[str, int] = dict(self._subscriber.error_counts())
        for reason, n in counts.skipped.items():
            reasons[reason] = reasons.get(reason, 0) + n
        for reason, n in sorted(reasons.items()):
            errors.add_metric([reason], n)
        yield errors

        totals = self._subscriber.totals()
        yield CounterMetricFamily(
            "kvindex_seq_gaps", "Sequence gaps detected in engine streams.", value=totals["gaps"]
        )
        replays = CounterMetricFamily(
            "kvindex_replays", "Replay fetches from engines, by result.", labels=["result"]
        )
        replays.add_metric(["ok"], totals["replays_ok"])
        replays.add_metric(["failed"], totals["replays_failed"])
        yield replays
        yield CounterMetricFamily(
            "kvindex_missed_batches",
            "Batches lost for good (a gap replay could not fill).",
            value=totals["missed_batches"],
        )
        yield CounterMetricFamily(
            "kvindex_pod_restarts",
            "Engine restarts detected (sequence went backwards).",
            value=totals["restarts"],
        )
        yield CounterMetricFamily(
            "kvindex_hash_mismatches",
            "Sampled BlockStored events whose hashes kvindex could not reproduce.",
            value=self._verifier.mismatches_total if self._verifier else 0,
        )
        yield CounterMetricFamily(
            "kvindex_blocks_stored", "Blocks stored by applied events.", value=counts.blocks_stored
        )
        yield CounterMetricFamily(
            "kvindex_blocks_removed",
            "Blocks removed by applied events.",
            value=counts.blocks_removed,
        )

        figures = self._figures()
        if figures is not None:  # None: the backend did not answer; /readyz says why
            stats = figures.stats
            blocks = GaugeMetricFamily(
                "kvindex_index_blocks",
                "(block, pod) entries in the index, by tier.",
                labels=["tier"],
            )
            for tier in Tier:
                blocks.add_metric([tier.label], stats.blocks.get(tier, 0))
            yield blocks
            yield GaugeMetricFamily(
                "kvindex_index_keys", "Distinct block keys held by any pod.", value=stats.keys
            )
            yield CounterMetricFamily(
                "kvindex_index_evictions",
                "Block keys dropped by the index's capacity bound.",
                value=stats.evictions,
            )
        yield from self._pod_metrics(figures.members if figures is not None else {})

    def _pod_metrics(self, members: dict[str, MemberStats]) -> Iterator:
        streams = self._subscriber.streams()
        pods = {s.pod for s in streams} | {m.split("/dp", 1)[0] for m in members}
        yield GaugeMetricFamily(
            "kvindex_pods", "Pods with a stream or index entries.", value=len(pods)
        )

        pod_blocks = GaugeMetricFamily(
            "kvindex_pod_blocks",
            "Blocks each pod (or DP rank) holds, by tier.",
            labels=["pod", "tier"],
        )
        for member, stats in sorted(members.items()):
            for tier in Tier:
                pod_blocks.add_metric([member, tier.label], stats.total(tier))
        yield pod_blocks

        state = GaugeMetricFamily(
            "kvindex_pod_stream_state",
            "1 for each pod stream's current state (live, verifying, replaying, resync, "
            "gapped, incomplete, standby, unheard: a configured or discovered pod not "
            "heard from since kvindex started).",
            labels=["pod", "state"],
        )
        age = GaugeMetricFamily(
            "kvindex_pod_last_event_age_seconds",
            "Seconds since each pod stream's last batch arrived.",
            labels=["pod"],
        )
        gaps = CounterMetricFamily(
            "kvindex_pod_seq_gaps", "Sequence gaps per pod stream.", labels=["pod"]
        )
        now = self._clock()
        for s in streams:
            for name in _STREAM_STATES:
                state.add_metric([s.member, name], 1.0 if s.state == name else 0.0)
            if s.last_received_at is not None:
                age.add_metric([s.member], max(0.0, now - s.last_received_at))
            gaps.add_metric([s.member], s.gaps)
        for pod in sorted(self._unheard()):
            for name in _STREAM_STATES:
                state.add_metric([pod, name], 1.0 if name == "unheard" else 0.0)
        yield state
        yield age
        yield gaps
        if self._verifier is not None:
            check = GaugeMetricFamily(
                "kvindex_pod_hash_mismatch",
                "1 when a pod's block hashes do not match kvindex's configuration.",
                labels=["pod"],
            )
            for s in streams:
                check.add_metric(
                    [s.member], 1.0 if self._verifier.status(s.member).state == "mismatch" else 0.0
                )
            yield check


class IndexWorkCollector(Collector):
    """/score's and /route's index work waiting or running on threads (Redis backend):
    near ``--backend-max-in-flight`` means the backend is slow or hung."""

    def __init__(self, work: IndexWork) -> None:
        self._work = work

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        yield GaugeMetricFamily(
            "kvindex_backend_work_in_flight",
            "Index lookups of /score and /route waiting or running on threads, abandoned "
            "ones (past --backend-deadline) included.",
            value=self._work.in_flight,
        )


class RedisCollector(Collector):
    """The shared index's own health: Redis errors and which streams this replica owns.
    Reads local counters only, so it answers while Redis is down."""

    def __init__(self, backend: RedisBackend, leases: RedisLeases) -> None:
        self._backend = backend
        self._leases = leases

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        errors = CounterMetricFamily(
            "kvindex_redis_errors",
            "Redis calls that failed (unreachable, timed out, refused), by operation.",
            labels=["op"],
        )
        for op, n in sorted(self._backend.error_counts().items()):
            errors.add_metric([op], n)
        errors.add_metric(["leases"], self._leases.errors)
        yield errors
        owned = GaugeMetricFamily(
            "kvindex_stream_owned",
            "1 when this replica applies the pod stream (holds its lease), else 0.",
            labels=["pod"],
        )
        for member, is_owned in sorted(self._leases.owned().items()):
            owned.add_metric([member], 1.0 if is_owned else 0.0)
        yield owned
        yield CounterMetricFamily(
            "kvindex_redis_index_losses",
            "Times this replica found the Redis index lost (its incarnation token gone: "
            "Redis restarted without persistence, or was flushed).",
            value=self._leases.incarnation.losses,
        )


class SnapshotCollector(Collector):
    """Snapshot writes and restore, and the streams whose entries are not known complete
    because of a restart (restored and not heard since, or recorded incomplete)."""

    def __init__(self, snapshotter: Snapshotter, gate: SnapshotGate) -> None:
        self._snapshotter = snapshotter
        self._gate = gate

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        stats = self._snapshotter.stats
        writes = CounterMetricFamily(
            "kvindex_snapshot_writes",
            "Snapshot writes by result (ok, failed, skipped: no consistent cut in time).",
            labels=["result"],
        )
        writes.add_metric(["ok"], stats.writes_ok)
        writes.add_metric(["failed"], stats.writes_failed)
        writes.add_metric(["skipped"], stats.writes_skipped)
        yield writes
        if stats.last_ok_at is not None:
            yield GaugeMetricFamily(
                "kvindex_snapshot_last_success_timestamp_seconds",
                "When the last snapshot was written (Unix time).",
                value=stats.last_ok_at,
            )
        yield GaugeMetricFamily(
            "kvindex_snapshot_last_write_seconds",
            "How long the last snapshot took (cut and write).",
            value=stats.last_seconds,
        )
        yield GaugeMetricFamily(
            "kvindex_snapshot_bytes", "Size of the last snapshot written.", value=stats.last_bytes
        )
        restore = GaugeMetricFamily(
            "kvindex_snapshot_restore",
            "1 for what happened to the snapshot at start: restored, missing (first start), "
            "or why it was refused (foreign, version, truncated, corrupt, invalid, unreadable).",
            labels=["result"],
        )
        restore.add_metric([stats.restore], 1.0)
        yield restore
        yield GaugeMetricFamily(
            "kvindex_snapshot_restore_seconds",
            "Time to read and install the snapshot at start.",
            value=stats.restore_seconds,
        )
        marks = self._gate.marks()
        unverified = GaugeMetricFamily(
            "kvindex_streams_unverified",
            "Streams whose entries are not known complete after a restart: restored (not "
            "heard since) or incomplete (history missing until the engine clears or restarts).",
            labels=["state"],
        )
        per_pod = GaugeMetricFamily(
            "kvindex_pod_stream_unverified",
            "1 for each pod stream restored and not heard since, or recorded incomplete.",
            labels=["pod", "state"],
        )
        for state in ("restored", "incomplete"):
            unverified.add_metric([state], sum(m.state == state for m in marks.values()))
        for member, mark in sorted(marks.items()):
            per_pod.add_metric([member, mark.state], 1.0)
        yield unverified
        yield per_pod


class PeerRecoveryCollector(Collector):
    """What ``--peers`` recovery did at start: copied, or why the last peer failed."""

    def __init__(self, stats: PeerRecoveryStats) -> None:
        self._stats = stats

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        stats = self._stats
        result = GaugeMetricFamily(
            "kvindex_peer_recovery",
            "1 for what --peers recovery did at start: copied, none (a snapshot was "
            "restored), or why the last peer tried failed (unreachable, timeout, "
            "unauthorized, refused, foreign, version, truncated, corrupt, invalid, error).",
            labels=["result"],
        )
        result.add_metric([stats.result], 1.0)
        yield result
        failures = CounterMetricFamily(
            "kvindex_peer_recovery_failures",
            "Peers whose dump could not be used at start, by reason.",
            labels=["reason"],
        )
        for reason in sorted({reason for _, reason, _ in stats.tried}):
            failures.add_metric([reason], sum(r == reason for _, r, _ in stats.tried))
        yield failures
        yield GaugeMetricFamily(
            "kvindex_peer_recovery_seconds",
            "Time to fetch and install a peer's dump at start (all peers tried).",
            value=stats.seconds,
        )
        yield GaugeMetricFamily(
            "kvindex_peer_recovery_bytes", "Size of the dump copied at start.", value=stats.bytes
        )

"""The composition root: one function's worth of wiring from Settings to a running service.

Every part is built here and handed what it needs; nothing else constructs a backend,
a subscriber or a registry. Tests build a Service from Settings in two lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from prometheus_client import CollectorRegistry, disable_created_metrics

from kvindex.api.config import (
    ConfigError,
    Settings,
    admin_token,
    build_catalog,
    check_bind_endpoint,
    check_tokenizer_dirs,
    discovery_config,
    tokenizer_dirs,
)
from kvindex.api.health import BackendHealthLog
from kvindex.api.index_figures import LatestFigures, read_figures
from kvindex.api.metrics import (
    IndexWorkCollector,
    InstrumentedSink,
    RedisCollector,
    ScoreMetrics,
    ServiceCollector,
    SnapshotCollector,
    register_process_metrics,
)
from kvindex.api.offload import IndexWork
from kvindex.api.route_metrics import (
    EventLagCollector,
    LoadCollector,
    RouteMetrics,
    SpeculativeCollector,
)
from kvindex.api.route_view import RouteView
from kvindex.api.version import VERSION
from kvindex.events.config import SubscriberConfig
from kvindex.events.discovery import KubernetesDiscovery
from kvindex.events.endpoints import PodEndpoint, endpoint_host, tcp_endpoint
from kvindex.events.identity import IdentityError, normalize_pod
from kvindex.events.known_pods import KnownPods
from kvindex.events.replay_endpoints import (
    ReplayEndpointError,
    ReplayEndpoints,
    parse_pod_replay_endpoint,
    split_connect_spec,
)
from kvindex.events.subscriber import Subscriber
from kvindex.indexer.backend import BackendError, IndexBackend
from kvindex.indexer.compiled import implementation
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.kv_groups import is_group_namespace
from kvindex.indexer.memory import MemoryBackend
from kvindex.indexer.pods import PodDirectory
from kvindex.indexer.snapshot import SnapshotGate, Snapshotter
from kvindex.indexer.verify import HashVerifier
from kvindex.scoring.event_lag import EventLag
from kvindex.scoring.load import LoadView
from kvindex.scoring.pd import Role, parse_role
from kvindex.scoring.router import Admission, Router
from kvindex.scoring.scorer import Scorer
from kvindex.scoring.speculative import SpeculativeIndex
from kvindex.scoring.tokenize import TokenizerRegistry

if TYPE_CHECKING:
    from kvindex.indexer.leases import RedisLeases

log = logging.getLogger(__name__)


def make_backend(settings: Settings) -> IndexBackend:
    """``memory`` (embedded, the default) or ``redis://host:port/db`` (shared)."""
    spec = settings.index.backend
    if spec == "memory":
        return MemoryBackend(capacity_blocks=settings.index.capacity_blocks)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        try:
            from kvindex.indexer.redis_backend import RedisBackend
        except ImportError as exc:
            raise ConfigError(
                f"--backend {spec} needs the redis extra: pip install 'kvindex[redis]' ({exc})"
            ) from None
        return RedisBackend.from_url(spec, prefix=settings.index.redis_prefix)
    raise ConfigError(f"--backend {spec!r}: use 'memory' or 'redis://HOST:PORT/DB'")


def make_leases(settings: Settings, backend: IndexBackend) -> RedisLeases | None:
    """Stream leases when the index is shared in Redis, so that each pod's stream is
    applied by exactly one of the replicas sharing it; None otherwise."""
    try:
        from kvindex.indexer.leases import RedisLeases
        from kvindex.indexer.redis_backend import RedisBackend
    except ImportError:
        return None
    if not isinstance(backend, RedisBackend):
        return None
    if settings.index.lease_ttl <= 0:
        raise ConfigError(f"--lease-ttl {settings.index.lease_ttl}: must be at least 1 second")
    return RedisLeases(backend, settings.index.replica_id, float(settings.index.lease_ttl))


def make_index_work(settings: Settings, backend: IndexBackend) -> IndexWork:
    """Where /score and /route do their index work: inline over the memory backend
    (nothing in it can hang), else on threads under ``--backend-deadline`` and
    ``--backend-max-in-flight`` (:mod:`kvindex.api.offload`)."""
    index = settings.index
    for flag, value in (
        ("--backend-deadline", index.backend_deadline),
        ("--backend-max-in-flight", index.backend_max_in_flight),
    ):
        if value <= 0:
            raise ConfigError(f"{flag} {value}: must be positive")
    return IndexWork(
        inline=isinstance(backend, MemoryBackend),
        deadline_s=index.backend_deadline,
        max_in_flight=index.backend_max_in_flight,
    )


def snapshot_backend(settings: Settings, backend: IndexBackend) -> MemoryBackend | None:
    """The backend to snapshot when ``--snapshot`` is set: the memory backend only
    (Redis keeps its own data across kvindex restarts, and several replicas use
    leases). Refuses settings that cannot work before anything starts."""
    if not settings.index.snapshot:
        return None
    if not isinstance(backend, MemoryBackend):
        raise ConfigError(
            "--snapshot works with the memory backend; a Redis index survives kvindex "
            "restarts on its own (drop --snapshot, or use --backend memory)"
        )
    if settings.index.snapshot_interval < 0:
        raise ConfigError(f"--snapshot-interval {settings.index.snapshot_interval}: must be >= 0")
    directory = Path(settings.index.snapshot).parent
    if not directory.is_dir():
        raise ConfigError(
            f"--snapshot {settings.index.snapshot}: directory {directory} does not exist"
        )
    return backend


def replay_endpoints(settings: Settings, known: KnownPods | None) -> ReplayEndpoints:
    """Each stream's replay endpoint: ``--replay-endpoint``, discovery's annotations, then
    the ``--replay-port`` rule (:mod:`kvindex.events.replay_endpoints`)."""
    configured: dict[str, str] = {}
    for spec in settings.events.replay_endpoint:
        try:
            pod, endpoint = parse_pod_replay_endpoint(spec, settings.events.serving_port)
        except ReplayEndpointError as exc:
            raise ConfigError(f"--replay-endpoint {exc}") from None
        configured[pod] = endpoint
    return ReplayEndpoints(configured, settings.events.replay_port or None, known)


def parse_connect(
    spec: str, settings: Settings, replays: ReplayEndpoints | None = None
) -> PodEndpoint:
    """``[POD[@MODEL]=]ENDPOINT[;replay=REPLAY]`` to a PodEndpoint.

    Without a POD the pod is named by the topic when it is ``kv@<pod>@<model>``, else by
    the endpoint's host and ``--serving-port``; without a MODEL, by the topic or ``--model``.
    The replay endpoint is ``;replay=``, else the pod's ``--replay-endpoint``, else the
    endpoint's host at ``--replay-port``.
    """
    try:
        spec, own_replay = split_connect_spec(spec)
    except ReplayEndpointError as exc:
        raise ConfigError(f"--zmq-connect {spec!r}: {exc}") from None
    name, sep, endpoint = spec.rpartition("=")
    if not sep:
        name, endpoint = "", spec
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"--zmq-connect {spec!r}: the endpoint must be tcp://HOST:PORT")
    pod: str | None = None
    model: str | None = None
    if name:
        pod_text, _, model_text = name.partition("@")
        try:
            pod = normalize_pod(pod_text, settings.events.serving_port)
        except IdentityError as exc:
            raise ConfigError(f"--zmq-connect {spec!r}: {exc}") from None
        model = model_text or None
    host = endpoint_host(endpoint)
    if pod is None and host is not None:
        pod = normalize_pod(host, settings.events.serving_port)
    replay = own_replay
    if replay is None and replays is not None and pod is not None:
        replay = replays.pod_endpoint(pod)
    if replay is None and settings.events.replay_port and host is not None:
        replay = tcp_endpoint(f"[{host}]" if ":" in host else host, settings.events.replay_port)
    return PodEndpoint(
        endpoint, pod=pod, model=model or settings.events.model, replay_endpoint=replay
    )


def make_routing(
    settings: Settings,
    pods: Callable[[], Iterable[str]],
    seed: int | None = None,
) -> tuple[LoadView, Router]:
    """/route's parts: the load view scraping every known pod, and the router."""
    scoring = settings.scoring
    if scoring.load_interval <= 0 or scoring.load_timeout <= 0:
        raise ConfigError("--load-interval and --load-timeout must be positive")
    if scoring.route_ttl <= 0:
        raise ConfigError(f"--route-ttl {scoring.route_ttl}: must be positive")
    if not 0 < scoring.max_kv_usage <= 1:
        raise ConfigError(f"--max-kv-usage {scoring.max_kv_usage}: must be in (0, 1]")
    if scoring.max_waiting < 0:
        raise ConfigError(f"--max-waiting {scoring.max_waiting}: must be >= 0 (0: no limit)")
    if scoring.max_event_lag < 0:
        raise ConfigError(f"--max-event-lag {scoring.max_event_lag}: must be >= 0 (0: off)")
    if scoring.pd_threshold < 0:
        raise ConfigError(f"--pd-threshold {scoring.pd_threshold}: must be >= 0")
    view = LoadView(
        interval_s=scoring.load_interval, timeout_s=scoring.load_timeout, pods_source=pods
    )
    admission = Admission(scoring.max_kv_usage, scoring.max_waiting)
    least_bad = scoring.when_full == "least_bad"
    return view, Router(scoring.route_weights, admission, seed, least_bad=least_bad)


def make_speculative(settings: Settings) -> SpeculativeIndex:
    scoring = settings.scoring
    try:
        return SpeculativeIndex(scoring.speculative_ttl, scoring.speculative_max_blocks)
    except ValueError:
        raise ConfigError(
            "--speculative-ttl must be >= 0 (0: off) and --speculative-max-blocks positive"
        ) from None


def static_roles(settings: Settings) -> dict[str, Role]:
    """``--pod-role POD=ROLE`` for pods that discovery does not label."""
    roles = {}
    for spec in settings.scoring.pod_role:
        pod, sep, role = spec.rpartition("=")
        try:
            if not sep:
                raise ValueError("give POD=ROLE, e.g. 127.0.0.7:8000=prefill")
            roles[normalize_pod(pod, settings.events.serving_port)] = parse_role(role)
        except (ValueError, IdentityError) as exc:
            raise ConfigError(f"--pod-role {spec!r}: {exc}") from None
    return roles


class Service:
    """A composed kvindex: backend, ingest, subscriber, scorer, metrics, pod directory."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        backend: IndexBackend | None = None,
        discovered: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None,
        owners: Callable[[], Mapping[str, str]] | None = None,
        route_seed: int | None = None,
    ) -> None:
        self.settings = settings
        self.admin_token = admin_token(settings)
        self.catalog = build_catalog(settings)
        known = KnownPods() if settings.k8s.namespace else None
        replays = replay_endpoints(settings, known)
        self._connect = [
            parse_connect(spec, settings, replays) for spec in settings.events.zmq_connect
        ]
        for endpoint in settings.events.zmq_bind:
            check_bind_endpoint(endpoint)
        check_tokenizer_dirs(tokenizer_dirs(settings))
        self.backend = backend or make_backend(settings)
        self.leases = make_leases(settings, self.backend)
        self.index_work = make_index_work(settings, self.backend)
        # `*_created` series double every counter's series; no dashboard here uses them.
        disable_created_metrics()
        self.registry = registry or CollectorRegistry()
        self.verifier = HashVerifier(self.catalog.keying, self.catalog.hasher)
        self.ingestor = Ingestor(self.backend, self.catalog, self.verifier)
        snapshotted = snapshot_backend(settings, self.backend)
        self.snapshot_gate = SnapshotGate() if snapshotted is not None else None
        self.event_lag = EventLag()
        sink = InstrumentedSink(self.ingestor, self.registry, lag=self.event_lag)
        try:
            subscriber_config = SubscriberConfig(
                topic_filter=settings.events.topic_filter,
                replay_port=settings.events.replay_port or None,
                queue_capacity=settings.events.stream_queue,
                default_serving_port=settings.events.serving_port,
                default_model=settings.events.model,
                bind_allow=tuple(settings.events.bind_allow),
                max_streams_per_sender=settings.events.max_streams_per_sender,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.subscriber = Subscriber(
            sink if self.snapshot_gate is None else self.snapshot_gate.wrap(sink),
            subscriber_config,
            gate=self.leases or self.snapshot_gate,
            # Discovered pods keep their streams however long they idle.
            pod_known=lambda pod: self.discovery is not None and pod in self.discovery.discovered(),
            replay_resolver=replays,
            discovered_pods=known,
        )
        self.snapshotter: Snapshotter | None = None
        if snapshotted is not None and self.snapshot_gate is not None and settings.index.snapshot:
            self.snapshotter = Snapshotter(
                settings.index.snapshot,
                settings.index.snapshot_interval,
                snapshotted,
                self.ingestor,
                self.snapshot_gate,
                self.subscriber.streams,
            )
        self.discovery: KubernetesDiscovery | None = None
        if settings.k8s.namespace:
            self.discovery = KubernetesDiscovery(
                self.subscriber,
                discovery_config(settings),
                known=known,
                on_synced=self._forget_vanished_restored if self.snapshot_gate else None,
            )
            discovered = discovered or self.discovery.discovered
        self.scorer = Scorer(
            self.backend, self.catalog, settings.scoring.tier_weights, self.ingestor.layouts
        )
        self.tokenizers = TokenizerRegistry(tokenizer_dirs(settings))
        self.metrics = ScoreMetrics(self.registry)
        register_process_metrics(self.registry, VERSION, settings.index.backend)
        self.registry.register(
            ServiceCollector(
                self.subscriber,
                self.ingestor,
                LatestFigures(
                    lambda: read_figures(self.backend),
                    inline=isinstance(self.backend, MemoryBackend),
                ).get,
                self.verifier,
            )
        )
        self.registry.register(IndexWorkCollector(self.index_work))
        if self.leases is not None:
            self.registry.register(RedisCollector(self.leases.backend, self.leases))
            owners = owners or self.leases.owners
        if self.snapshotter is not None and self.snapshot_gate is not None:
            self.registry.register(SnapshotCollector(self.snapshotter, self.snapshot_gate))
        self.directory = PodDirectory(
            self.backend,
            self.subscriber.streams,
            self.verifier,
            discovered,
            owners,
            marks=self.snapshot_gate.marks if self.snapshot_gate is not None else None,
        )
        self.load, self.router = make_routing(settings, self.known_pods, route_seed)
        self.route_metrics = RouteMetrics(self.registry)
        self.registry.register(LoadCollector(self.load))
        self.speculative = make_speculative(settings)
        self.registry.register(SpeculativeCollector(self.speculative))
        self.registry.register(EventLagCollector(self.event_lag))
        self.route_view = RouteView(self.known_pods, self.directory.index_doubts)
        self._static_roles = static_roles(settings)
        self._roles_cache: tuple[float, dict[str, Role]] = (float("-inf"), {})
        self.bound: list[str] = []
        self.backend_health = BackendHealthLog(self.backend)
        self.started = False
        self._models_cache: tuple[float, frozenset[str]] = (float("-inf"), frozenset())

    def start(self) -> None:
        self.started = True
        self.backend_health.start()
        if self.leases is not None:
            self.leases.start()
        if self.snapshotter is not None:
            self.snapshotter.restore()  # before any batch is applied
        self.subscriber.start()
        for endpoint in self.settings.events.zmq_bind:
            try:
                self.bound.append(self.subscriber.bind(endpoint))
            except zmq.ZMQError as exc:
                self.stop()
                raise ConfigError(f"--zmq-bind {endpoint}: cannot bind: {exc}") from None
            log.info("listening for KV events on %s", self.bound[-1])
        for target in self._connect:
            self.subscriber.connect(target)
            log.info("subscribed to %s (pod %s)", target.endpoint, target.pod or "from topic")
        if self.discovery is not None:
            self.discovery.start()
        if self.snapshotter is not None:
            self.snapshotter.start()
        self.load.start()
        if self.settings.k8s.namespace and self.settings.k8s.mode == "bind":
            if not self.settings.events.zmq_bind:
                log.warning("--k8s-mode bind: add --zmq-bind tcp://*:5557 for pods to connect to")
        elif not self.settings.events.zmq_bind and not self._connect and self.discovery is None:
            log.warning(
                "no event source configured: add --zmq-bind tcp://*:5557 (pods connect to "
                "kvindex) or --zmq-connect tcp://POD_IP:5557 (kvindex connects to pods)"
            )

        log.info("%s", self.startup_summary())

    def startup_summary(self) -> str:
        """One line that tells an operator what this process is: version, index, hashing,
        models, where it listens and where its events come from."""
        keying = self.catalog.keying(self.settings.events.model or "")
        backend = self.settings.index.backend
        if "@" in backend:  # redis://user:password@host: keep the password out of logs
            scheme, _, rest = backend.partition("://")
            backend = f"{scheme}://***@{rest.rpartition('@')[2]}"
        events = [f"bind {e}" for e in self.bound]
        events += [f"connect {t.endpoint}" for t in self._connect]
        if self.settings.k8s.namespace:
            events.append(
                f"k8s {self.settings.k8s.mode} {','.join(self.settings.k8s.namespace)} "
                f"({self.settings.k8s.selector})"
            )
        return (
            f"kvindex {VERSION} started: backend={backend} ({implementation()} table) "
            f"hash_algo={keying.hash.algo.value} "
            f"block_size={keying.hash.block_size} key_mode={keying.key_mode.value} "
            f"models={','.join(self._configured_models()) or '(from events)'} "
            f"listen={self.settings.http.listen} events={'; '.join(events) or 'none'}"
        )

    def stop(self) -> None:
        self.load.stop()
        if self.discovery is not None:
            self.discovery.stop()
        self.subscriber.stop()
        if self.snapshotter is not None:
            self.snapshotter.close()  # the final snapshot: nothing is applied any more
        if self.leases is not None:
            self.leases.close()  # final positions; another replica takes over within a second
        self.backend_health.stop()
        self.index_work.close()
        self.backend.close()

    def _forget_vanished_restored(self, discovered: frozenset[str]) -> None:
        """Discovery's first full list is in: a pod restored from the snapshot that is
        not in it was deleted while kvindex was down. No removal event will ever come for
        it, so forget it now, or /score would keep routing to a pod that is gone."""
        gate = self.snapshot_gate
        for pod in sorted({sid.pod for sid in gate.unheard()} - discovered if gate else ()):
            log.info("pod %s from the snapshot is not discovered: forgetting it", pod)
            self.subscriber.forget_pod(pod)

    def purge_pod(self, pod: str) -> tuple[list[str], int]:
        """Operator purge: drop every entry of ``pod`` and its DP ranks. The pod's stream
        keeps flowing; what it stores next is indexed again."""
        members = self.directory.members_of(pod)
        removed = 0
        for member in members:
            removed += self.backend.clear_member(member)
            if self.snapshot_gate is not None:
                self.snapshot_gate.purged(member)
        log.info("operator purged pod %s (%d entries)", pod, removed)
        return members, removed

    def readiness_problems(self) -> list[str]:
        problems = []
        try:
            self.backend.ping()
        except BackendError as exc:
            problems.append(f"index backend unavailable: {exc}")
        if not self.subscriber.is_running():
            problems.append("event subscriber is not running")
        if not self.has_event_source() and self.settings.index.backend == "memory":
            problems.append(
                "no event source configured, so the in-memory index stays empty: add "
                "--zmq-bind tcp://*:5557 (pods connect to kvindex), --zmq-connect "
                "tcp://POD_IP:5557 or --k8s-namespace NS"
            )
        if self.discovery is not None:
            problems.extend(self.discovery.problems())
        return problems

    def has_event_source(self) -> bool:
        return bool(self.settings.events.zmq_bind or self._connect or self.discovery is not None)

    def readiness_notes(self) -> list[str]:
        """Why a replica that looks idle is ready anyway."""
        if not self.has_event_source():
            return ["no event source configured: answering from the shared index only"]
        return []

    def known_pods(self) -> list[str]:
        """Pods /route chooses among when a request names none, and whose load is
        scraped: configured (--zmq-connect), discovered, or in the index or its streams."""
        try:
            pods = self.directory.known_pods()
        except BackendError:  # the index is down: the pods this process hears from
            pods = {stream.pod for stream in self.subscriber.streams()}
            if self.discovery is not None:
                pods.update(self.discovery.discovered())
        pods.update(target.pod for target in self._connect if target.pod)
        return sorted(pods)

    def roles(self) -> dict[str, Role]:
        """P/D role per pod that has one: discovered pods' ``kvindex.io/role`` label over
        ``--pod-role``; pods not listed are ``both``. Cached for a second."""
        if self.discovery is None:
            return self._static_roles
        now = time.monotonic()
        refreshed, roles = self._roles_cache
        if now - refreshed < 1.0:
            return roles
        roles = dict(self._static_roles)
        for pod, facts in self.discovery.discovered().items():
            role = facts.get("role")
            if role:
                roles[pod] = Role(role)
        self._roles_cache = (now, roles)
        return roles

    def known_models(self) -> list[str]:
        return sorted(self._models())

    def _configured_models(self) -> list[str]:
        """Models named by configuration alone: what the startup line can say without
        reading the index (a Redis that is down at startup must not stop the start)."""
        configured = set(self.catalog.configured())
        if self.settings.events.model:
            configured.add(self.settings.events.model)
        return sorted(configured)

    def knows_model(self, model: str) -> bool:
        """Configured (model config or --model), or seen in events or the index; a gateway
        asking about a configured model before its first events gets zeros, not 404."""
        if self.catalog.is_configured(model) or model == self.settings.events.model:
            return True
        if model in self._models():
            return True
        # A model whose first events just arrived: look again, at most ten times a second.
        return model in self._models(max_age_s=0.1)

    def _models(self, max_age_s: float = 1.0) -> frozenset[str]:
        """Configured models, models seen in events, and models in the (maybe shared)
        index, cached so /score usually pays a set lookup."""
        now = time.monotonic()
        refreshed, models = self._models_cache
        if now - refreshed < max_age_s:
            return models
        found = set(self._configured_models())
        found.update(s.model for s in self.subscriber.streams() if s.model)
        found.update(m for m in self.backend.models() if not is_group_namespace(m))
        models = frozenset(found)
        self._models_cache = (now, models)
        return models

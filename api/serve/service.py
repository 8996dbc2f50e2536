"""The composition root: one function's worth of wiring from Settings to a running service.

Every part is built here and handed what it needs; nothing else constructs a backend,
a subscriber or a registry. Tests build a Service from Settings in two lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import zmq
from prometheus_client import CollectorRegistry, disable_created_metrics

from kvindex.api.http.route_view import RouteView
from kvindex.api.serve.health import BackendHealthLog
from kvindex.api.serve.index_figures import LatestFigures, read_figures
from kvindex.api.serve.peers import PeerRecovery, parse_peers
from kvindex.api.serve.route_metrics import (
    EventLagCollector,
    LoadCollector,
    RouteCollector,
    SpeculativeCollector,
)
from kvindex.api.serve.service_metrics import (
    IndexWorkCollector,
    PeerRecoveryCollector,
    RedisCollector,
    ScoreMetrics,
    ServiceCollector,
    SnapshotCollector,
    register_process_metrics,
)
from kvindex.api.serve.settings_derived import (
    ConfigError,
    Settings,
    admin_token,
    build_catalog,
    check_bind_endpoint,
    check_tokenizer_dirs,
    discovery_config,
    tokenizer_dirs,
)
from kvindex.api.version import VERSION, implementations
from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.discovery.kubernetes import KubernetesDiscovery
from kvindex.events.errors import Forbidden, Unavailable
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.indexer.backend import BackendError, IndexBackend
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.instrumented import InstrumentedSink
from kvindex.indexer.kv_groups import is_group_namespace
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.snapshot import IndexImage, SnapshotGate, Snapshotter
from kvindex.indexer.memory.snapshot_file import SnapshotBytes
from kvindex.indexer.models import Engine
from kvindex.indexer.pods import Mark, PodDirectory
from kvindex.indexer.verify import HashVerifier
from kvindex.scoring.clock import ExternalClock
from kvindex.scoring.prompt.tokenize import TokenizerRegistry
from kvindex.scoring.route.event_lag import EventLag
from kvindex.scoring.route.pd import Role
from kvindex.scoring.scorer import Scorer

if TYPE_CHECKING:
    pass

from kvindex.api.serve.service_parts import (
    make_backend,
    make_index_work,
    make_leases,
    make_routing,
    parse_connect,
    replay_endpoints,
    snapshot_backend,
    static_roles,
)

log = logging.getLogger(__name__)


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
        peers = parse_peers(settings.index.peers)
        self._static_roles = static_roles(settings)  # known pods, before they publish
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
                catch_up_on_first_contact=settings.events.catch_up_on_first_contact,
                queue_capacity=settings.events.stream_queue,
                queue_bytes=settings.events.queue_memory << 20,
                default_serving_port=settings.events.serving_port,
                default_model=settings.events.model,
                bind_allow=tuple(settings.events.bind_allow),
                max_streams_per_sender=settings.events.max_streams_per_sender,
                pods=tuple(sorted(self.configured_pods())),
                models=tuple(self._configured_models()),
                max_models=settings.events.max_models,
                sglang_models=tuple(self.catalog.models_with(Engine.SGLANG)),
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
        self.index_image: IndexImage | None = None
        self.peer_recovery: PeerRecovery | None = None
        if snapshotted is not None and self.snapshot_gate is not None:
            self.index_image = IndexImage(
                snapshotted, self.ingestor, self.snapshot_gate, self.subscriber.streams
            )
            if peers and self.admin_token:
                self.peer_recovery = PeerRecovery(
                    peers, self.admin_token, self.index_image, self.snapshot_gate
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
                unheard=lambda: self.directory.unheard_pods(),
            )
        )
        self.registry.register(IndexWorkCollector(self.index_work))
        if self.leases is not None:
            self.registry.register(RedisCollector(self.leases.backend, self.leases))
            owners = owners or self.leases.owners
        if self.snapshotter is not None and self.snapshot_gate is not None:
            self.registry.register(SnapshotCollector(self.snapshotter, self.snapshot_gate))
        if self.peer_recovery is not None:
            self.registry.register(PeerRecoveryCollector(self.peer_recovery.stats))
        self.directory = PodDirectory(
            self.backend,
            self.subscriber.streams,
            self.verifier,
            discovered,
            owners,
            marks=self._marks(),
            expected=self.configured_pods,
            ingest_failure=lambda: self.subscriber.failure,
        )
        # --clock external: the caller's virtual time ages /route's state (a simulator's
        # reproducible runs; the hot path moves it from each call's ?now=).
        self.route_clock = ExternalClock() if settings.scoring.clock == "external" else None
        clock = self.route_clock or time.monotonic
        if route_seed is None:
            route_seed = settings.scoring.route_seed
        self.routing = make_routing(
            settings, self.known_pods, self.event_lag, self.roles, route_seed, clock,
            self.may_push_load if self.catalog.models_with(Engine.SGLANG) else None,
            self.ingestor.sessions.member_of,
        )  # fmt: skip
        self.load = self.routing.loads  # started and stopped with the service
        self.speculative = self.routing.speculative  # /score shows them too
        self.registry.register(RouteCollector(self.routing))
        self.registry.register(LoadCollector(self.load, self.routing.ledger, self.routing.outliers))
        self.registry.register(SpeculativeCollector(self.speculative))
        self.registry.register(EventLagCollector(self.event_lag))
        self.route_view = RouteView(self.known_pods, self.directory.index_doubts)
        self._roles_cache: tuple[float, dict[str, Role]] = (float("-inf"), {})
        self.bound: list[str] = []
        self.backend_health = BackendHealthLog(self.backend)
        self.started = False
        self.draining = False
        self.tokenizer_problem: str | None = None  # set by start(); fails /readyz in gateway mode
        self._models_cache: tuple[float, frozenset[str]] = (float("-inf"), frozenset())

    def start(self) -> None:
        self.started = True
        self.backend_health.start()
        if self.leases is not None:
            self.leases.start(on_marks_changed=self.directory.marks_changed)
        # Before any batch is applied: the snapshot, else a peer's copy.
        restored = self.snapshotter.restore() if self.snapshotter is not None else None
        if self.peer_recovery is not None and restored != "restored":
            self.peer_recovery.recover()
        self.subscriber.start()
        for endpoint in self.settings.events.zmq_bind:
            try:
                self.bound.append(self.subscriber.bind(endpoint))
            except zmq.ZMQError as exc:
                self.stop()
                raise ConfigError(f"--zmq-bind {endpoint}: cannot bind: {exc}") from None
        for target in self._connect:
            self.subscriber.connect(target)  # the receiver logs it
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

        if self.bound and self._bind_open():
            log.warning(
                "bind mode accepts KV events from ANY sender that reaches %s and names "
                "its own address: it is indexed and routed to. Name the pods (--pod-role, "
                "--zmq-connect), allow their networks (--bind-allow CIDR) or use "
                "--k8s-namespace discovery",
                ", ".join(self.bound),
            )
        self.tokenizer_problem = self._check_tokenizers()
        log.info("%s", self.startup_summary())

    def _bind_open(self) -> bool:
        """Whether bind mode accepts any pod that sends from its own host: no pods are
        configured or allowlisted and discovery is off (:mod:`kvindex.events.ingest.admission`)."""
        restricted = self.configured_pods() or self.settings.events.bind_allow
        return self.discovery is None and not restricted

    def startup_summary(self) -> str:
        """One line that tells an operator what this process is: version, index, hashing,
        models, where it listens and where its events come from."""
        keying = self.catalog.keying(self.settings.events.model or "")
        backend = self.settings.index.backend
        if "@" in backend:  # redis://user:password@host: keep the password out of logs
            scheme, _, rest = backend.partition("://")
            backend = f"{scheme}://***@{rest.rpartition('@')[2]}"
        anyone = " (ANY sender accepted)" if self._bind_open() else ""
        events = [f"bind {e}{anyone}" for e in self.bound]
        events += [f"connect {t.endpoint}" for t in self._connect]
        if self.settings.k8s.namespace:
            events.append(
                f"k8s {self.settings.k8s.mode} {','.join(self.settings.k8s.namespace)} "
                f"({self.settings.k8s.selector})"
            )
        return (
            f"kvindex {VERSION} started: backend={backend} ({implementations()}) "
            f"hash_algo={keying.hash.algo.value} "
            f"block_size={keying.hash.block_size} key_mode={keying.key_mode.value} "
            f"models={','.join(self._configured_models()) or '(from events)'} "
            f"listen={self.settings.http.listen} events={'; '.join(events) or 'none'}"
        )

    def _check_tokenizers(self) -> str | None:
        """Why text prompts of configured models cannot be routed by cache, said once at
        startup: the gateway has only text, so without its model's tokenizer every request
        it routes falls back to load alone and is answered as usual; nobody would notice."""
        models = self._configured_models()
        gateway = self.settings.gateway.enabled
        if not models:
            if gateway:
                log.warning(
                    "--gateway with no model configured: text prompts are routed by cache "
                    "only for models whose tokenizer is in the local Hugging Face cache; "
                    "name each model with `tokenizer: <dir>` under `models:` in --model-config"
                )
            return None
        unusable = self.tokenizers.unusable(models)
        if not unusable:
            return None
        why = "; ".join(dict.fromkeys(unusable.values()))
        problem = f"no usable tokenizer for {', '.join(map(repr, unusable))}: {why}"
        if gateway:
            log.warning("%s", self._gateway_blind(problem))
        else:
            log.warning(
                "%s (text prompts for these: /score answers 503, /route falls back to load "
                "alone; token_ids need no tokenizer)",
                problem,
            )
        return problem

    @staticmethod
    def _gateway_blind(problem: str) -> str:
        return (
            "the gateway routes these models' requests by load alone, never by cache "
            f"(fallback_tokenizer_unavailable): {problem}"
        )

    def begin_shutdown(self) -> None:
        """A shutdown signal arrived. /readyz fails from now on, so the load balancer
        stops sending traffic while the requests in flight finish (``--drain-timeout``),
        and the snapshot is written now rather than after the drain, which the
        orchestrator's SIGKILL may cut short. Ingest goes on until :meth:`stop`."""
        self.draining = True
        if self.snapshotter is not None:
            self.snapshotter.write_now()

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

    def _marks(self) -> Callable[[], Mapping[str, Mark]] | None:
        """Streams whose entries are not known complete for reasons their own state
        does not show: restored from a snapshot, or lost with the Redis index."""
        if self.snapshot_gate is not None:
            return self.snapshot_gate.marks
        return self.leases.marks if self.leases is not None else None

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
            self.ingestor.sessions.forget(member)
            if self.snapshot_gate is not None:
                self.snapshot_gate.purged(member)
        log.info("operator purged pod %s (%d entries)", pod, removed)
        return members, removed

    def readiness_problems(self) -> list[str]:
        problems = []
        if self.draining:
            problems.append(
                "shutting down: finishing the requests in flight (at most --drain-timeout "
                f"{self.settings.http.drain_timeout:g} s)"
            )
        try:
            self.backend.ping()
        except BackendError as exc:
            problems.append(f"index backend unavailable: {exc}")
        if self.subscriber.failure is not None:
            problems.append(f"KV-event ingestion stopped: {self.subscriber.failure}")
        elif not self.subscriber.is_running():
            problems.append("event subscriber is not running")
        if not self.has_event_source() and self.settings.index.backend == "memory":
            problems.append(
                "no event source configured, so the in-memory index stays empty: add "
                "--zmq-bind tcp://*:5557 (pods connect to kvindex), --zmq-connect "
                "tcp://POD_IP:5557 or --k8s-namespace NS"
            )
        if self.discovery is not None:
            problems.extend(self.discovery.problems())
        if self.tokenizer_problem is not None and self.settings.gateway.enabled:
            problems.append(self._gateway_blind(self.tokenizer_problem))
        return problems

    def has_event_source(self) -> bool:
        return bool(self.settings.events.zmq_bind or self._connect or self.discovery is not None)

    def readiness_notes(self) -> list[str]:
        """Why a replica that looks idle is ready anyway, and where its index came from
        when a peer was asked for it."""
        notes = []
        if not self.has_event_source():
            notes.append("no event source configured: answering from the shared index only")
        peer_note = self.peer_recovery.note() if self.peer_recovery is not None else None
        if peer_note is not None:
            notes.append(peer_note)
        return notes

    def dump(self) -> SnapshotBytes:
        """A consistent cut of the memory index for a peer's ``--peers`` recovery (the
        snapshot format). Forbidden where this replica keeps no stream positions to
        ship with it; Unavailable when no cut could be taken now."""
        if self.index_image is None:
            raise Forbidden(
                "this replica serves no dumps: it keeps stream positions with the memory "
                "backend and --peers or --snapshot only (give every replica the same "
                "--peers list)",
                code="dump_unavailable",
            )
        tree = self.index_image.take()
        if tree is None:
            raise Unavailable(
                "no consistent cut of the index now (a delivery stayed in flight); retry",
                code="dump_busy",
            )
        return SnapshotBytes(tree)

    def configured_pods(self) -> set[str]:
        """Pods named by configuration (``--zmq-connect``, ``--pod-role``)."""
        pods = {target.pod for target in self._connect if target.pod}
        pods.update(self._static_roles)
        return pods

    def known_pods(self) -> list[str]:
        """Pods /route chooses among when a request names none, and whose load is
        scraped: configured (--zmq-connect, --pod-role), discovered, or in the index or
        its streams. Configured pods count before they publish anything: in bind mode
        without discovery they would otherwise never be chosen, by a gateway least of
        all, since it names no pods."""
        try:
            pods = self.directory.known_pods()
        except BackendError:  # the index is down: the pods this process hears from
            return self.known_without_index()
        pods.update(self.configured_pods())
        return sorted(pods)

    def may_push_load(self) -> list[str]:
        """The known pods whose load topic is looked for (each one's /server_info says
        whether it has one): all but those whose events name only models without SGLang
        pods (a vLLM pod has none)."""
        sglang = set(self.catalog.models_with(Engine.SGLANG))
        models: dict[str, set[str]] = {}
        for stream in self.subscriber.streams():
            if stream.model:
                models.setdefault(stream.pod, set()).add(stream.model)
        return [
            pod
            for pod in self.known_pods()
            if pod not in models or not models[pod].isdisjoint(sglang)
        ]

    def known_without_index(self) -> list[str]:
        """The known pods this process can name without reading the index: those it
        hears from, discovered or configured. /route's candidates while the backend is
        down or too slow to ask."""
        pods = {stream.pod for stream in self.subscriber.streams()}
        if self.discovery is not None:
            pods.update(self.discovery.discovered())
        pods.update(self.configured_pods())
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

    def own_keys_of(self, published: list[int]) -> list[int | None]:
        """The index keys of block hashes SGLang pods published (None where none did):
        the ingestor learnt them from the pods' stores (token-key mode)."""
        return self.ingestor.own_keys_of(published)

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

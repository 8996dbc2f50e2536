"""Building each part of a :class:`~kvindex.api.serve.service.Service` from Settings: the
backend, leases, off-loop index work, the snapshot's backend, replay endpoints, connect
targets, the routing state and decision, and static pod roles. One factory per part, so
the composition root reads as a list of parts and each rule lives in one place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from kvindex.api.http.offload import IndexWork
from kvindex.api.serve.settings_derived import (
    ConfigError,
    Settings,
    admin_token,
)
from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.ingest.replay_endpoints import (
    ReplayEndpointError,
    ReplayEndpoints,
    parse_pod_replay_endpoint,
    split_connect_spec,
)
from kvindex.events.wire.endpoints import PodEndpoint, endpoint_host, tcp_endpoint
from kvindex.events.wire.identity import IdentityError, normalize_pod
from kvindex.indexer.backend import IndexBackend
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.scoring.load import LoadView
from kvindex.scoring.load_push import PushedLoads
from kvindex.scoring.route.decision import Admission, Router
from kvindex.scoring.route.event_lag import EventLag
from kvindex.scoring.route.inflight import InFlightLedger
from kvindex.scoring.route.outlier import EjectionPolicy, OutlierDetector
from kvindex.scoring.route.pd import Role, parse_role
from kvindex.scoring.route.routing import Routing
from kvindex.scoring.route.speculative import SpeculativeIndex

if TYPE_CHECKING:
    from kvindex.indexer.redis.leases import RedisLeases


log = logging.getLogger("kvindex.api.serve.service")


def make_backend(settings: Settings) -> IndexBackend:
    """``memory`` (embedded, the default) or ``redis://host:port/db`` (shared)."""
    spec = settings.index.backend
    if spec == "memory":
        index = settings.index
        return MemoryBackend(
            capacity_blocks=index.capacity_blocks, expected_keys=index.expected_blocks or None
        )
    if spec.startswith(("redis://", "rediss://", "unix://")):
        try:
            from kvindex.indexer.redis.backend import RedisBackend
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
        from kvindex.indexer.redis.backend import RedisBackend
        from kvindex.indexer.redis.leases import RedisLeases
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
    ``--backend-max-in-flight`` (:mod:`kvindex.api.http.offload`)."""
    index = settings.index
    for flag, value in (
        ("--backend-deadline", index.backend_deadline),
        ("--backend-max-in-flight", index.backend_max_in_flight),
    ):
        if value <= 0:
            raise ConfigError(f"{flag} {value}: must be positive")
    return IndexWork(
        inline=getattr(backend, "never_waits", False),
        deadline_s=index.backend_deadline,
        max_in_flight=index.backend_max_in_flight,
    )


def snapshot_backend(settings: Settings, backend: IndexBackend) -> MemoryBackend | None:
    """The backend whose cuts are saved (``--snapshot``) or copied between replicas
    (``--peers``): the memory backend only (Redis keeps its own data across kvindex
    restarts, and its replicas share it). Refuses settings that cannot work before
    anything starts."""
    index = settings.index
    if not index.snapshot and not index.peers:
        return None
    if not isinstance(backend, MemoryBackend):
        flag = "--snapshot" if index.snapshot else "--peers"
        raise ConfigError(
            f"{flag} works with the memory backend; a Redis index survives kvindex "
            f"restarts on its own and its replicas share it (drop {flag}, or use "
            "--backend memory)"
        )
    if index.peers and not admin_token(settings):
        raise ConfigError(
            "--peers needs the admin token: a peer's /index/dump is an operator endpoint; "
            "give every replica the same KVINDEX_ADMIN_TOKEN or --admin-token-file"
        )
    if not index.snapshot:
        return backend
    if index.snapshot_interval < 0:
        raise ConfigError(f"--snapshot-interval {index.snapshot_interval}: must be >= 0")
    directory = Path(index.snapshot).parent
    if not directory.is_dir():
        raise ConfigError(f"--snapshot {index.snapshot}: directory {directory} does not exist")
    return backend


def replay_endpoints(settings: Settings, known: KnownPods | None) -> ReplayEndpoints:
    """Each stream's replay endpoint: ``--replay-endpoint``, discovery's annotations, then
    the ``--replay-port`` rule (:mod:`kvindex.events.ingest.replay_endpoints`)."""
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
    event_lag: EventLag,
    roles: Callable[[], Mapping[str, Role]],
    seed: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    push_pods: Callable[[], Iterable[str]] | None = None,
    sessions: Callable[[str, str], str | None] | None = None,
) -> Routing:
    """/route's parts: the load view scraping every known pod (and following the load
    topic of ``push_pods``, unless --no-load-push), and the routing state and decision
    over it; ``clock`` ages their state (the ledger, session homes, speculative entries,
    ejections, scrape ages), ``seed`` seeds the router's tie-breaks, ``sessions`` says
    where a client session last ran (the ingestor's
    :meth:`~kvindex.indexer.sessions.SessionPods.member_of`)."""
    scoring = settings.scoring
    if scoring.load_interval <= 0 or scoring.load_timeout <= 0:
        raise ConfigError("--load-interval and --load-timeout must be positive")
    if scoring.load_stale_after < 0:
        raise ConfigError(
            f"--load-stale-after {scoring.load_stale_after}: must be >= 0 (0: 3 intervals)"
        )
    if scoring.route_ttl <= 0:
        raise ConfigError(f"--route-ttl {scoring.route_ttl}: must be positive")
    if not 0 < scoring.max_kv_usage <= 1:
        raise ConfigError(f"--max-kv-usage {scoring.max_kv_usage}: must be in (0, 1]")
    if scoring.max_waiting < 0:
        raise ConfigError(f"--max-waiting {scoring.max_waiting}: must be >= 0 (0: no limit)")
    if scoring.max_event_lag < 0:
        raise ConfigError(f"--max-event-lag {scoring.max_event_lag}: must be >= 0 (0: off)")
    if scoring.eject_base <= 0 or not 0 <= scoring.eject_max_percent <= 100:
        raise ConfigError("--eject-base must be positive and --eject-max-percent in 0..100")
    if scoring.pd_threshold < 0:
        raise ConfigError(f"--pd-threshold {scoring.pd_threshold}: must be >= 0")
    outliers = OutlierDetector(
        EjectionPolicy(scoring.eject_after, scoring.eject_base, scoring.eject_max_percent),
        clock,
    )
    view = LoadView(
        interval_s=scoring.load_interval,
        timeout_s=scoring.load_timeout,
        stale_after_s=scoring.load_stale_after or None,
        clock=clock,
        pods_source=pods,
        outliers=outliers,
        pushes=(
            PushedLoads(push_pods, clock=clock, timeout_s=scoring.load_timeout)
            if push_pods is not None and scoring.load_push
            else None
        ),
    )
    admission = Admission(scoring.max_kv_usage, scoring.max_waiting)
    least_bad = scoring.when_full == "least_bad"
    return Routing(
        Router(scoring.route_weights, admission, seed, least_bad=least_bad),
        view,
        InFlightLedger(clock),
        make_speculative(settings, clock),
        outliers,
        event_lag,
        roles,
        route_ttl=scoring.route_ttl,
        pd_threshold=scoring.pd_threshold,
        sessions=sessions,
    )


def make_speculative(
    settings: Settings, clock: Callable[[], float] = time.monotonic
) -> SpeculativeIndex:
    scoring = settings.scoring
    try:
        return SpeculativeIndex(scoring.speculative_ttl, scoring.speculative_max_blocks, clock)
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

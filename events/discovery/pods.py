"""What a Kubernetes pod means to kvindex: its id, model and event endpoints.

Pure functions over the few pod fields discovery decides on (no API calls, no threads):
:class:`PodFacts` is read from a pod object, :func:`plan_pod` turns it into a
:class:`PodPlan` - the pod id ``podIP:servingPort`` (the address a gateway routes to and
the ``<pod>`` of the ``kv@<pod>@<model>`` topic convention) and one
:class:`~kvindex.events.wire.endpoints.PodEndpoint` per data-parallel rank. Ports, model and
data-parallel size come from annotations, then from named container ports, then from
the defaults in :class:`DiscoveryConfig`. :mod:`kvindex.events.discovery.kubernetes` keeps the
subscriber in line with these plans as pods come and go.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvindex.events.ingest.replay_endpoints import ReplayEndpointError, check_replay_endpoint
from kvindex.events.wire.endpoints import PodEndpoint, offset_endpoint_port, tcp_endpoint
from kvindex.events.wire.identity import IdentityError, normalize_pod, pod_host

#: Pods are skipped when their data-parallel-size annotation is above this: a typo such
#: as ``80`` instead of ``8`` must not open eighty sockets.
_MAX_DP_SIZE = 64
#: Phases after which a pod's containers never run again.
_FINISHED_PHASES = frozenset({"Succeeded", "Failed"})
#: P/D roles a pod can carry (kvindex.scoring.route.pd.Role: events/ cannot import it).
ROLES = ("prefill", "decode", "both")


class DiscoveryMode(enum.Enum):
    #: kvindex connects to each pod's publisher (vLLM's default ``tcp://*:5557``).
    CONNECT = "connect"
    #: the pods' publishers connect to kvindex's bound socket; discovery only names and
    #: forgets pods.
    BIND = "bind"


class DiscoveryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which pods to watch and how to read their ports and model.

    Per pod, each value is taken from its annotation if set, else from the container port
    with the given name (ports only), else from the default here.
    """

    #: Namespaces to watch; each needs a Role granting get/list/watch on pods.
    namespaces: tuple[str, ...] = ("default",)
    #: Label selector of the vLLM pods, as ``kubectl get pods -l`` takes it.
    label_selector: str = "kvindex.io/enabled=true"
    mode: DiscoveryMode = DiscoveryMode.CONNECT
    #: How long a pod may be not ready before its subscription and entries are dropped.
    grace_s: float = 30.0
    #: A full relist this often, even when the watch looks healthy.
    resync_s: float = 300.0
    #: The port a gateway sends requests to (vLLM's ``--port``); part of the pod id.
    serving_port: int = 8000
    #: The port of ``endpoint`` in ``--kv-events-config`` (rank r publishes on port + r).
    events_port: int = 5557
    #: The port of ``replay_endpoint`` (rank r on port + r); 0: the pods run without one.
    replay_port: int = 5558
    #: Model for pods without the model annotation; None: the topic or the subscriber's
    #: default model names it.
    model: str | None = None
    serving_port_annotation: str = "kvindex.io/serving-port"
    events_port_annotation: str = "kvindex.io/events-port"
    replay_port_annotation: str = "kvindex.io/replay-port"
    #: The pod's own replay endpoint for rank 0 (``tcp://HOST:PORT``; host ``*`` means
    #: the pod's IP, so vLLM's own ``replay_endpoint`` value can be copied); beats the
    #: port rule, and is the only way bind mode learns a per-pod endpoint from Kubernetes.
    replay_endpoint_annotation: str = "kvindex.io/replay-endpoint"
    model_annotation: str = "kvindex.io/model"
    data_parallel_annotation: str = "kvindex.io/data-parallel-size"
    #: The pod label naming its P/D role for /route: prefill, decode or both (absent).
    role_label: str = "kvindex.io/role"
    serving_port_name: str = "http"
    events_port_name: str = "kv-events"
    replay_port_name: str = "kv-replay"
    #: Timeout of a list request, and of connecting for a watch.
    request_timeout_s: float = 10.0
    #: First and longest wait before retrying after the API server failed.
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.namespaces:
            raise ValueError("DiscoveryConfig.namespaces must name at least one namespace")
        if self.grace_s < 0:
            raise ValueError("DiscoveryConfig.grace_s must be >= 0")
        for name in ("backoff_initial_s", "backoff_max_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"DiscoveryConfig.{name} must be > 0")
        if self.resync_s < 1:
            raise ValueError("DiscoveryConfig.resync_s must be >= 1 (watch timeouts are whole s)")
        for name in ("serving_port", "events_port"):
            if not 0 < getattr(self, name) < 65536:
                raise ValueError(f"DiscoveryConfig.{name} {getattr(self, name)} is not a port")
        if not 0 <= self.replay_port < 65536:
            raise ValueError(f"DiscoveryConfig.replay_port {self.replay_port} is not a port")


# -- what a pod is to kvindex (pure functions, no API calls) -------------------------


@dataclass(frozen=True, slots=True)
class PodFacts:
    """The fields of a Kubernetes pod that discovery decides on."""

    namespace: str
    name: str
    uid: str
    ip: str | None
    phase: str | None
    ready: bool
    terminating: bool
    node: str | None
    annotations: Mapping[str, str]
    #: Named container ports of every container: name -> containerPort.
    ports: Mapping[str, int]
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def serving(self) -> bool:
        """Running, Ready, with an IP and not on its way out: worth subscribing to."""
        return self.phase == "Running" and self.ready and bool(self.ip) and not self.terminating

    @property
    def finished(self) -> bool:
        """Deleted-to-be or done: it will never serve again under this UID."""
        return self.terminating or self.phase in _FINISHED_PHASES

    @classmethod
    def from_pod(cls, pod: Any) -> PodFacts:
        """Read a ``kubernetes.client.V1Pod`` (any client version: attribute access only)."""
        meta, spec, status = pod.metadata, pod.spec, pod.status
        ports: dict[str, int] = {}
        for container in (spec.containers if spec is not None else None) or []:
            for port in container.ports or []:
                if port.name and port.container_port:
                    ports.setdefault(port.name, int(port.container_port))
        ready = any(
            c.type == "Ready" and c.status == "True"
            for c in ((status.conditions if status is not None else None) or [])
        )
        return cls(
            namespace=meta.namespace or "",
            name=meta.name or "",
            uid=meta.uid or "",
            ip=(status.pod_ip if status is not None else None) or None,
            phase=status.phase if status is not None else None,
            ready=ready,
            terminating=meta.deletion_timestamp is not None,
            node=spec.node_name if spec is not None else None,
            annotations=dict(meta.annotations or {}),
            ports=ports,
            labels=dict(meta.labels or {}),
        )


class PodConfigError(ValueError):
    """A pod's annotations or ports cannot be used; the message names the annotation."""


@dataclass(frozen=True, slots=True)
class PodPlan:
    """How kvindex listens to one pod: its id, model and event endpoints.

    ``endpoints`` has one entry per data-parallel rank in connect mode and is empty in
    bind mode (the pod connects to kvindex). ``replay_endpoint`` is rank 0's endpoint
    from the replay-endpoint annotation (None without one), for bind-mode streams.
    """

    pod_id: str
    uid: str
    model: str | None
    data_parallel_size: int
    endpoints: tuple[PodEndpoint, ...]
    replay_endpoint: str | None = None


def plan_pod(facts: PodFacts, config: DiscoveryConfig) -> PodPlan:
    """What ``facts`` means for kvindex; raise PodConfigError for unusable annotations.

    vLLM gives data-parallel rank r the ports ``events_port + r`` and ``replay_port + r``
    (0.9 - 0.33), and each rank is its own stream with its own ``rank``; a
    replay-endpoint annotation is rank 0's, offset the same way.
    """
    if not facts.ip:
        raise PodConfigError(f"pod {facts.namespace}/{facts.name} has no IP yet")
    serving = _port(
        facts, config.serving_port_annotation, config.serving_port_name, config.serving_port
    )
    events = _port(
        facts, config.events_port_annotation, config.events_port_name, config.events_port
    )
    replay = _port(
        facts,
        config.replay_port_annotation,
        config.replay_port_name,
        config.replay_port,
        allow_zero=True,
    )
    ranks = _data_parallel_size(facts, config.data_parallel_annotation)
    model = facts.annotations.get(config.model_annotation) or config.model
    try:
        pod_id = normalize_pod(facts.ip, serving)
    except IdentityError as exc:
        raise PodConfigError(f"pod {facts.namespace}/{facts.name}: {exc}") from None
    own_replay = _replay_endpoint(facts, config.replay_endpoint_annotation, pod_id)
    endpoints: tuple[PodEndpoint, ...] = ()
    if config.mode is DiscoveryMode.CONNECT:
        _check_rank_ports(facts, events, 0 if own_replay else replay, ranks)
        host = pod_host(pod_id)
        endpoints = tuple(
            PodEndpoint(
                tcp_endpoint(host, events + rank),
                pod=pod_id,
                model=model,
                replay_endpoint=_rank_replay(own_replay, host, replay, rank),
                rank=rank,
            )
            for rank in range(ranks)
        )
    return PodPlan(pod_id, facts.uid, model, ranks, endpoints, own_replay)


def pod_role(facts: PodFacts, config: DiscoveryConfig) -> tuple[str, str | None]:
    """The pod's P/D role from its label (``both`` without one), and a problem line
    when the label names no role (the pod then counts as ``both``). Read apart from
    :func:`plan_pod`: a relabelled pod changes role without being resubscribed."""
    raw = facts.labels.get(config.role_label)
    role = (raw or "both").strip().lower()
    if role in ROLES:
        return role, None
    return "both", f"label {config.role_label}={raw!r} is not one of {', '.join(ROLES)}"


def _rank_replay(own: str | None, host: str, port: int, rank: int) -> str | None:
    """Rank ``rank``'s replay endpoint: the annotation's, else the port rule's, else none."""
    if own:
        return offset_endpoint_port(own, rank)
    return tcp_endpoint(host, port + rank) if port else None


def _replay_endpoint(facts: PodFacts, annotation: str, pod_id: str) -> str | None:
    """The pod's replay-endpoint annotation, ``*`` or ``0.0.0.0`` read as its own IP."""
    raw = facts.annotations.get(annotation)
    if raw is None:
        return None
    text = raw.strip()
    scheme, sep, rest = text.partition("://")
    host, colon, port = rest.rpartition(":")
    if sep and colon and host in ("*", "0.0.0.0", "[::]"):
        text = f"{scheme}://{pod_host(pod_id)}:{port}"
    try:
        return check_replay_endpoint(text)
    except ReplayEndpointError as exc:
        raise PodConfigError(
            f"pod {facts.namespace}/{facts.name}: annotation {annotation}={raw!r}: {exc}"
        ) from None


def _check_rank_ports(facts: PodFacts, events: int, replay: int, ranks: int) -> None:
    """Rank r uses ``events + r`` and ``replay + r``: both ranges must fit and not overlap.

    vLLM's defaults (5557 and 5558) collide from two ranks on: rank 1 would publish on
    rank 0's replay port. The pod must then give a replay port at least ``ranks`` above.
    """
    where = f"pod {facts.namespace}/{facts.name}"
    if events + ranks - 1 > 65535 or (replay and replay + ranks - 1 > 65535):
        raise PodConfigError(
            f"{where}: {ranks} data-parallel ranks from port {events} (replay {replay}) "
            "run past port 65535"
        )
    if replay and events < replay + ranks and replay < events + ranks:
        raise PodConfigError(
            f"{where}: {ranks} data-parallel ranks publish on ports {events}..{events + ranks - 1}"
            f" and replay on {replay}..{replay + ranks - 1}, which overlap; give the pod a "
            "replay_endpoint port (and the replay-port annotation) at least "
            f"{events + ranks}"
        )


def _port(
    facts: PodFacts, annotation: str, port_name: str, default: int, *, allow_zero: bool = False
) -> int:
    raw = facts.annotations.get(annotation)
    if raw is None:
        return facts.ports.get(port_name, default)
    text = raw.strip()
    low = 0 if allow_zero else 1
    if not (text.isascii() and text.isdigit()) or not low <= int(text) < 65536:
        raise PodConfigError(
            f"pod {facts.namespace}/{facts.name}: annotation {annotation}={raw!r} is not a "
            f"port ({low}..65535)"
        )
    return int(text)


def _data_parallel_size(facts: PodFacts, annotation: str) -> int:
    raw = facts.annotations.get(annotation)
    if raw is None:
        return 1
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= _MAX_DP_SIZE:
        raise PodConfigError(
            f"pod {facts.namespace}/{facts.name}: annotation {annotation}={raw!r} must be a "
            f"data-parallel size 1..{_MAX_DP_SIZE}"
        )
    return int(text)

"""Which replay endpoint a stream's missed batches are fetched from.

Every engine has its own replay ROUTER, so every stream must have its own endpoint: two
engines on one host (several vLLM instances on a bare-metal node, or pods with
``hostNetwork``) that were sent to ``<host>:<replay port>`` would replay each other's
batches into the wrong pod's index. :class:`ReplayEndpoints` is the rule for bind-mode
streams; in connect mode the endpoint belongs to the connect target
(``--zmq-connect 'tcp://HOST:PORT;replay=tcp://HOST:RPORT'``), and this module only
gives that syntax its one parser.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.wire.endpoints import offset_endpoint_port, tcp_endpoint
from kvindex.events.wire.identity import IdentityError, StreamId, normalize_pod, pod_host

#: The suffix of a connect spec that names its replay endpoint.
REPLAY_SUFFIX = ";replay="


class ReplayEndpointError(ValueError):
    """A replay endpoint spec that cannot be used; the message says why."""


def check_replay_endpoint(endpoint: str) -> str:
    """``endpoint`` if it is ``tcp://HOST:PORT`` (a port the ranks can offset), else raise."""
    scheme, _, rest = endpoint.partition("://")
    host, sep, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not host or host == "*" or not port.isdigit():
        raise ReplayEndpointError(
            f"replay endpoint {endpoint!r} must be tcp://HOST:PORT with the engine's address "
            "(vLLM binds its replay socket; kvindex connects to it)"
        )
    if not 0 < int(port) < 65536:
        raise ReplayEndpointError(f"replay endpoint {endpoint!r} has no valid port")
    return endpoint


def parse_pod_replay_endpoint(spec: str, default_port: int | None) -> tuple[str, str]:
    """``POD=tcp://HOST:RPORT`` -> (normalised pod id, endpoint); raise ReplayEndpointError."""
    pod, sep, endpoint = spec.partition("=")
    if not sep or not pod.strip():
        raise ReplayEndpointError(f"{spec!r} is not POD=tcp://HOST:RPORT")
    try:
        pod_id = normalize_pod(pod, default_port)
    except IdentityError as exc:
        raise ReplayEndpointError(f"{spec!r}: {exc}") from None
    return pod_id, check_replay_endpoint(endpoint.strip())


def split_connect_spec(spec: str) -> tuple[str, str | None]:
    """``ENDPOINT[;replay=REPLAY]`` -> (endpoint, replay endpoint or None)."""
    endpoint, sep, replay = spec.partition(REPLAY_SUFFIX)
    if not sep:
        return spec, None
    return endpoint, check_replay_endpoint(replay.strip())


def stream_replay_endpoint(
    stream: StreamId, pod_endpoint: str | None, replay_port: int | None
) -> str | None:
    """The rule itself: the pod's rank-0 endpoint offset by the rank, else the port rule."""
    if pod_endpoint is not None:
        return offset_endpoint_port(pod_endpoint, stream.rank)
    if replay_port:
        return tcp_endpoint(pod_host(stream.pod), replay_port + stream.rank)
    return None


class ReplayEndpoints:
    """``StreamId -> replay endpoint | None`` for bind-mode streams, handed to the
    :class:`~kvindex.events.ingest.subscriber.Subscriber` as its ``replay_resolver``.

    ``configured`` maps normalised pod ids to rank-0 endpoints (``--replay-endpoint``);
    ``known`` is what discovery learned (annotations), read at every call so a pod's
    endpoint follows its annotation; ``replay_port`` is the fallback port rule. For a
    stream ``(pod, rank)``:

    1. the pod's own endpoint: ``--replay-endpoint POD=tcp://HOST:RPORT`` (the
       operator's word), then the pod's ``kvindex.io/replay-endpoint`` annotation;
    2. else ``tcp://<pod host>:<replay_port + rank>``, right only while one engine runs
       per host;
    3. else none: gaps of that stream cannot be recovered (counted as missed).

    A per-pod endpoint is rank 0's: rank ``r`` is asked at the same host and
    ``RPORT + r``, because vLLM (0.9-0.33, ``ZmqEventPublisher.__init__`` ->
    ``offset_endpoint_port``) offsets both the events and the replay port by the rank.
    """

    def __init__(
        self,
        configured: Mapping[str, str] | None = None,
        replay_port: int | None = None,
        known: KnownPods | None = None,
    ) -> None:
        self._configured = {pod: check_replay_endpoint(e) for pod, e in (configured or {}).items()}
        self._replay_port = replay_port or None
        self._known = known

    def pod_endpoint(self, pod: str) -> str | None:
        """The pod's own rank-0 endpoint (flag, then annotation), or None."""
        endpoint = self._configured.get(pod)
        if endpoint is None and self._known is not None:
            endpoint = self._known.replay_endpoint(pod)
        return endpoint

    def __call__(self, stream: StreamId) -> str | None:
        return stream_replay_endpoint(stream, self.pod_endpoint(stream.pod), self._replay_port)

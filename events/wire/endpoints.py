"""ZMQ endpoint rules shared by every socket that carries KV events.

vLLM decides whether its PUB socket binds or connects from the endpoint's spelling, and
data-parallel ranks publish on offset ports. Both sides of the wire (the subscriber, the
engine-side publisher, capture and replay of recorded traffic) must apply exactly the
same rules, so they live here once.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

#: Hard cap on any one ZMQ message this package receives. ZMQ drops the connection of a
#: peer that sends more (``zmq.MAXMSGSIZE``) before buffering it, so a corrupt or hostile
#: sender cannot make the process allocate gigabytes. The configurable, smaller payload
#: limit is enforced after receipt and only costs the message.
HARD_MESSAGE_CAP = 256 * 1024 * 1024


def is_bind_endpoint(endpoint: str) -> bool:
    """True when vLLM's PUB socket would bind this endpoint rather than connect to it.

    vLLM 0.9-0.33 binds wildcard (``*``), IPv6-any (``::``), ``ipc://`` and ``inproc://``
    endpoints and connects to everything else; in the second case the subscriber is the
    side that must bind.
    """
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint_port(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank ``rank`` of an engine uses.

    vLLM gives each DP rank its own publisher: TCP ports are offset by the rank (port 0
    stays 0, left to the OS), inproc names get a ``_dp<rank>`` suffix.
    """
    if rank < 0:
        raise ValueError(f"data-parallel rank must be >= 0, got {rank}")
    if rank == 0:
        return endpoint
    scheme, _, rest = endpoint.partition("://")
    if scheme == "inproc":
        return f"{endpoint}_dp{rank}"
    if scheme == "tcp":
        host, sep, port = rest.rpartition(":")
        if not sep or not (port.isascii() and port.isdigit()):
            raise ValueError(f"endpoint {endpoint!r} has no numeric port to offset")
        if int(port) == 0:
            return endpoint
        return f"tcp://{host}:{int(port) + rank}"
    raise ValueError(
        f"cannot offset endpoint {endpoint!r} for data-parallel rank {rank}: "
        "only tcp:// and inproc:// endpoints can carry several ranks"
    )


def tcp_endpoint(host: str, port: int) -> str:
    """``tcp://host:port``; ``host`` is a hostname, an IPv4 address or a bracketed IPv6."""
    return f"tcp://{host}:{port}"


def prepare_socket(sock: zmq.Socket, endpoint: str) -> None:
    """Socket options an endpoint needs before bind/connect (IPv6 is off by default)."""
    if "[" in endpoint or "::" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)


def bind_socket(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the endpoint actually bound (``:0`` becomes the real port)."""
    prepare_socket(sock, endpoint)
    sock.bind(endpoint)
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)


@dataclass(frozen=True, slots=True)
class PodEndpoint:
    """One engine's event endpoint, for connect mode.

    ``endpoint`` is the engine's PUB address (``tcp://<pod-ip>:5557``, plus the rank for
    data-parallel ranks > 0). ``pod`` is the pod's routable identity (``ip:port`` of its
    serving endpoint); when None it is taken from a ``kv@<pod>@<model>`` topic or, failing
    that, from the endpoint's host and the subscriber's ``default_serving_port``.
    ``model`` likewise falls back to the topic, then to the subscriber's
    ``default_model``. ``rank`` is used when a batch does not carry its own.
    """

    endpoint: str
    pod: str | None = None
    model: str | None = None
    replay_endpoint: str | None = None
    rank: int = 0


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://host:port`` endpoint (brackets stripped), else None."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return None
    host, sep, _ = rest.rpartition(":")
    if not sep or not host or host == "*":
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def from_source(endpoint: str, source_host: str) -> str:
    """``tcp://HOST:PORT`` connected from ``source_host`` (ZMQ's ``tcp://SRC:0;HOST:PORT``).

    A connecting socket sends from the address this names, so the peer sees it as the
    sender's ``Peer-Address``: how a test or benchmark on loopback plays pods on several
    hosts (127.0.0.2, 127.0.0.3, ...) against bind mode's sender check.
    """
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        raise ValueError(f"a source address needs a tcp:// endpoint, not {endpoint!r}")
    return f"tcp://{source_host}:0;{rest}"

"""Who sent a batch: pod identities, vLLM event topics and stream ids.

A pod has exactly one identity, the ``host:port`` a gateway routes requests to (its
serving endpoint), however kvindex learned about it: from a bind-mode topic, from a
connect-mode endpoint, or from Kubernetes. Two spellings of one address must never
become two pods (the "IP vs IP:port gives all-zero scores" pitfall), so every path goes
through :func:`normalize_pod`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvindex.events.errors import ClientError

#: Topic convention for bind mode, where the topic is the only sender identity:
#: ``kv@<pod>@<model>``. The model may itself contain ``@``; the pod may not.
TOPIC_PREFIX = "kv@"
#: Longest host a pod id may name (DNS names are at most 253 characters).
MAX_HOST_CHARS = 253
#: Longest index member name: a host, brackets, a port and a data-parallel rank suffix.
MAX_MEMBER_CHARS = MAX_HOST_CHARS + len("[]:65535/dp4095")
#: Longest model name a topic may carry (what /score accepts, too).
MAX_MODEL_CHARS = 512


class IdentityError(ClientError):
    """A pod address or topic that cannot name a pod."""


def normalize_pod(address: str, default_port: int | None = None) -> str:
    """Canonical ``host:port`` for a pod address.

    Accepts ``10.0.0.1:8000``, ``10.0.0.1`` (with ``default_port``), ``[::1]:8000``,
    bare IPv6 (with ``default_port``), ``tcp://`` prefixes and hostnames. IP addresses
    are rewritten in their canonical form, hostnames lowercased, IPv6 bracketed.
    """
    text = address.strip()
    if "://" in text:
        text = text.split("://", 1)[1]
    text = text.rstrip("/")
    if not text:
        raise IdentityError(f"empty pod address {address!r}")
    host, port = _split_host_port(text)
    if len(host) > MAX_HOST_CHARS:
        raise IdentityError(f"pod address {address[:80]!r}... is longer than any host name")
    if port is None:
        if default_port is None:
            raise IdentityError(
                f"pod address {address!r} has no port and no default serving port is set"
            )
        port = default_port
    if not 0 < port < 65536:
        raise IdentityError(f"pod address {address!r} has port {port} outside 1..65535")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not host or any(c in host for c in "@/ ") or host == "*":
            raise IdentityError(f"pod address {address!r} has no usable host") from None
        return f"{host.lower()}:{port}"
    if ip.version == 6:
        return f"[{ip.compressed}]:{port}"
    return f"{ip.compressed}:{port}"


def _split_host_port(text: str) -> tuple[str, int | None]:
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise IdentityError(f"unterminated IPv6 literal in {text!r}")
        host, rest = text[1:end], text[end + 1 :]
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise IdentityError(f"garbage after IPv6 literal in {text!r}")
        return host, _parse_port(rest[1:], text)
    if text.count(":") > 1:  # bare IPv6, no port
        return text, None
    if ":" in text:
        host, port = text.rsplit(":", 1)
        return host, _parse_port(port, text)
    return text, None


def _parse_port(port: str, text: str) -> int:
    # isdigit() alone admits '²' (int() then raises) and Arabic-Indic digits (int()
    # accepts them): a port is ASCII digits only.
    if not (port.isascii() and port.isdigit()):
        raise IdentityError(f"port {port!r} in {text!r} is not a number (ASCII digits 0-9)")
    return int(port)


def pod_host(pod: str) -> str:
    """The host part of a normalised pod id, ready for a ``tcp://`` endpoint."""
    host, _ = _split_host_port(pod)
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True, slots=True)
class Topic:
    """A parsed ``kv@<pod>@<model>`` topic."""

    pod: str
    model: str


def parse_topic(topic: str, default_port: int | None = None) -> Topic:
    """Parse a bind-mode topic; raise IdentityError when it does not follow the convention."""
    if not topic.startswith(TOPIC_PREFIX):
        raise IdentityError(f"topic {topic!r} does not start with {TOPIC_PREFIX!r}")
    rest = topic[len(TOPIC_PREFIX) :]
    pod, sep, model = rest.partition("@")
    if not sep or not model:
        raise IdentityError(f"topic {topic!r} is not kv@<pod>@<model>")
    if len(model) > MAX_MODEL_CHARS:
        raise IdentityError(f"topic {topic[:80]!r}... names a model over {MAX_MODEL_CHARS} chars")
    return Topic(normalize_pod(pod, default_port), model)


def make_topic(pod: str, model: str) -> str:
    """The topic a vLLM pod should publish under for bind mode."""
    return f"{TOPIC_PREFIX}{pod}@{model}"


@dataclass(frozen=True, slots=True, order=True)
class StreamId:
    """One engine's event stream: a pod and its data-parallel rank.

    Each DP rank is a separate engine with its own sequence counter and its own KV
    cache, so each is a separate index member: ``member`` is the pod id for rank 0 and
    ``<pod>/dp<rank>`` for the others. (A BlockRemoved from rank 1 must not drop a block
    rank 0 still holds.)
    """

    pod: str
    rank: int = 0

    @property
    def member(self) -> str:
        return self.pod if self.rank == 0 else f"{self.pod}/dp{self.rank}"

    def __str__(self) -> str:
        return self.member


def member_pod(member: str) -> str:
    """The routable pod id of an index member (strips a ``/dp<rank>`` suffix)."""
    return member.split("/dp", 1)[0]

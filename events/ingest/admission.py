"""Who may speak for a pod in bind mode: the decisions at the door, as pure functions.

In bind mode every engine connects to kvindex's SUB socket and names itself in its
topic, ``kv@<pod>@<model>``; without checks, anyone who reaches the port could wipe any
pod with one ``AllBlocksCleared`` under its topic, inject blocks, or open thousands of
fake streams. The receiver asks these functions about every bind-mode message before
anything is queued; a rejection drops the message and is counted by its reason
(``kvindex_event_errors{reason=...}``, :func:`sender_problem`, :func:`stream_cap_problem`,
:class:`ModelAdmission`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.wire.identity import IdentityError, normalize_pod

UNDISCOVERED_POD = "undiscovered_pod"
SENDER_MISMATCH = "sender_mismatch"
SENDER_UNVERIFIABLE = "sender_unverifiable"
SENDER_STREAM_CAP = "sender_stream_cap"
UNLISTED_POD = "unlisted_pod"
MODEL_CAP = "model_cap"

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class AllowlistError(ValueError):
    """An allowlist entry that is neither a pod id nor a CIDR network."""


@dataclass(frozen=True, slots=True)
class Allowlist:
    """Pods whose topic may arrive from any address: by pod id, or by network of hosts."""

    pods: frozenset[str] = frozenset()
    networks: tuple[_Network, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str], default_port: int | None) -> Allowlist:
        """Entries are pod ids (``10.0.0.5:8000``; a bare host takes ``default_port``) or
        CIDR networks (``10.0.0.0/24``, ``fd00::/64``)."""
        pods: set[str] = set()
        networks: list[_Network] = []
        for raw in entries:
            entry = raw.strip()
            if "/" in entry:
                try:
                    networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError as exc:
                    raise AllowlistError(f"bind allowlist entry {raw!r}: {exc}") from None
                continue
            try:
                pods.add(normalize_pod(entry, default_port))
            except IdentityError as exc:
                raise AllowlistError(f"bind allowlist entry {raw!r}: {exc}") from None
        return cls(frozenset(pods), tuple(networks))

    def __bool__(self) -> bool:
        return bool(self.pods or self.networks)

    def allows(self, pod: str) -> bool:
        if pod in self.pods:
            return True
        if not self.networks:
            return False
        host = pod_address(pod)
        return host is not None and any(host in net for net in self.networks)


def pod_address(pod: str) -> _Address | None:
    """The IP address in a normalised pod id (``host:port``), None for a hostname."""
    host = pod.rpartition(":")[0].strip("[]")
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def peer_address(peer: str) -> _Address | None:
    """ZMQ's ``Peer-Address`` as an address; IPv4-mapped IPv6 is read as the IPv4."""
    try:
        address = ipaddress.ip_address(peer.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def sender_problem(
    pod: str,
    peer: str | None,
    allowlist: Allowlist,
    known: KnownPods | None,
    configured: frozenset[str] = frozenset(),
) -> str | None:
    """Why a message from ``peer`` may not speak for ``pod``; None when it may.

    ``peer`` is the message's ``Peer-Address`` (None or empty: a local transport);
    ``known`` is discovery's pods, None when discovery is off; ``configured`` the pods the
    operator named (``--pod-role``, ``--zmq-connect``). The reasons:

    * ``undiscovered_pod`` - Kubernetes discovery is on, does not know the pod, and no
      setting names it;
    * ``unlisted_pod`` - pods are configured (``--pod-role``, ``--zmq-connect``) or
      allowlisted (``--bind-allow``), discovery is off, and the pod is none of them;
    * ``sender_mismatch`` - the TCP peer (ZMQ's ``Peer-Address``) is not the host in the
      topic's pod id;
    * ``sender_unverifiable`` - the pod id's host is a name, not an address.

    Allowlisted pods (``--bind-allow``: a pod id, or a CIDR that pod hosts fall in) skip
    the address comparison - for engines behind NAT or a proxy - but not discovery or
    the caps; they also extend the configured pods. With no configured pods, no
    allowlist and no discovery, sending from its own host is all a pod needs (the
    service warns about that at start). ``ipc://`` and ``inproc://`` carry no peer
    address; only local processes can send those, so the address check does not apply.
    """
    roster = roster_problem(pod, known, configured, allowlist)
    if roster == UNDISCOVERED_POD:  # discovery is asked first
        return roster
    return address_problem(pod, peer, allowlist) or roster


def roster_problem(
    pod: str, known: KnownPods | None, configured: frozenset[str], allowlist: Allowlist
) -> str | None:
    """Why ``pod`` is not one bind mode accepts: discovered or configured with discovery
    on; else, once any pod is configured or allowlisted, configured or allowlisted."""
    if known is not None:
        return None if pod in known or pod in configured else UNDISCOVERED_POD
    # A roster is a closed list: a pod that merely sends from its own host is not on
    # it, or any host that reaches the port would be indexed and then routed to.
    if (configured or allowlist) and pod not in configured and not allowlist.allows(pod):
        return UNLISTED_POD
    return None


def address_problem(pod: str, peer: str | None, allowlist: Allowlist) -> str | None:
    """Why ``peer`` may not send for ``pod``: its host is another address (or a name,
    which cannot be compared), and the pod is not allowlisted."""
    if not peer or allowlist.allows(pod):
        return None
    host = pod_address(pod)
    if host is None:
        return SENDER_UNVERIFIABLE
    return None if peer_address(peer) == host else SENDER_MISMATCH


def stream_cap_problem(new_stream: bool, sender_streams: int, max_per_sender: int) -> str | None:
    """Why a sender may not open another stream (``sender_stream_cap``: it already has
    ``max_streams_per_sender``); None when it may (or the stream is old)."""
    if new_stream and sender_streams >= max_per_sender:
        return SENDER_STREAM_CAP
    return None


class ModelAdmission:
    """The model names events may bring into the index: configured ones always, others
    first come, first served up to ``max_models`` (past it: ``model_cap``, in either
    topology).

    Every model is a namespace in the index and a name in ``/score``'s answers, so a
    sender making up names would grow both without limit. An admitted model keeps its
    place until restart: its entries stay in the index while any pod holds them.
    Owned by the receiver thread.
    """

    def __init__(self, configured: Iterable[str], max_models: int) -> None:
        self._configured = frozenset(configured)
        self._max_models = max_models
        self._admitted: set[str] = set()

    def problem(self, model: str) -> str | None:
        """Why ``model`` may not be indexed; None when it may (admitting it if new)."""
        if model in self._admitted or model in self._configured:
            return None
        if len(self._admitted) >= self._max_models:
            return MODEL_CAP
        self._admitted.add(model)
        return None

    def __len__(self) -> int:
        """Models admitted besides the configured ones."""
        return len(self._admitted)

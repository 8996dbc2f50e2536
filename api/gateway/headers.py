"""Which headers cross the gateway: the client's to the pod, the pod's to the client.

Hop-by-hop headers (RFC 9110 7.6.1: ``Connection``, ``Keep-Alive``, ``Proxy-*``, ``TE``,
``Trailer``, ``Transfer-Encoding``, ``Upgrade``, and every header a ``Connection`` header
names) describe one connection, so they never cross, either way. Of a pod's answer only
the headers on an allowlist (``--gateway-relay-headers``) reach the client: a pod's
internal headers (a secret, a server banner, a header that claims to be kvindex's own)
are not the client's to see. The framing (``Content-Length``) is the relay's business
and is decided where the body is (:mod:`.upstream`).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvindex.api.gateway.pod_http import Header

# One connection's headers (RFC 9110 7.6.1), and the ones the servers on either side
# write themselves.
_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"date",
        b"server",
    }
)
# A request's headers that do not travel to the pod: the pod's answer is relayed as it
# was encoded, so the client's accept-encoding is not the pod's to honour.
_REQUEST_SKIP = _HOP | {b"accept-encoding"}


def _named_by_connection(headers: Iterable[Header]) -> frozenset[bytes]:
    """The header names a ``Connection`` header lists (hop-by-hop by that listing)."""
    return frozenset(
        token.strip().lower()
        for name, value in headers
        if name == b"connection"
        for token in value.split(b",")
    )


def forward_headers(raw: list[Header]) -> list[Header]:
    """The client's request headers (an ASGI scope's, names in lower case) the pod should
    see: auth, content type, ids; as bytes, as they came."""
    kept = [header for header in raw if header[0] not in _REQUEST_SKIP]
    if len(kept) == len(raw):  # nothing skipped: no Connection header to read either
        return kept
    named = _named_by_connection(raw)
    return [header for header in kept if header[0] not in named]


def first_header(raw: list[Header], name: bytes) -> bytes | None:
    """The value of the first ``name`` header (lower case) in ``raw``, as Starlette's
    ``Headers.get`` (vLLM's reader) takes it; None when absent."""
    for header, value in raw:
        if header == name:
            return value
    return None


class RelayedHeaders:
    """The allowlist of a pod's answer headers: exact names, and prefixes (``openai-*``)."""

    def __init__(self, allowed: Iterable[str]) -> None:
        names = [name.strip().lower().encode("latin-1") for name in allowed if name.strip()]
        self._exact = frozenset(n for n in names if not n.endswith(b"*")) - _HOP
        self._prefixes = tuple(n[:-1] for n in names if n.endswith(b"*"))

    def of_answer(self, headers: list[Header]) -> list[Header]:
        """The pod's answer headers (lower-case names) that reach the client."""
        named = _named_by_connection(headers)
        return [
            (name, value)
            for name, value in headers
            if (name in self._exact or (self._prefixes and name.startswith(self._prefixes)))
            and name not in _HOP
            and name not in named
        ]

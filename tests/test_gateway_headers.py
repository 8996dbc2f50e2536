"""Which headers cross the gateway (api/gateway/headers.py): hop-by-hop ones (RFC 9110
7.6.1, and those a Connection header names) neither way; of a pod's answer, only the
allowlist (``--gateway-relay-headers``)."""

from __future__ import annotations

from kvindex.api.gateway.headers import RelayedHeaders, forward_headers
from kvindex.api.serve.settings import DEFAULT_RELAY_HEADERS


def test_a_request_keeps_its_own_headers_and_loses_the_connections() -> None:
    raw = [
        (b"host", b"gateway"),
        (b"authorization", b"Bearer t"),
        (b"connection", b"keep-alive, x-hop"),
        (b"x-hop", b"for this connection only"),
        (b"te", b"trailers"),
        (b"x-request-id", b"r1"),
        (b"accept-encoding", b"gzip"),
    ]
    assert forward_headers(raw) == [(b"authorization", b"Bearer t"), (b"x-request-id", b"r1")]


def test_an_answer_keeps_only_the_allowlist_and_never_a_hop_by_hop_header() -> None:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"2"),
        (b"connection", b"x-ratelimit-limit-requests"),
        (b"x-ratelimit-limit-requests", b"named by connection"),
        (b"x-ratelimit-remaining-tokens", b"10"),
        (b"openai-version", b"2020-10-01"),
        (b"x-pod-secret", b"s"),
        (b"transfer-encoding", b"chunked"),
        (b"x-request-id", b"r1"),
    ]
    assert RelayedHeaders(DEFAULT_RELAY_HEADERS).of_answer(headers) == [
        (b"content-type", b"application/json"),
        (b"x-ratelimit-remaining-tokens", b"10"),
        (b"openai-version", b"2020-10-01"),
        (b"x-request-id", b"r1"),
    ]
    # Even listed, a hop-by-hop header stays; "*" lists everything else.
    everything = RelayedHeaders(["*", "Transfer-Encoding"]).of_answer(headers)
    assert [name for name, _ in everything] == [
        b"content-type",
        b"x-ratelimit-remaining-tokens",
        b"openai-version",
        b"x-pod-secret",
        b"x-request-id",
    ]

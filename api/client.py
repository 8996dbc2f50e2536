"""kvindex's HTTP API as typed Python calls, sync (:class:`Client`) and async
(:class:`AsyncClient`).

The request and answer types are the server's own (:mod:`kvindex.api.http.schemas`), so a
client and a server of the same version cannot disagree on a field. The client adds a
timeout on every call; bounded retries with backoff and jitter for failures another
attempt can cure (no connection, a timeout, 502/503/504, 429 ``too_many_requests``),
never for another 4xx; ``/route``'s 429 ``no_capacity`` as :class:`NoCapacity`, a
decision with the server's ``Retry-After``; a ``request_id`` given before the first
attempt, so a retried ``/route`` moves the same route instead of opening a second; and
one error tree: :class:`ApiError` and :class:`Unreachable`, both
:class:`KvindexClientError`.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
import msgspec

from kvindex.api.http.schemas import (
    ErrorBody,
    RouteDone,
    RouteRequest,
    RouteResponse,
    ScoreRequest,
    ScoreResponse,
)

__all__ = [
    "ApiError",
    "AsyncClient",
    "Client",
    "KvindexClientError",
    "NoCapacity",
    "PodReport",
    "Retries",
    "Unreachable",
]

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8080"


class KvindexClientError(Exception):
    """Base of every error the client raises."""


class Unreachable(KvindexClientError):
    """No answer from kvindex after every attempt; the message names the last failure."""


class ApiError(KvindexClientError):
    """kvindex answered with an error: ``status``, its stable ``code`` and ``detail``."""

    def __init__(
        self, status: int, code: str, detail: str, retry_after: float | None = None
    ) -> None:
        super().__init__(f"HTTP {status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.retry_after = retry_after


class NoCapacity(ApiError):
    """``/route`` found no admissible pod (429 ``no_capacity``); retry after
    ``retry_after`` seconds or shed the request."""


class PodReport(msgspec.Struct):
    """One pod of ``GET /index/pods`` (the fields a caller acts on; the full report has
    more, see ``/docs``)."""

    pod: str
    members: list[str] = []
    models: list[str] = []
    blocks: dict[str, int] = {}
    stream_state: str | None = None
    last_event_ts: float | None = None
    gaps: int = 0
    restarts: int = 0


class _PodList(msgspec.Struct):
    pods: list[PodReport]


@dataclass(frozen=True, slots=True)
class Retries:
    """``attempts`` in all (1 = no retry); the wait before retry ``n`` is
    ``backoff_s * 2**(n-1)``, capped at ``max_backoff_s``, times a random factor in
    [0.5, 1] so that clients failing together do not retry together."""

    attempts: int = 3
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("Retries: attempts >= 1, backoff_s and max_backoff_s >= 0")

    def wait_s(self, retry: int, retry_after: float | None = None) -> float:
        base = min(self.max_backoff_s, self.backoff_s * 2.0 ** (retry - 1))
        wait = base * (0.5 + random.random() / 2)
        # A server's Retry-After is a floor, but never longer than the cap.
        return max(wait, min(retry_after or 0.0, self.max_backoff_s))


# Statuses another attempt may cure. 429 only with the in-flight cap's code: a route's
# no_capacity is an answer for the caller to act on.
_RETRY_STATUS = frozenset({502, 503, 504})
_RETRY_CODES = frozenset({"too_many_requests"})
# 503s that no retry cures: configuration, not a passing outage.
_FINAL_CODES = frozenset({"tokenizer_unavailable", "no_pods"})

_encoder = msgspec.json.Encoder()
_error_decoder = msgspec.json.Decoder(ErrorBody)
_score_decoder = msgspec.json.Decoder(ScoreResponse)
_route_decoder = msgspec.json.Decoder(RouteResponse)
_done_decoder = msgspec.json.Decoder(RouteDone)
_pods_decoder = msgspec.json.Decoder(_PodList)


def _body(request: msgspec.Struct) -> bytes:
    """The request as JSON without the fields left at their defaults, so a request an
    older server understands is not refused for a field it does not know."""
    out: dict[str, Any] = {}
    for name, encode_name, default in _fields(type(request)):
        value = getattr(request, name)
        if value is None or (default is not msgspec.NODEFAULT and value == default):
            continue
        out[encode_name] = value
    return _encoder.encode(out)


@functools.cache
def _fields(kind: type[msgspec.Struct]) -> tuple[tuple[str, str, Any], ...]:
    """``kind``'s fields (name, JSON name, default), read once: ``msgspec.structs.fields``
    resolves the type annotations on every call, which every request would pay for."""
    return tuple((f.name, f.encode_name, f.default) for f in msgspec.structs.fields(kind))


def _score_request(request: ScoreRequest | None, fields: Mapping[str, Any]) -> ScoreRequest:
    if request is None:
        return ScoreRequest(**fields)
    if fields:
        raise TypeError("give a ScoreRequest or keyword fields, not both")
    return request


def _route_request(request: RouteRequest | None, fields: Mapping[str, Any]) -> RouteRequest:
    if request is None:
        request = RouteRequest(**fields)
    elif fields:
        raise TypeError("give a RouteRequest or keyword fields, not both")
    if request.request_id is None:  # so that a retry moves this route, never adds one
        request = msgspec.structs.replace(request, request_id=uuid.uuid4().hex)
    return request


def _retry_after(response: httpx.Response) -> float | None:
    text = response.headers.get("retry-after", "")
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _error(response: httpx.Response) -> ApiError:
    try:
        body = _error_decoder.decode(response.content)
        code, detail = body.error, body.detail
    except msgspec.DecodeError:
        code, detail = "http_error", response.text[:500] or response.reason_phrase
    kind = NoCapacity if response.status_code == 429 and code == "no_capacity" else ApiError
    return kind(response.status_code, code, detail, _retry_after(response))


def _retryable(error: ApiError) -> bool:
    if error.code in _FINAL_CODES:
        return False
    return error.status in _RETRY_STATUS or error.code in _RETRY_CODES


def _decode(decoder: msgspec.json.Decoder[T], response: httpx.Response) -> T:
    try:
        return decoder.decode(response.content)
    except msgspec.DecodeError as exc:
        raise KvindexClientError(
            f"{response.request.url}: answer is not what this client expects ({exc}); "
            "is the server a kvindex of the same version?"
        ) from None


class Client:
    """Synchronous client; one per process, reused (it keeps connections open).

    ``timeout`` bounds each attempt (seconds, or an ``httpx.Timeout``); ``retries`` how
    often and how patiently to try again (see :class:`Retries`)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        timeout: float | httpx.Timeout = 5.0,
        retries: Retries | None = None,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.retries = retries or Retries()
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            timeout=timeout,
            headers={"content-type": "application/json", **(headers or {})},
            transport=transport,
        )

    def score(self, request: ScoreRequest | None = None, /, **fields: Any) -> ScoreResponse:
        """``POST /score``: each pod's cached prefix of the prompt, best first."""
        body = _body(_score_request(request, fields))
        return _decode(_score_decoder, self._call("POST", "/score", body))

    def route(self, request: RouteRequest | None = None, /, **fields: Any) -> RouteResponse:
        """``POST /route``: the pod to send the request to; release it with :meth:`done`.
        Raises :class:`NoCapacity` when no pod is admissible."""
        body = _body(_route_request(request, fields))
        return _decode(_route_decoder, self._call("POST", "/route", body))

    def first_token(self, route_id: str) -> RouteDone | None:
        """``POST /route/{route_id}/first-token``: the answer began, so the request's
        prefill no longer counts as queued on its pod; None when the route is not open."""
        return self._release(route_id, "first-token")

    def done(self, route_id: str, outcome: str | None = None) -> RouteDone | None:
        """``POST /route/{route_id}/done``, with how the pod answered when ``outcome``
        is given (ok, connect_error, timeout, http_5xx, broken); None when the route is
        not open (already released, expired, or never routed)."""
        return self._release(route_id, "done", _outcome_body(outcome))

    def _release(self, route_id: str, what: str, body: bytes = b"") -> RouteDone | None:
        try:
            response = self._call("POST", f"/route/{_quote(route_id)}/{what}", body)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return _decode(_done_decoder, response)

    def pods(self) -> list[PodReport]:
        """``GET /index/pods``: every pod the index knows."""
        return _decode(_pods_decoder, self._call("GET", "/index/pods", None)).pods

    def _call(self, method: str, path: str, body: bytes | None) -> httpx.Response:
        retries = self.retries
        for attempt in range(1, retries.attempts + 1):
            last = attempt == retries.attempts
            try:
                response = self._http.request(method, path, content=body)
            except httpx.TransportError as exc:
                if last:
                    raise Unreachable(f"{self._http.base_url}{path}: {exc!r}") from None
                time.sleep(retries.wait_s(attempt))
                continue
            if response.status_code < 400:
                return response
            error = _error(response)
            if last or not _retryable(error):
                raise error
            time.sleep(retries.wait_s(attempt, error.retry_after))
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """The asynchronous twin of :class:`Client` (same methods, awaited)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        timeout: float | httpx.Timeout = 5.0,
        retries: Retries | None = None,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        limits: httpx.Limits | None = None,
    ) -> None:
        self.retries = retries or Retries()
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=timeout,
            headers={"content-type": "application/json", **(headers or {})},
            transport=transport,
            limits=limits or httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def score(self, request: ScoreRequest | None = None, /, **fields: Any) -> ScoreResponse:
        body = _body(_score_request(request, fields))
        return _decode(_score_decoder, await self._call("POST", "/score", body))

    async def route(self, request: RouteRequest | None = None, /, **fields: Any) -> RouteResponse:
        body = _body(_route_request(request, fields))
        return _decode(_route_decoder, await self._call("POST", "/route", body))

    async def first_token(self, route_id: str) -> RouteDone | None:
        return await self._release(route_id, "first-token")

    async def done(self, route_id: str, outcome: str | None = None) -> RouteDone | None:
        return await self._release(route_id, "done", _outcome_body(outcome))

    async def _release(self, route_id: str, what: str, body: bytes = b"") -> RouteDone | None:
        try:
            response = await self._call("POST", f"/route/{_quote(route_id)}/{what}", body)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return _decode(_done_decoder, response)

    async def pods(self) -> list[PodReport]:
        return _decode(_pods_decoder, await self._call("GET", "/index/pods", None)).pods

    async def _call(self, method: str, path: str, body: bytes | None) -> httpx.Response:
        retries = self.retries
        for attempt in range(1, retries.attempts + 1):
            last = attempt == retries.attempts
            try:
                response = await self._http.request(method, path, content=body)
            except httpx.TransportError as exc:
                if last:
                    raise Unreachable(f"{self._http.base_url}{path}: {exc!r}") from None
                await asyncio.sleep(retries.wait_s(attempt))
                continue
            if response.status_code < 400:
                return response
            error = _error(response)
            if last or not _retryable(error):
                raise error
            await asyncio.sleep(retries.wait_s(attempt, error.retry_after))
        raise AssertionError("unreachable")  # pragma: no cover

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _quote(route_id: str) -> str:
    return quote(route_id, safe="")


def _outcome_body(outcome: str | None) -> bytes:
    """``/route/{id}/done``'s optional body."""
    return b"" if outcome is None else msgspec.json.encode({"outcome": outcome})

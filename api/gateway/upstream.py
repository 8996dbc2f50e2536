"""The pod side of a proxied request: connect to the chosen pod (another one when that
fails before any byte reached the client), then relay its answer chunk by chunk.

A request goes to another pod only while nothing of the answer exists yet
(:func:`open_upstream` says when); once the pod's status line has arrived the answer is
the pod's, errors included. Every failure and every relayed answer's ending is reported
against the pod, which may set it aside for a while (:mod:`kvindex.scoring.route.outlier`).
The relay (:class:`RelayedResponse`) sends the pod's status, its allowlisted headers and
its body bytes as they arrive, so server-sent events reach the client one at a time; the
client is watched throughout (:mod:`.client_watch`), and a client that leaves closes the
pod connection, which is how vLLM learns to abort the request. Whatever ends the
response, the route is released exactly once, synchronously, so no cancellation skips it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.responses import Response

from kvindex.api.gateway.client_watch import ClientWatch
from kvindex.api.gateway.errors import MAX_POD_ERROR_BYTES, pod_error_body
from kvindex.api.gateway.pd import DecodeLeg, PdMode, PrefillOutcome, prepare_decode
from kvindex.api.gateway.pod_http import (
    Header,
    PodBroken,
    PodConnections,
    PodResponse,
    PodUnreachable,
)
from kvindex.api.gateway.request_metrics import Outcome
from kvindex.api.gateway.routes import RouteRefused, RouteSource
from kvindex.api.http.asgi import Receive, Scope, Send
from kvindex.api.http.schemas import RouteRequest, RouteResponse
from kvindex.scoring.route.outlier import Outcome as PodOutcome

log = logging.getLogger(__name__)


_RANK_HEADER = b"x-data-parallel-rank"


class PodsUnreachable(Exception):
    """Every pod tried failed before answering; the message lists them."""

    def __init__(self, failed: list[str]) -> None:
        super().__init__(f"no pod answered (tried {', '.join(failed)})")
        self.failed = failed


@dataclass(slots=True)
class Opened:
    """A routed request whose pod has begun to answer."""

    decision: RouteResponse
    answer: PodResponse
    failed: list[str]  # pods skipped because connecting to them failed, in order
    prefill: DecodeLeg | None  # P/D: how the prompt was prefilled; None without P/D


async def open_upstream(
    pods: PodConnections,
    routes: RouteSource,
    request: RouteRequest,
    path: str,
    body: bytes,
    headers: list[Header],
    attempts: int,
    pd_mode: PdMode = PdMode.KV_TRANSFER,
    first_byte_timeout_s: float | None = None,
) -> Opened:
    """Route ``request`` and open the chosen pod's answer (status and headers read, body
    not yet); under P/D the prefill leg comes first (:mod:`.pd`). Raises RouteRefused,
    or PodsUnreachable once ``attempts`` pods (or every candidate) failed; either way no
    route is left open.

    Another pod is tried only when this one never answered: the connection was refused
    or timed out, the pod closed it without answering, or a streamed answer's status line
    missed the first-byte timeout. The next pod is asked of ``/route`` again, among the
    first decision's candidates less the failed pods, under the same route id (released
    first, with the failure), so the route is never counted twice.

    Under P/D (``kv-transfer``) a decode pod that certainly never received the request
    (:attr:`PodUnreachable.delivered` False) costs no second prefill: the retry asks for a
    decode pod only (``role: decode``) with the same ``kv_transfer_params``, which name
    the prefill engine and request, not a decode pod (vLLM 0.33), and the prefill pod
    holds the blocks until one reads them or its lease lapses (``kv_lease_duration``,
    30 s by default). A decode pod that may have read the request may have read the
    blocks too, after which the prefill pod frees them, so that retry prefills again."""
    try:
        decision = await routes.route(request)
    except asyncio.CancelledError:  # the client left: a decision may have been entered
        if request.request_id is not None:
            routes.done(request.request_id)
        raise
    failed: list[str] = []
    prefilled: DecodeLeg | None = None  # a remote prefill no decode pod has received
    while True:
        pod = decision.pod
        leg = prefilled
        try:
            if leg is None and decision.prefill_pod is not None:
                leg = await prepare_decode(
                    pd_mode, pods, decision.prefill_pod, path, body, headers,
                    decision.route_id, prefill_extra=_rank_header(headers, decision, prefill=True),
                )  # fmt: skip
            send_body, send_headers = (body, headers) if leg is None else (leg.body, leg.headers)
            send_headers = send_headers + _rank_header(send_headers, decision)
            answer = await pods.send(
                pod, path, send_headers, send_body, first_byte_timeout_s=first_byte_timeout_s
            )
            return Opened(decision, answer, failed, leg)
        except PodUnreachable as exc:
            log.info("gateway: %s; trying another pod", exc)
            failed.append(pod)
            # The pod's failure is reported (it is set aside) and the route released
            # before a retry enters it anew, on another pod, under the same id.
            why = PodOutcome.TIMEOUT if exc.timed_out else PodOutcome.CONNECT_ERROR
            await routes.failed(decision.route_id, why)
            left = list(dict.fromkeys(c.pod for c in decision.candidates if c.pod not in failed))
            if len(failed) >= attempts or not left:
                raise PodsUnreachable(failed) from None
            reuse = leg is not None and leg.outcome is PrefillOutcome.REMOTE and not exc.delivered
            prefilled = leg if reuse else None
        except PodBroken:  # no valid answer, or silent past the read timeout
            routes.done(decision.route_id, PodOutcome.BROKEN)
            raise
        except BaseException:
            routes.done(decision.route_id)
            raise
        retry = msgspec.structs.replace(request, pods=left)
        if prefilled is not None:  # the KV waits on the prefill pod: a decode pod only
            retry = msgspec.structs.replace(retry, role="decode")
        try:
            decision = await routes.route(retry)
        except (RouteRefused, asyncio.CancelledError):
            routes.done(decision.route_id)
            raise


def _rank_header(
    headers: list[Header], decision: RouteResponse, *, prefill: bool = False
) -> list[Header]:
    """The engine to use on the decision's pod (its prefill pod with ``prefill``) when
    that pod runs data-parallel ranks (vLLM 0.33 reads ``X-data-parallel-rank``), as a
    header to add; none when the client set one."""
    if prefill:
        pod, rank = decision.prefill_pod, decision.prefill_rank or 0
    else:
        pod, rank = decision.pod, decision.rank
    ranks = {c.rank for c in decision.candidates if c.pod == pod}
    if len(ranks) < 2 or any(name == _RANK_HEADER for name, _ in headers):
        return []
    return [(_RANK_HEADER, b"%d" % rank)]


class RelayedResponse(Response):
    """An ASGI response relaying ``upstream``: its status, its allowlisted ``headers``
    (:mod:`.headers`, plus kvindex's own) and its body unchanged, or for an error status
    an OpenAI error in its place (:mod:`.errors`). ``watch`` cancels the relay when the
    client leaves; ``release`` runs once at the end, with how the relay ended and the
    seconds from the pod's last byte to the client's (0 when the answer did not end),
    and ``first_byte`` at the first body byte of an answer relayed piece by piece (a
    streamed one). (A Starlette ``Response`` only so that FastAPI hands it to the server
    as it is.)"""

    def __init__(
        self,
        upstream: PodResponse,
        pod: str,
        headers: list[Header],
        watch: ClientWatch,
        release: Callable[[Outcome, float], None],
        first_byte: Callable[[], None] | None = None,
    ) -> None:
        self.upstream = upstream
        self.pod = pod
        self.status_code = upstream.status
        self.background = None
        self.relayed_headers = headers
        self.watch = watch
        self.release = release
        self.first_byte = first_byte
        self.outcome = Outcome.OK if 200 <= upstream.status < 300 else Outcome.POD_ERROR

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        upstream = self.upstream
        try:
            if upstream.status >= 400:
                await self._error(send)
                return
            # The body is relayed as the pod encoded it (not decompressed), so its length
            # holds; chunked framing is undone here and redone by the server, chunk for
            # chunk.
            headers = self.relayed_headers + [
                header for header in upstream.headers if header[0] == b"content-length"
            ]
            start = {"type": "http.response.start", "status": upstream.status, "headers": headers}
            if upstream.whole:  # a non-streamed answer, usually: one write to the client
                await send(start)
                body = upstream.take_body()
                await send({"type": "http.response.body", "body": body, "more_body": False})
            else:
                await self._relay(start, send)
        except asyncio.CancelledError:
            if not self.watch.absorb():
                raise
            self.outcome = Outcome.CLIENT_LEFT
            log.debug("gateway: the client left; closing its pod connection")
        except PodBroken as exc:
            # The pod failed mid-answer: too late for another pod or another status.
            log.warning("gateway: %s", exc)
            self.outcome = Outcome.POD_FAILED
            raise
        finally:
            self.watch.stop()  # before any await: the answer's end is no client leaving
            self._close()

    async def _relay(self, start: dict[str, Any], send: Send) -> None:
        """The head now, then the body piece by piece."""
        await send(start)
        ended = False
        first_byte = self.first_byte
        async for chunk in self.upstream.iter_body():
            if first_byte is not None and chunk:
                # vLLM streams its first event once the first token is sampled: the
                # prefill is over (the status line came earlier, before any work).
                first_byte()
                first_byte = None
            ended = self.upstream.whole  # the last piece: end the answer with it
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _error(self, send: Send) -> None:
        """The pod's error status with an OpenAI error the gateway wrote (its body read,
        bounded, to keep a 4xx's message; see :mod:`.errors`)."""
        pieces: list[bytes] = []
        size = 0
        try:
            async for piece in self.upstream.iter_body():
                pieces.append(piece)
                size += len(piece)
                if size >= MAX_POD_ERROR_BYTES:
                    break
        except PodBroken as exc:  # the status is what counts; its body is only detail
            log.debug("gateway: %s", exc)
        body = pod_error_body(self.pod, self.upstream.status, b"".join(pieces))
        headers = [h for h in self.relayed_headers if h[0] not in _BODY_HEADERS]
        headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        start = {"type": "http.response.start", "status": self.upstream.status, "headers": headers}
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _close(self) -> None:
        completed_at = self.upstream.completed_at
        relayed = 0.0
        if completed_at is not None and self.outcome is not Outcome.CLIENT_LEFT:
            relayed = time.perf_counter() - completed_at
        try:
            self.upstream.close()
        finally:
            self.release(self.outcome, relayed)


# Headers that describe the pod's body, which an error answer replaces.
_BODY_HEADERS = frozenset({b"content-type", b"content-encoding"})

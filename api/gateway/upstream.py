"""The pod side of a proxied request: connect to the chosen pod (another one when that
fails before any byte reached the client), then relay its answer chunk by chunk.

Retry rule: a request is sent to another pod only while nothing of the answer exists
yet: the connection was refused, timed out while connecting, or the pod closed it
without answering. The next pod is asked of ``/route`` again, among the first
decision's candidates minus the pods that failed, under the same route id, so the
ledger moves the route instead of counting it twice. Once the pod's status line has
arrived the answer is the pod's, errors included.

The relay is a plain ASGI response: the pod's status, its headers less hop-by-hop ones
(plus ``x-kvindex-pod``), and its body bytes as they arrive (not decompressed; each
network read sent on as one chunk), so server-sent events reach the client one event at
a time. A client
that disconnects stops the relay at once and closes the pod connection, which is how
vLLM learns to abort the request. Whatever ends the response (the last byte, an error,
a disconnect), the route is released exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.responses import Response

from kvindex.api.asgi import Receive, Scope, Send
from kvindex.api.gateway.metrics import Outcome
from kvindex.api.gateway.pd import DecodeLeg, PdMode, prepare_decode
from kvindex.api.gateway.pod_http import PodBroken, PodConnections, PodResponse, PodUnreachable
from kvindex.api.gateway.routes import RouteRefused, RouteSource
from kvindex.api.schemas import RouteRequest, RouteResponse

log = logging.getLogger(__name__)


# RFC 9110 7.6.1 hop-by-hop headers, and the ones the relay's own server writes.
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
# A request's headers that travel to the pod; the rest (hop-by-hop, host) do not.
_REQUEST_SKIP = _HOP | {b"accept-encoding"}


_RANK_HEADER = "x-data-parallel-rank"


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


def forward_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The client's request headers (an ASGI scope's, names in lower case) the pod should
    see: auth, content type, ids."""
    return {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in raw
        if name not in _REQUEST_SKIP
    }


async def open_upstream(
    pods: PodConnections,
    routes: RouteSource,
    request: RouteRequest,
    path: str,
    body: bytes,
    headers: dict[str, str],
    attempts: int,
    pd_mode: PdMode = PdMode.KV_TRANSFER,
) -> Opened:
    """Route ``request`` and open the chosen pod's answer (status and headers read, body
    not yet); under P/D the prefill leg comes first (:mod:`.pd`). Raises RouteRefused,
    or PodsUnreachable once ``attempts`` pods (or every candidate) failed; either way no
    route is left open."""
    decision = await routes.route(request)
    failed: list[str] = []
    while True:
        pod = decision.pod
        prefill = None
        try:
            send_body, send_headers = body, _with_rank(headers, decision)
            if decision.prefill_pod is not None:
                prefill = await prepare_decode(
                    pd_mode, pods, decision.prefill_pod, path, body, send_headers,
                    decision.route_id,
                )  # fmt: skip
                send_body, send_headers = prefill.body, prefill.headers
            answer = await pods.send(pod, path, send_headers, send_body)
            return Opened(decision, answer, failed, prefill)
        except PodUnreachable as exc:
            log.info("gateway: %s; trying another pod", exc)
            failed.append(pod)
            left = list(dict.fromkeys(c.pod for c in decision.candidates if c.pod not in failed))
            if len(failed) >= attempts or not left:
                await routes.done(decision.route_id)
                raise PodsUnreachable(failed) from None
        except BaseException:
            await routes.done(decision.route_id)
            raise
        try:
            decision = await routes.route(msgspec.structs.replace(request, pods=left))
        except RouteRefused:
            await routes.done(decision.route_id)
            raise


def _with_rank(headers: dict[str, str], decision: RouteResponse) -> dict[str, str]:
    """The request's headers, plus the engine to use when the pod runs data-parallel
    ranks (vLLM 0.33 reads ``X-data-parallel-rank``); a header the client set wins."""
    ranks = {c.rank for c in decision.candidates if c.pod == decision.pod}
    if len(ranks) < 2 or any(k.lower() == _RANK_HEADER for k in headers):
        return headers
    return {**headers, _RANK_HEADER: str(decision.rank)}


class RelayedResponse(Response):
    """An ASGI response relaying ``upstream`` unchanged; ``release`` runs once at the end,
    with how the relay ended. (A Starlette ``Response`` only so that FastAPI hands it to
    the server as it is.)"""

    def __init__(
        self,
        upstream: PodResponse,
        extra_headers: list[tuple[bytes, bytes]],
        release: Callable[[Outcome], Awaitable[None]],
    ) -> None:
        self.upstream = upstream
        self.status_code = upstream.status
        self.background = None
        # The body is relayed as the pod encoded it (not decompressed), so its length
        # holds; chunked framing is undone here and redone by the server, chunk for chunk.
        self.relayed_headers = [
            (name, value)
            for name, value in upstream.headers
            if name not in _HOP or name == b"content-length"
        ] + extra_headers
        self.release = release
        self.outcome = Outcome.OK if 200 <= upstream.status < 300 else Outcome.POD_ERROR

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {
            "type": "http.response.start",
            "status": self.upstream.status,
            "headers": self.relayed_headers,
        }
        if self.upstream.whole:
            # The pod's whole answer is here (a non-streamed one, usually): one write to
            # the client, and no disconnect to watch for.
            try:
                await send(start)
                body = b"".join([chunk async for chunk in self.upstream.iter_body()])
                await send({"type": "http.response.body", "body": body, "more_body": False})
            except PodBroken:
                self.outcome = Outcome.POD_FAILED
                raise
            except BaseException:  # the client's connection failed under the write
                self.outcome = Outcome.CLIENT_LEFT
                raise
            finally:
                await asyncio.shield(self._close())
            return
        await self._relay(start, receive, send)

    async def _relay(self, start: dict[str, Any], receive: Receive, send: Send) -> None:
        """Chunk by chunk, stopping as soon as the client leaves."""
        task = asyncio.current_task()
        disconnected = False

        async def watch() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            if task is not None:
                task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await send(start)
            ended = False
            async for chunk in self.upstream.iter_body():
                ended = self.upstream.whole  # the last piece: end the answer with it
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not disconnected:
                raise
            if task is not None:
                task.uncancel()
            self.outcome = Outcome.CLIENT_LEFT
            log.debug("gateway: the client left; closing its pod connection")
        except PodBroken as exc:
            # The pod failed mid-answer: too late for another pod or another status.
            log.warning("gateway: %s", exc)
            self.outcome = Outcome.POD_FAILED
            raise
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            await asyncio.shield(self._close())

    async def _close(self) -> None:
        try:
            await self.upstream.aclose()
        finally:
            await self.release(self.outcome)

"""The gateway's work per endpoint: vLLM's OpenAI endpoints, each request routed by kvindex.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are read for routing (model,
prompt, expected output), routed, and forwarded byte for byte to the chosen pod; the
answer comes back unchanged (streamed or not) with the pod's allowlisted headers plus
``x-kvindex-pod``, ``x-kvindex-route-reason`` and, when connecting to pods failed,
``x-kvindex-failed-pods``. ``GET /v1/models`` merges what the known pods serve;
``GET /health`` is 200 while the index answers. Errors, the gateway's own and the pods'
retold, are in OpenAI's shape (:mod:`.errors`); a client that leaves stops the pod's
request (:mod:`.client_watch`). :mod:`.asgi` serves these in front of ``kvindex serve``'s
app (``--gateway``) or alone (``kvindex gateway --index URL``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response

from kvindex.api.client import AsyncClient, Retries
from kvindex.api.gateway.bodies import (
    SESSION_ID_HEADER,
    Endpoint,
    RouteRequests,
    lora_adapters,
    read_body,
    session_of,
)
from kvindex.api.gateway.client_watch import ClientWatch
from kvindex.api.gateway.errors import openai_error_body
from kvindex.api.gateway.headers import RelayedHeaders, first_header, forward_headers
from kvindex.api.gateway.index_transport import IndexTransport
from kvindex.api.gateway.pd import PdMode, PrefillOutcome
from kvindex.api.gateway.pod_http import PodBroken, PodConnections
from kvindex.api.gateway.request_metrics import GatewayMetrics, Outcome
from kvindex.api.gateway.routes import (
    LocalRoutes,
    RemoteRoutes,
    RouteRefused,
    RouteSource,
    TimedRoutes,
)
from kvindex.api.gateway.upstream import PodsUnreachable, RelayedResponse, open_upstream
from kvindex.api.http.asgi import ClientLeft, Receive, Scope, receive_body
from kvindex.api.serve.settings import GatewaySettings, Settings
from kvindex.events.errors import ClientError
from kvindex.scoring.prompt.tokenize import TokenizerRegistry
from kvindex.scoring.route.outlier import Outcome as PodOutcome

if TYPE_CHECKING:
    from kvindex.api.serve.service import Service

log = logging.getLogger(__name__)


_encoder = msgspec.json.Encoder()
_MODELS_TIMEOUT_S = 2.0


class RequestIds:
    """Ids for routed requests (route id, and ``x-request-id`` under P/D): a random
    prefix per gateway process, then a counter. Unique across gateway replicas sharing
    one index, without a system call per request (``os.urandom`` is one)."""

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._count):08x}"


class Gateway:
    """The parts one gateway needs: where decisions come from, how prompts become
    tokens, one pooled HTTP client for the pods, and the registry its metrics go to."""

    def __init__(
        self,
        routes: RouteSource,
        tokenizers: TokenizerRegistry,
        settings: GatewaySettings,
        registry: CollectorRegistry,
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = GatewayMetrics(registry)
        self.routes: RouteSource = TimedRoutes(routes, self.metrics.route_seconds)
        self.requests = RouteRequests(tokenizers, adapters)
        self.settings = settings
        self.pd_mode = PdMode(settings.pd_mode)
        self.relayed_headers = RelayedHeaders(settings.relay_headers)
        self._ids = RequestIds()
        self.pods = PodConnections(settings.connect_timeout, settings.read_timeout)
        # /v1/models only: rare, so httpx's cost does not matter there.
        self.http = httpx.AsyncClient(trust_env=False)  # pods are dialled directly

    @classmethod
    def in_process(cls, service: Service) -> Gateway:
        """For ``kvindex serve --gateway``: the service's own router and tokenizers."""
        settings = service.settings
        return cls(
            LocalRoutes(service),
            service.tokenizers,
            settings.gateway,
            service.registry,
            lora_adapters(settings),
        )

    @classmethod
    def remote(cls, index_url: str, settings: Settings) -> Gateway:
        """For ``kvindex gateway --index URL``: decisions over HTTP, tokenizers from the
        config file's ``models:`` (``tokenizer:`` per model) or the local hub cache."""
        from kvindex.api.serve.settings_derived import check_tokenizer_dirs, tokenizer_dirs

        dirs = tokenizer_dirs(settings)
        check_tokenizer_dirs(dirs)
        timeout = settings.gateway.index_timeout
        client = AsyncClient(
            index_url,
            timeout=timeout,
            retries=Retries(attempts=2, backoff_s=0.02, max_backoff_s=0.2),
            transport=IndexTransport(timeout) if index_url.startswith("http://") else None,
        )
        registry = CollectorRegistry(auto_describe=True)
        return cls(
            RemoteRoutes(client),
            TokenizerRegistry(dirs),
            settings.gateway,
            registry,
            lora_adapters(settings),
        )

    async def aclose(self) -> None:
        await self.pods.aclose()
        await self.http.aclose()
        await self.routes.aclose()

    async def proxy(self, endpoint: Endpoint, scope: Scope, receive: Receive) -> Any:
        started = time.perf_counter()
        metrics = self.metrics
        try:
            body = await receive_body(receive)
        except ClientLeft:
            metrics.ended(Outcome.CLIENT_LEFT)
            raise
        # From here to the answer's last byte, a client that leaves cancels this task
        # wherever it waits (routing, the pod's first answer, the relay).
        watch = ClientWatch(receive)
        try:
            response = await self._forward(endpoint, scope, body, started, watch)
        except asyncio.CancelledError:
            watch.stop()
            if not watch.absorb():
                raise
            log.debug("gateway: the client left before its pod answered")
            metrics.ended(Outcome.CLIENT_LEFT)
            raise ClientLeft from None
        except BaseException:
            watch.stop()
            raise
        if not isinstance(response, RelayedResponse):
            watch.stop()  # a refusal, answered at once: no pod to stop
        return response

    async def _forward(
        self, endpoint: Endpoint, scope: Scope, body: bytes, started: float, watch: ClientWatch
    ) -> Response:
        """Route the request and open its pod's answer: the relay, or a refusal."""
        metrics = self.metrics
        try:
            parsed = read_body(endpoint, body)
            session = session_of(parsed, first_header(scope["headers"], SESSION_ID_HEADER))
            route_request = self.requests.build(parsed, self._ids.next(), session)
            # vLLM sends a streamed answer's status line before any work, a whole
            # answer's only once generated: only the first is bounded by the first byte.
            first_byte = self.settings.first_byte_timeout if parsed.stream else None
            opened = await open_upstream(
                self.pods,
                self.routes,
                route_request,
                endpoint.value,
                body,
                forward_headers(scope["headers"]),
                self.settings.attempts,
                self.pd_mode,
                first_byte,
            )
        except ClientError as exc:
            metrics.ended(Outcome.INVALID_REQUEST)
            return openai_error(400, exc.code, exc.detail)
        except RouteRefused as exc:
            headers = {}
            if exc.retry_after is not None:
                headers["retry-after"] = str(max(1, round(exc.retry_after)))
            full = exc.code == "no_capacity"
            metrics.ended(Outcome.NO_CAPACITY if full else Outcome.ROUTE_REFUSED)
            return openai_error(exc.status, exc.code, exc.detail, headers)
        except PodsUnreachable as exc:
            metrics.upstream_error("connect", len(exc.failed))
            metrics.retries.inc(len(exc.failed) - 1)
            metrics.ended(Outcome.UNREACHABLE)
            return openai_error(502, "pods_unreachable", str(exc))
        except PodBroken as exc:  # the pod began to answer, then failed
            metrics.upstream_error("broken")
            metrics.ended(Outcome.POD_FAILED)
            return openai_error(502, "pod_failed", str(exc))
        decision, failed, prefill = opened.decision, opened.failed, opened.prefill
        # The gateway's own time before the pod's: reading, tokenizing, routing,
        # connecting (a P/D prefill leg is pod time); the relay's tail is added at the end.
        before_pod = opened.answer.sent_at - started
        if prefill is not None:
            before_pod -= prefill.prefill_seconds
            metrics.prefill.labels(prefill.outcome.value).inc()
            if prefill.outcome is PrefillOutcome.FAILED:
                metrics.upstream_error("prefill")
        route_id = decision.route_id
        metrics.routed(decision.reason)
        headers = self.relayed_headers.of_answer(opened.answer.headers)
        headers += [
            (b"x-kvindex-pod", decision.pod.encode("latin-1")),
            (b"x-kvindex-route-reason", decision.reason.encode("latin-1")),
        ]
        if prefill is not None:  # the leg's: a retry reusing a prefill routes decode only
            headers.append((b"x-kvindex-prefill-pod", prefill.prefill_pod.encode("latin-1")))
        if failed:  # the pods skipped because connecting to them failed
            metrics.upstream_error("connect", len(failed))
            metrics.retries.inc(len(failed))
            headers.append((b"x-kvindex-failed-pods", ",".join(failed).encode("latin-1")))

        status = opened.answer.status

        def finish(outcome: Outcome, relay_seconds: float) -> None:
            metrics.added_seconds.observe(before_pod + relay_seconds)
            metrics.ended(outcome)
            if outcome is Outcome.POD_FAILED:
                metrics.upstream_error("broken")
            self.routes.done(route_id, _pod_outcome(outcome, status))

        return RelayedResponse(
            opened.answer,
            decision.pod,
            headers,
            watch,
            finish,
            lambda: self.routes.first_token(route_id),
        )

    async def models(self) -> Response:
        """Every model the known pods serve, each listed once (first pod's entry)."""
        pods = await self.routes.pods()

        async def ask(pod: str) -> list[dict[str, Any]]:
            try:
                answer = await self.http.get(f"http://{pod}/v1/models", timeout=_MODELS_TIMEOUT_S)
                data = answer.json().get("data", []) if answer.status_code == 200 else []
                return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
            except (httpx.HTTPError, ValueError, AttributeError):
                return []

        merged: dict[str, dict[str, Any]] = {}
        for models in await asyncio.gather(*(ask(pod) for pod in pods)):
            for model in models:
                merged.setdefault(model["id"], model)
        body = {"object": "list", "data": [merged[k] for k in sorted(merged)]}
        return Response(_encoder.encode(body), media_type="application/json")

    async def metrics_page(self) -> Response:
        """The gateway's registry in Prometheus text (``kvindex gateway`` alone)."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(self) -> Response:
        if await self.routes.healthy():
            return Response(_encoder.encode({"status": "ok"}), media_type="application/json")
        return openai_error(503, "index_unreachable", "the kvindex index does not answer")


def _pod_outcome(outcome: Outcome, status: int) -> PodOutcome | None:
    """What a relay's end says of its pod, for its failure record; None: nothing (the
    client left)."""
    if outcome is Outcome.CLIENT_LEFT:
        return None
    if outcome is Outcome.POD_FAILED:
        return PodOutcome.BROKEN
    return PodOutcome.HTTP_5XX if status >= 500 else PodOutcome.OK


def openai_error(
    status: int, code: str, detail: str, headers: dict[str, str] | None = None
) -> Response:
    """An error as vLLM's OpenAI server shapes it, so OpenAI clients raise it properly."""
    return Response(
        openai_error_body(status, code, detail),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )

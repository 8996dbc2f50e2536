"""Where the gateway's decisions come from: the index in the same process
(``kvindex serve --gateway``) or a kvindex over HTTP (``kvindex gateway --index URL``).

Both answer the same questions and fail the same way, so the proxy never knows
which it talks to: :class:`RouteRefused` carries the status, code and detail the index
gave (and ``Retry-After`` for ``no_capacity``), whatever the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Histogram

from kvindex.api.client import ApiError, AsyncClient, KvindexClientError, NoCapacity
from kvindex.api.http.errors import status_of
from kvindex.api.http.route import NoCapacity as Full
from kvindex.api.http.route import decide_route, release_prefill, release_route, route_inputs
from kvindex.api.http.schemas import RouteRequest, RouteResponse
from kvindex.events.errors import KvindexError, NotFound
from kvindex.scoring.route.outlier import Outcome as PodOutcome

if TYPE_CHECKING:
    from kvindex.api.serve.service import Service


class RouteRefused(Exception):
    """The index gave no decision: ``status`` and ``code`` as ``/route`` answered."""

    def __init__(
        self, status: int, code: str, detail: str, retry_after: float | None = None
    ) -> None:
        super().__init__(detail)
        self.status, self.code, self.detail, self.retry_after = status, code, detail, retry_after


class RouteSource(Protocol):
    async def route(self, request: RouteRequest) -> RouteResponse:
        """The decision, entered in the in-flight ledger; RouteRefused otherwise."""
        ...

    def first_token(self, route_id: str) -> None:
        """The answer began (its first token): the request's prefill no longer counts as
        queued on its pod. Without waiting, never raises, like ``done``."""
        ...

    def done(self, route_id: str, outcome: PodOutcome | None = None) -> None:
        """Release the route, with how its pod answered (its failure record:
        :mod:`kvindex.scoring.route.outlier`), without waiting (never raises: a lost release
        only waits for its TTL). Not a coroutine, so no cancellation can skip it."""
        ...

    async def failed(self, route_id: str, outcome: PodOutcome) -> None:
        """The route's pod failed before answering: release the route with ``outcome``
        and wait for that, so a retry under the same route id is entered after it (never
        raises)."""
        ...

    async def pods(self) -> list[str]:
        """Every pod the index knows (for ``/v1/models``)."""
        ...

    async def healthy(self) -> bool: ...

    async def aclose(self) -> None: ...


class LocalRoutes:
    """Decisions from the service in this process: no HTTP, no serialization."""

    def __init__(self, service: Service) -> None:
        self.service = service

    async def route(self, request: RouteRequest) -> RouteResponse:
        try:
            # The index part off the event loop under its deadline, as /route does: a
            # hung Redis must not stall every request the gateway is relaying.
            inputs = await route_inputs(self.service, request)
            return decide_route(self.service, request, inputs)
        except Full as exc:
            raise RouteRefused(429, exc.code, exc.detail, float(exc.retry_after)) from None
        except KvindexError as exc:
            raise RouteRefused(status_of(exc), exc.code, exc.detail) from None

    def first_token(self, route_id: str) -> None:
        with contextlib.suppress(NotFound):  # released already, or past its TTL
            release_prefill(self.service, route_id)

    def done(self, route_id: str, outcome: PodOutcome | None = None) -> None:
        with contextlib.suppress(NotFound):  # released already, or past its TTL
            release_route(self.service, route_id, outcome)  # P/D: the prefill pod's share too

    async def failed(self, route_id: str, outcome: PodOutcome) -> None:
        self.done(route_id, outcome)

    async def pods(self) -> list[str]:
        return self.service.known_pods()

    async def healthy(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


class RemoteRoutes:
    """Decisions from a kvindex over HTTP, with the client's timeouts and retries."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self._releasing: set[asyncio.Task[None]] = set()

    async def route(self, request: RouteRequest) -> RouteResponse:
        try:
            return await self.client.route(request)
        except NoCapacity as exc:
            raise RouteRefused(exc.status, exc.code, exc.detail, exc.retry_after) from None
        except ApiError as exc:
            raise RouteRefused(exc.status, exc.code, exc.detail) from None
        except KvindexClientError as exc:  # unreachable, or not a kvindex answer
            raise RouteRefused(503, "index_unreachable", str(exc)) from None

    def first_token(self, route_id: str) -> None:
        """In the background, as ``done`` (a lost report only delays the release of the
        request's prefill share to ``done``)."""
        self._background(self.client.first_token(route_id))

    def done(self, route_id: str, outcome: PodOutcome | None = None) -> None:
        """Sent in the background: the server answers a kept-alive connection's next
        request only once this one's handler returns, so waiting here would add a round
        trip to the index to the client's next request."""
        self._background(self.client.done(route_id, None if outcome is None else outcome.value))

    async def failed(self, route_id: str, outcome: PodOutcome) -> None:
        await self._release(self.client.done(route_id, outcome.value))

    def _background(self, call: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(self._release(call))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release(self, call: Coroutine[Any, Any, Any]) -> None:
        with contextlib.suppress(KvindexClientError):  # else it expires after --route-ttl
            await call

    async def pods(self) -> list[str]:
        try:
            return [p.pod for p in await self.client.pods()]
        except KvindexClientError:
            return []

    async def healthy(self) -> bool:
        try:
            await self.client.pods()
        except KvindexClientError:
            return False
        return True

    async def aclose(self) -> None:
        if self._releasing:  # the last releases, briefly: else they expire by TTL
            await asyncio.wait(self._releasing, timeout=2.0)
        await self.client.aclose()


class TimedRoutes:
    """A :class:`RouteSource` whose decisions are timed into ``seconds`` (a histogram):
    how much of what the gateway adds is waiting for ``/route``."""

    def __init__(self, routes: RouteSource, seconds: Histogram) -> None:
        self.routes, self.seconds = routes, seconds

    async def route(self, request: RouteRequest) -> RouteResponse:
        started = time.perf_counter()
        try:
            return await self.routes.route(request)
        finally:
            self.seconds.observe(time.perf_counter() - started)

    def first_token(self, route_id: str) -> None:
        self.routes.first_token(route_id)

    def done(self, route_id: str, outcome: PodOutcome | None = None) -> None:
        self.routes.done(route_id, outcome)

    async def failed(self, route_id: str, outcome: PodOutcome) -> None:
        await self.routes.failed(route_id, outcome)

    async def pods(self) -> list[str]:
        return await self.routes.pods()

    async def healthy(self) -> bool:
        return await self.routes.healthy()

    async def aclose(self) -> None:
        await self.routes.aclose()

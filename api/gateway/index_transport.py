"""The transport ``kvindex gateway --index URL`` talks to the index with.

The gateway asks the index twice per request (``/route``, then ``/route/{id}/done``)
through :class:`kvindex.api.client.AsyncClient`, whose timeouts, retries and types it
wants, but httpx's own async connection stack costs more per loopback exchange than
the gateway can spare (bench/README.md, "api/: the figures behind its design"). So the
client keeps its API and its requests travel over the gateway's kept-alive HTTP/1.1
connections (:mod:`kvindex.api.gateway.pod_http`); failures come back as the httpx
errors the client already handles. Plain ``http://`` only (an ``https://`` index keeps
httpx's own transport).
"""

from __future__ import annotations

import httpx

from kvindex.api.gateway.pod_http import PodBroken, PodConnections, PodUnreachable

_SKIP = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection"})


class IndexTransport(httpx.AsyncBaseTransport):
    """httpx requests over :class:`PodConnections`; ``timeout_s`` bounds connecting and
    each wait for the answer."""

    def __init__(self, timeout_s: float) -> None:
        self._connections = PodConnections(timeout_s, timeout_s)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        target = f"{url.host}:{url.port or 80}"
        headers = [
            (name.lower(), value)
            for name, value in request.headers.raw
            if name.lower() not in _SKIP
        ]
        body = await request.aread()
        path = url.raw_path.decode("ascii")
        method = request.method.encode("ascii")
        try:
            answer = await self._connections.send(target, path, headers, body, method)
            try:
                content = b"".join([piece async for piece in answer.iter_body()])
            finally:
                answer.close()
        except PodUnreachable as exc:
            raise httpx.ConnectError(str(exc), request=request) from None
        except PodBroken as exc:
            raise httpx.ReadError(str(exc), request=request) from None
        return httpx.Response(answer.status, headers=answer.headers, content=content)

    async def aclose(self) -> None:
        await self._connections.aclose()

"""The gateway's HTTP/1.1 client for pods, against real asyncio servers on loopback that
answer (or fail) exactly as scripted: kept-alive reuse, chunked bodies, and which
failures allow another pod (nothing answered) and which do not (the answer broke off)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from kvindex.api.gateway.pod_http import PodBroken, PodConnections, PodUnreachable
from kvindex.api.testing import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


def run(handler: Handler, client: Callable[[str], Awaitable[None]]) -> list[bytes]:
    """Serve ``handler`` on a loopback port while ``client(pod)`` runs; return every
    request the server read."""
    seen: list[bytes] = []

    async def main() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(b"<connection>")
            try:
                await handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        async def handling(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await serve(_Recording(reader, seen), writer)  # type: ignore[arg-type]

        server = await asyncio.start_server(handling, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await asyncio.wait_for(client(f"127.0.0.1:{port}"), 10)

    asyncio.run(main())
    return seen


class _Recording:
    def __init__(self, reader: asyncio.StreamReader, seen: list[bytes]) -> None:
        self.reader, self.seen = reader, seen

    async def readuntil(self, separator: bytes) -> bytes:
        data = await self.reader.readuntil(separator)
        self.seen.append(data)
        return data

    async def readexactly(self, n: int) -> bytes:
        return await self.reader.readexactly(n)


OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


def test_a_kept_alive_connection_is_reused() -> None:
    async def handler(reader, writer) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)

    async def client(pod: str) -> None:
        pods = PodConnections(1.0, 5.0)
        for _ in range(3):
            answer = await pods.send(pod, "/v1/completions", [(b"x-id", b"7")], b'{"a": 1}')
            assert answer.status == 200 and answer.whole
            assert b"".join([c async for c in answer.iter_body()]) == b"{}"
            answer.close()
        await pods.aclose()

    seen = run(handler, client)
    assert seen.count(b"<connection>") == 1
    request = seen[1]
    assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"x-id: 7\r\n" in request and b"content-length: 8\r\n" in request


def test_chunked_bodies_arrive_piece_by_piece_and_decoded() -> None:
    async def handler(reader, writer) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")

    async def client(pod: str) -> None:
        pods = PodConnections(1.0, 5.0)
        answer = await pods.send(pod, "/v1/completions", [], b"{}")
        assert not answer.whole
        pieces = [piece async for piece in answer.iter_body()]
        assert pieces == [b"data: 1\n\n", b"data: 2\n\n"] and answer.whole
        answer.close()

    run(handler, client)


def test_an_idle_connection_the_pod_closed_is_replaced_once() -> None:
    async def handler(reader, writer) -> None:
        await read_request(reader)
        writer.write(OK)  # kept alive by the headers, closed right after

    async def client(pod: str) -> None:
        pods = PodConnections(1.0, 5.0)
        for _ in range(2):
            answer = await pods.send(pod, "/v1/completions", [], b"{}")
            assert answer.status == 200
            [c async for c in answer.iter_body()]
            answer.close()
            await asyncio.sleep(0.05)

    assert run(handler, client).count(b"<connection>") == 2


def test_no_answer_is_unreachable_and_a_broken_answer_is_not() -> None:
    async def handler(reader, writer) -> None:
        request = await read_request(reader)
        if b"/silent" in request:
            return  # closes without a status line
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")

    async def client(pod: str) -> None:
        pods = PodConnections(1.0, 5.0)
        with pytest.raises(PodUnreachable, match="without answering") as silent:
            await pods.send(pod, "/silent", [], b"{}")
        assert silent.value.delivered  # it read the request: it may have acted on it
        answer = await pods.send(pod, "/v1/completions", [], b"{}")
        with pytest.raises(PodBroken, match="mid-answer"):
            [c async for c in answer.iter_body()]
        answer.close()
        with pytest.raises(PodUnreachable) as refused:
            await pods.send(f"127.0.0.1:{free_port()}", "/v1/completions", [], b"{}")
        assert not refused.value.delivered  # no connection: the request went nowhere

    run(handler, client)

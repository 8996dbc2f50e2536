"""A pod on loopback that can be made faulty on demand: vLLM's OpenAI completions and
/metrics, real KV events over ZMQ for what it computes, and four faults (issue 27).

- ``ok``: answers ``POST /v1/completions`` (prompts as token ids; streamed or not) and
  ``GET /metrics`` (vLLM 0.33's page, its running count), publishing ``BlockStored`` /
  ``BlockRemoved`` for the prompt's blocks as vLLM's block pool does;
- ``http_500``: answers every completion 500 (its /metrics still answers: an engine
  that died under a live API server);
- ``frozen``: accepts connections and reads requests, never answers, not even
  ``/metrics`` (a stopped process);
- ``killed``: its port is closed (connections refused);
- ``blackholed``: its port listens with a full accept queue and never accepts, so the
  kernel drops new connection attempts (a connect times out, as behind a dropped route).

``received`` counts the completion requests the pod read (in any mode but killed and
blackholed, where none can be read). Raw asyncio, not an ASGI server: a fault must be
exact (no status line at all, no accept at all), and switching modes must not wait on
a server's graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

from bench.sim.pool import BlockPool
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.indexer.keys import BlockHasher, HashConfig
from tests.test_load import DP1_IDLE, with_values

BLOCK_SIZE = 16
MODES = ("ok", "http_500", "frozen", "killed", "blackholed")


class FaultyPod:
    def __init__(self, model: str, events_endpoint: str, num_blocks: int = 8192) -> None:
        self.model = model
        self.mode = "ok"
        self.received = 0
        self.running = 0
        self.hasher = BlockHasher(HashConfig(block_size=BLOCK_SIZE))
        self.pool = BlockPool(num_blocks, BLOCK_SIZE)
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.base_events.Server | None = None
        self._hole: list[socket.socket] = []  # the blackhole's socket and its queue
        self._writers: set[asyncio.StreamWriter] = set()  # open connections
        self._closing = asyncio.Event()
        self.port = self._call(self._serve(0))
        self.pod = f"127.0.0.1:{self.port}"
        self.publisher = EnginePublisher(
            events_endpoint, topic=f"kv@{self.pod}@{model}", bind=False
        )

    # -- faults ------------------------------------------------------------------------

    def set_mode(self, mode: str) -> None:
        """Switch to ``mode`` (one of :data:`MODES`); connections already open stay as
        they are, except that killing or blackholing closes the listening socket."""
        assert mode in MODES, mode
        if mode in ("killed", "blackholed") and self._server is not None:
            self._call(self._stop())
        if self.mode == "blackholed" and mode != "blackholed":
            for sock in self._hole:
                sock.close()
            self._hole = []
        if mode == "blackholed":
            self._blackhole()
        elif self._server is None and mode not in ("killed", "blackholed"):
            self._call(self._serve(self.port))
        self.mode = mode

    def _blackhole(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(0)
        self._hole = [listener]
        # Fill the accept queue (never accepted): the kernel then drops further SYNs.
        for _ in range(8):
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            filler.settimeout(0.3)
            self._hole.append(filler)
            try:
                filler.connect(("127.0.0.1", self.port))
            except TimeoutError:
                return
        raise RuntimeError("the blackhole's accept queue did not fill")

    # -- the engine --------------------------------------------------------------------

    def compute(self, tokens: list[int]) -> list[int]:
        """The prompt's blocks through the pool, the events published; the blocks held."""
        keys = self.hasher.keys(tokens)
        with self._lock:
            hit = self.pool.match(keys)
            blocks = self.pool.touch(keys[:hit])
            blocks += self.pool.allocate(len(keys) - hit)
            self.pool.cache(blocks, keys, hit, len(keys), tokens)
            events = self.pool.drain_events()
            if events:
                self.publisher.publish(events)
        return blocks

    def release(self, blocks: list[int]) -> None:
        with self._lock:
            self.pool.release(blocks)

    # -- HTTP --------------------------------------------------------------------------

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _serve(self, port: int) -> int:
        self._server = await asyncio.start_server(
            self._connection, "127.0.0.1", port, reuse_address=True
        )
        return self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            # Open connections die with the pod (a killed process's sockets close).
            for writer in list(self._writers):
                writer.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):  # type: ignore[no-untyped-def]
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                if self.mode == "frozen":  # a stopped process: not even /metrics answers
                    self.received += method == "POST"
                    await self._closing.wait()  # until the pod is closed
                    return
                if method == "GET" and path == "/metrics":
                    page = with_values(DP1_IDLE, "vllm:num_requests_running", "0", self.running)
                    await self._write(writer, 200, page.encode(), "text/plain")
                    continue
                if method == "GET" and path == "/health" and self.mode == "ok":
                    await self._write(writer, 200, b"", "text/plain")
                    continue
                if method != "POST":
                    await self._write(writer, 404, b"{}", "application/json")
                    continue
                self.received += 1
                if self.mode == "http_500":
                    error = {"error": {"message": "engine dead", "type": "InternalServerError"}}
                    await self._write(writer, 500, json.dumps(error).encode(), "application/json")
                    continue
                await self._complete(writer, json.loads(body))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _complete(self, writer: asyncio.StreamWriter, request: dict) -> None:  # type: ignore[type-arg]
        tokens = [int(t) for t in request["prompt"]]
        started = time.perf_counter()
        self.running += 1
        try:
            blocks = self.compute(tokens)
            await asyncio.sleep(0.005)  # a token or two
            self.release(blocks)
        finally:
            self.running -= 1
        text = " w"
        created = int(time.time())
        base = {
            "id": "cmpl-x",
            "created": created,
            "model": self.model,
            "object": "text_completion",
        }
        if request.get("stream"):
            chunk = {**base, "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
            body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            await self._write(writer, 200, body, "text/event-stream", started)
            return
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": 1,
            "total_tokens": len(tokens) + 1,
        }
        answer = {
            **base,
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": usage,
        }
        await self._write(writer, 200, json.dumps(answer).encode(), "application/json", started)

    @staticmethod
    async def _write(
        writer: asyncio.StreamWriter, status: int, body: bytes, kind: str, started: float = 0.0
    ) -> None:
        """One answer; with ``started``, the pod's own time in ``openai-processing-ms``
        (OpenAI's header, which the gateway relays) for a client to subtract."""
        reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
        head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: {kind}\r\n"
        if started:
            head += f"openai-processing-ms: {(time.perf_counter() - started) * 1000:.3f}\r\n"
        head += f"content-length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()

    async def _end(self) -> None:
        await self._stop()
        self._closing.set()  # frozen requests end with the pod
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call(self._end())
        for sock in self._hole:
            sock.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self.publisher.close()

"""A stand-in vLLM pod on loopback: the OpenAI API over real HTTP, vLLM 0.33's /metrics
page, and real KV events over ZMQ for every prompt it "computes".

What it computes is the prompt's KV blocks, in the simulator's model of vLLM's block pool
(:class:`bench.sim.pool.BlockPool`: hits touch cached blocks, misses allocate and publish
``BlockStored``, evictions publish ``BlockRemoved``), with block keys hashed as vLLM
hashes them. Prompts are tokenized by transformers, the reference vLLM itself uses
(``encode`` for completions, ``apply_chat_template`` for chat), not by kvindex's code, so
a gateway that tokenizes differently routes to the wrong pod and the tests see it.

The answer text is made up (``w0 w1 ...``); streamed answers are server-sent events
with a short pause between chunks, and the pod records the chunks it sent, the bodies it
received and the requests whose client went away, for the tests to compare.

Disaggregated prefill as vLLM's NixlConnector does it: a request whose
``kv_transfer_params`` has ``do_remote_decode`` is prefilled and its answer carries
``kv_transfer_params`` naming the blocks held for the decode pod (``do_remote_prefill``,
``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``); a pod
built with ``kv_transfer=False`` answers without them, as a vLLM started without
``--kv-transfer-config`` does.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from bench.sim.pool import BlockPool
from kvindex.api.http.server import bind
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.indexer.keys import BlockHasher, HashConfig
from tests.test_load import DP1_IDLE, with_values

BLOCK_SIZE = 16


class FakeVllmPod:
    """One pod serving ``model`` on ``<host>:<port>`` (``self.pod``; ``host`` a loopback
    address, 127.0.0.1 unless given), publishing its KV events to the kvindex SUB socket
    bound at ``events_endpoint``."""

    def __init__(
        self,
        model: str,
        tokenizer_dir: Path,
        events_endpoint: str,
        *,
        num_blocks: int = 4096,
        chunk_pause_s: float = 0.01,
        kv_transfer: bool = True,
        host: str = "127.0.0.1",
    ) -> None:
        import transformers

        self.model = model
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.hasher = BlockHasher(HashConfig(block_size=BLOCK_SIZE))
        self.pool = BlockPool(num_blocks, BLOCK_SIZE)
        self.chunk_pause_s = chunk_pause_s
        self.kv_transfer = kv_transfer
        self.engine_id = uuid.uuid4().hex
        self.received: list[tuple[str, bytes, dict[str, str]]] = []
        self.sent_chunks: dict[str, list[bytes]] = {}
        self.prompts: list[list[int]] = []
        self.aborted = 0
        self.running = 0
        self.waiting = 0  # what /metrics says is queued (set by tests to look busy)
        self.kv_usage = 0.0  # what /metrics says of its KV cache (set by tests to look full)
        self._lock = threading.Lock()
        self._sock = bind(host, 0)
        self.pod = f"{host}:{self._sock.getsockname()[1]}"
        self.publisher = EnginePublisher(
            events_endpoint, topic=f"kv@{self.pod}@{model}", bind=False
        )
        config = uvicorn.Config(
            self._app(),
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"fake vLLM pod {self.pod} did not start")
            time.sleep(0.01)

    # -- the engine ---------------------------------------------------------------

    def compute(self, tokens: list[int]) -> tuple[list[int], int]:
        """Run the prompt's blocks through the pool and publish the events; return the
        blocks held (release them at the end) and the cached prefix in tokens."""
        keys = self.hasher.keys(tokens)
        with self._lock:
            hit = self.pool.match(keys)
            blocks = self.pool.touch(keys[:hit])
            blocks += self.pool.allocate(len(keys) - hit)
            self.pool.cache(blocks, keys, hit, len(keys), tokens)
            events = self.pool.drain_events()
            if events:
                self.publisher.publish(events)
            self.prompts.append(tokens)
        return blocks, hit * BLOCK_SIZE

    def release(self, blocks: list[int]) -> None:
        with self._lock:
            self.pool.release(blocks)

    def tokens_of(self, endpoint: str, body: dict[str, Any]) -> list[int]:
        if endpoint == "chat":
            text = self.tokenizer.apply_chat_template(
                [_media_as_placeholders(m) for m in body["messages"]],
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                tokenize=False,
                **(body.get("chat_template_kwargs") or {}),
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        prompt = body["prompt"]
        if isinstance(prompt, list):
            return list(prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    # -- HTTP ---------------------------------------------------------------------

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._answer("completion", request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._answer("chat", request)

        @app.get("/v1/models")
        async def models() -> Response:
            card = {"id": self.model, "object": "model", "created": 0, "owned_by": "vllm"}
            return JSONResponse({"object": "list", "data": [card]})

        @app.get("/metrics")
        async def metrics() -> Response:
            page = with_values(DP1_IDLE, "vllm:num_requests_running", "0", self.running)
            page = with_values(page, "vllm:num_requests_waiting", "0", self.waiting)
            page = with_values(page, "vllm:kv_cache_usage_perc", "0", self.kv_usage)
            return Response(page, media_type="text/plain; version=0.0.4")

        @app.get("/health")
        async def health() -> Response:
            return Response()

        return app

    async def _answer(self, endpoint: str, request: Request) -> Response:
        raw = await request.body()
        self.received.append((endpoint, raw, dict(request.headers)))
        body = json.loads(raw)
        tokens = self.tokens_of(endpoint, body)
        blocks, cached = self.compute(tokens)
        count = int(body.get("max_tokens") or body.get("max_completion_tokens") or 8)
        words = [f"w{i} " for i in range(count)]
        request_id = f"{'chatcmpl' if endpoint == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": count,
            "total_tokens": len(tokens) + count,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if not body.get("stream"):
            self.release(blocks)
            answer = _whole(endpoint, request_id, self.model, words, usage)
            asked = body.get("kv_transfer_params") or {}
            if self.kv_transfer and asked.get("do_remote_decode"):
                host, _, port = self.pod.rpartition(":")
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_engine_id": self.engine_id,
                    "remote_block_ids": blocks,
                    "remote_host": host,
                    "remote_port": int(port),
                }
            return JSONResponse(answer)
        self.running += 1
        sent = self.sent_chunks.setdefault(request_id, [])

        async def events() -> AsyncIterator[bytes]:
            finished = False
            try:
                for i, word in enumerate(words):
                    chunk = _chunk(endpoint, request_id, self.model, word, i, i == count - 1)
                    data = f"data: {json.dumps(chunk)}\n\n".encode()
                    sent.append(data)
                    yield data
                    await asyncio.sleep(self.chunk_pause_s)
                sent.append(b"data: [DONE]\n\n")
                yield b"data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:
                    self.aborted += 1
                self.running -= 1
                self.release(blocks)

        return StreamingResponse(events(), media_type="text/event-stream")

    def stop_http(self) -> None:
        """The pod's server goes away (connections to it are refused from now on)."""
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def close(self) -> None:
        self.stop_http()
        self.publisher.close()


def _media_as_placeholders(message: dict[str, Any]) -> dict[str, Any]:
    """A message with media parts as a multimodal model's prompt holds them: each a
    placeholder in the text (the processor expands it into the item's tokens)."""
    content = message.get("content")
    media = [isinstance(p, dict) and p.get("type") != "text" for p in content or ()]
    if not isinstance(content, list) or not any(media):
        return message
    text = "\n".join("<media>" if m else p["text"] for p, m in zip(content, media, strict=True))
    return {**message, "content": text}


def _whole(
    endpoint: str, request_id: str, model: str, words: list[str], usage: dict[str, Any]
) -> dict[str, Any]:
    text = "".join(words)
    if endpoint == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        kind = "text_completion"
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def _chunk(
    endpoint: str, request_id: str, model: str, word: str, index: int, last: bool
) -> dict[str, Any]:
    reason = "length" if last else None
    if endpoint == "chat":
        delta = {"role": "assistant", "content": word} if index == 0 else {"content": word}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": word, "logprobs": None, "finish_reason": reason}
        kind = "text_completion"
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }

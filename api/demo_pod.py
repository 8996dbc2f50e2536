"""A simulated vLLM pod for ``kvindex demo``: vLLM's KV events and a small OpenAI server,
on loopback, with no GPU and no model.

The events are the real thing: each prompt the pod "computes" is hashed into blocks as
vLLM hashes them (:class:`kvindex.indexer.keys.BlockHasher`), and each block not cached
yet is published as vLLM 0.33 publishes it (:class:`kvindex.events.wire.publisher.EnginePublisher`).
The cache only grows, so a prefix once computed stays a hit. The HTTP side is what the
gateway and the load scraper need from a pod: ``POST /v1/completions`` (token-id prompts
computed and cached; text prompts and ``/v1/chat/completions`` answered uncached: no
tokenizer), streamed as vLLM streams when asked, ``GET /v1/models``, ``GET /health`` and
a ``/metrics`` page with vLLM's scheduler gauges. Answers are deterministic: they say
which pod served and how much of the prompt it had cached.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig

#: vLLM 0.33 labels every event with its tier; a GPU pool's is "GPU".
MEDIUM = "GPU"


class DemoPod:
    """One pod called ``name`` serving ``model`` on ``127.0.0.1:<free port>`` (``self.pod``,
    the id kvindex routes to), publishing its KV events to the SUB socket kvindex binds at
    ``events_endpoint``. Call :meth:`start` to serve HTTP and :meth:`close` to stop."""

    def __init__(self, name: str, model: str, events_endpoint: str, hash_config: HashConfig):
        self.name = name
        self.model = model
        self.block_size = hash_config.block_size
        self._hasher = BlockHasher(hash_config)
        self._cached: set[int] = set()  # block keys this pod holds
        # The publisher's socket and the cache are used from every request's thread: one
        # at a time (a ZMQ socket is single-threaded; a computed prefix is published in
        # the order it is cached).
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._http.daemon_threads = True
        self.pod = f"127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(
            target=self._http.serve_forever, name=f"kvindex-demo-{name}", daemon=True
        )
        self._publisher = EnginePublisher(
            events_endpoint, topic=f"kv@{self.pod}@{model}", vllm_version="0.33", bind=False
        )

    def start(self) -> None:
        self._thread.start()

    def wait_for_kvindex(self, timeout_s: float) -> bool:
        """Whether kvindex's SUB socket has subscribed within ``timeout_s`` (a PUB socket
        drops whatever is published before: ZMQ's "slow joiner")."""
        with self._lock:
            return self._publisher.wait_for_subscribers(1, timeout_s)

    def compute(self, tokens: list[int]) -> int:
        """Prefill ``tokens``: publish the full blocks not cached yet (one ``BlockStored``,
        chained to the cached prefix) and return how many tokens were cached before."""
        keys = self._hasher.keys(tokens)
        with self._lock:
            hit = 0
            while hit < len(keys) and keys[hit] in self._cached:
                hit += 1
            if hit < len(keys):
                new = BlockStored(
                    block_hashes=keys[hit:],
                    parent_block_hash=keys[hit - 1] if hit else None,
                    token_ids=tokens[hit * self.block_size : len(keys) * self.block_size],
                    block_size=self.block_size,
                    medium=MEDIUM,
                )
                self._publisher.publish([new])
                self._cached.update(keys[hit:])
        return hit * self.block_size

    def metrics_page(self) -> str:
        """vLLM 0.33's scheduler gauges (the lines kvindex's load scraper reads), idle: a
        demo request is answered at once, so none is ever seen running or waiting, and
        cached blocks no request runs on count as free in vLLM's KV usage."""
        labels = f'{{engine="0",model_name="{self.model}"}}'
        return "".join(
            f"# TYPE {gauge} gauge\n{gauge}{labels} 0.0\n"
            for gauge in (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            )
        )

    def close(self) -> None:
        """Stop serving (the port is free after this) and close the publisher."""
        if self._thread.is_alive():
            self._http.shutdown()
        self._http.server_close()
        with self._lock:
            self._publisher.close()


class _BadRequest(Exception):
    """A request the pod refuses with a 400, as vLLM would."""


def _handler_for(pod: DemoPod) -> type[BaseHTTPRequestHandler]:
    class Handler(_PodHandler):
        owner = pod

    return Handler


class _PodHandler(BaseHTTPRequestHandler):
    owner: DemoPod
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's server: the gateway reuses it

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the demo's own output is the commands to try, not an access log

    def do_GET(self) -> None:
        pod = self.owner
        if self.path == "/metrics":
            self._send(200, pod.metrics_page().encode(), "text/plain; version=0.0.4")
        elif self.path == "/health":
            self._send(200, b"", "text/plain")
        elif self.path == "/v1/models":
            card = {"id": pod.model, "object": "model", "created": 0, "owned_by": "vllm"}
            self._json(200, {"object": "list", "data": [card]})
        else:
            self._error(404, "NotFoundError", f"{self.path} is not served by the demo pod")

    def do_POST(self) -> None:
        length = self.headers.get("content-length") or "0"
        if not length.isdigit():
            self.close_connection = True  # where the next request starts is unknown
            self._error(400, "BadRequestError", "a body needs a content-length")
            return
        raw = self.rfile.read(int(length))
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._error(404, "NotFoundError", f"{self.path} is not served by the demo pod")
            return
        pod = self.owner
        try:
            body = _request_body(raw)
            if body.get("model") != pod.model:  # vLLM's answer to a model it does not serve
                message = (
                    f"The model `{body.get('model')}` does not exist (this pod serves {pod.model})."
                )
                self._error(404, "NotFoundError", message)
                return
            answer, prompt_tokens, cached = _compute(pod, self.path, body)
        except _BadRequest as exc:
            self._error(400, "BadRequestError", str(exc))
            return
        chat = self.path == "/v1/chat/completions"
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(answer),
            "total_tokens": prompt_tokens + len(answer),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if body.get("stream"):
            self._stream(_chunks(chat, pod.model, answer))
        else:
            self._json(200, _whole(chat, pod.model, answer, usage))

    def _json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _error(self, status: int, kind: str, message: str) -> None:
        self._json(status, {"error": {"message": message, "type": kind, "code": status}})

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: Iterator[bytes]) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for event in events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.write(b"0\r\n\r\n")


def _request_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object")
    return body


def _compute(pod: DemoPod, path: str, body: dict[str, Any]) -> tuple[list[str], int, int]:
    """The answer's words, the prompt's length in tokens and how many were cached."""
    if path == "/v1/chat/completions" or isinstance(body.get("prompt"), str):
        # No tokenizer here: a text prompt's blocks are unknown, so nothing is cached
        # (kvindex routed it by load, for the same reason, unless it has a tokenizer).
        text = f"{pod.name} ({pod.pod}) served this; a text prompt is not cached (no tokenizer)"
        return text.split(), 0, 0
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch: the demo answers its first prompt
    if not (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        raise _BadRequest("`prompt` must be a string or a non-empty list of token ids")
    cached = pod.compute(prompt)
    text = (
        f"{pod.name} ({pod.pod}) served this: {cached} of the prompt's {len(prompt)} tokens "
        "were in its KV cache"
    )
    return text.split(), len(prompt), cached


def _whole(chat: bool, model: str, words: list[str], usage: dict[str, Any]) -> dict[str, Any]:
    text = " ".join(words)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice.update(text=text, logprobs=None)
    return {
        "id": "demo-0",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def _chunks(chat: bool, model: str, words: list[str]) -> Iterator[bytes]:
    """The answer as vLLM streams it: one server-sent event per word, then ``[DONE]``."""
    for index, word in enumerate(words):
        text = word if index == 0 else " " + word
        last = index == len(words) - 1
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
        if chat:
            choice["delta"] = {"content": text, **({"role": "assistant"} if index == 0 else {})}
        else:
            choice.update(text=text, logprobs=None)
        chunk = {
            "id": "demo-0",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
        }
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"

"""One OpenAI surface in both gateway modes (``kvindex serve --gateway`` and ``kvindex
gateway --index URL``): every /v1 error in OpenAI's shape, an unsupported /v1 route a 404
that names what is served (the openai client shows only the message), the /v1 paths and
their errors in the OpenAPI document. No pod is needed: every answer here is the
gateway's own."""

from __future__ import annotations

import contextlib
import http.client
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port
from tests.support.lazy import LazyModule
from tests.test_serve_processes import children

openai = LazyModule("openai", reason="the gateway tests need the test extra (openai)")

SUPPORTED = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models")


@pytest.fixture(scope="module")
def index() -> Iterator[ServeProcess]:
    with ServeProcess(
        "--gateway", "--zmq-bind", f"tcp://127.0.0.1:{free_port()}", env={**os.environ}
    ) as server:
        server.wait_ready(30.0, path="/healthz")
        yield server


# In front of kvindex, in front of kvindex with a serving worker (which relays /v1 to
# the primary, and answers its request limits' refusals itself), and alone.
@pytest.fixture(
    scope="module", params=["serve --gateway", "serve --gateway --processes 2", "gateway --index"]
)
def gateway(request: pytest.FixtureRequest, index: ServeProcess) -> Iterator[str]:
    if request.param == "serve --gateway":
        yield index.url
        return
    if request.param == "gateway --index":
        command = [sys.executable, "-m", "kvindex.api.serve.cli", "gateway", "--index", index.url]
        with ServeProcess(command=command, env={**os.environ}) as alone:
            alone.wait_ready(30.0, path="/health")
            yield alone.url
        return
    flags = ("--gateway", "--processes", "2", "--zmq-bind", f"tcp://127.0.0.1:{free_port()}")
    with ServeProcess(*flags, env={**os.environ}) as two:
        two.wait_ready(30.0, path="/healthz")
        eventually(
            lambda: any(listens(child, two.port) for child in children(two.process.pid)),
            "the serving worker listening",
        )
        yield two.url


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on 127.0.0.1:``port``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            inodes.add(os.readlink(fd))
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, inode = fields[1], fields[3], fields[9]
        if local == f"0100007F:{port:04X}" and state == "0A" and f"socket:[{inode}]" in inodes:
            return True
    return False


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=10)


def openai_error(answer: httpx.Response) -> dict[str, object]:
    """The answer's error, checked to be in OpenAI's shape."""
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, answer.text
    assert error["code"] == answer.status_code
    return error


def declared_too_large(url: str, path: str) -> httpx.Response:
    """The answer to a POST whose declared body is over --max-body-bytes' default."""
    connection = http.client.HTTPConnection(urlsplit(url).netloc, timeout=10)
    try:
        connection.putrequest("POST", path)
        connection.putheader("content-type", "application/json")
        connection.putheader("content-length", str(16 * 1024 * 1024 + 1))
        connection.endheaders()
        answer = connection.getresponse()
        return httpx.Response(answer.status, content=answer.read())
    finally:
        connection.close()


def test_unsupported_openai_routes_are_404s_the_client_can_read(gateway: str) -> None:
    with pytest.raises(openai.NotFoundError) as responses:
        client(gateway).responses.create(model="m", input="hello")
    with pytest.raises(openai.NotFoundError) as embeddings:
        client(gateway).embeddings.create(model="m", input="hello")
    for refused in (responses.value, embeddings.value):
        assert all(path in refused.message for path in SUPPORTED), refused.message
    assert "/v1/responses" in str(responses.value)
    assert "/v1/embeddings" in str(embeddings.value)


def test_every_v1_error_is_in_openai_shape(gateway: str) -> None:
    unknown = httpx.get(f"{gateway}/v1/nothing/here", timeout=10)
    assert unknown.status_code == 404
    assert openai_error(unknown)["type"] == "not_found"
    wrong_method = httpx.get(f"{gateway}/v1/completions", timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert openai_error(wrong_method)["type"] == "method_not_allowed"
    # Refused on its declared length, before any byte of the body is read; each on a
    # connection of its own, so that with a worker both processes answer some.
    for _ in range(16):
        too_large = declared_too_large(gateway, "/v1/chat/completions")
        assert too_large.status_code == 413
        assert openai_error(too_large)["type"] == "too_large"
    # No pod is known: the documented 503 no_pods, which the openai client raises.
    with pytest.raises(openai.InternalServerError) as no_pods:
        client(gateway).completions.create(model="m", prompt="hello", max_tokens=1)
    assert no_pods.value.status_code == 503
    assert no_pods.value.body["type"] == "no_pods", no_pods.value.body  # type: ignore[index]


def test_the_v1_paths_and_their_errors_are_in_the_openapi_document(gateway: str) -> None:
    paths = httpx.get(f"{gateway}/openapi.json", timeout=10).json()["paths"]
    for route in SUPPORTED:
        method, path = route.split()
        assert method.lower() in paths[path], path
    completions = paths["/v1/completions"]["post"]["responses"]
    assert "no_pods" in completions["503"]["description"]
    error = completions["503"]["content"]["application/json"]["schema"]
    assert error["required"] == ["error"]

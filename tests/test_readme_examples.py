"""The README's HTTP examples are what the service answers (issue 14: `/index/pods/{pod}`
lacked `not_owner`, the metrics example was not what its command prints).

The README's ``console`` blocks are parsed into (command, output) pairs; the same requests
go to a service in the README's situation (pods on 127.0.0.11-13 publishing over real
ZMQ). Refusals must match word for word; answers must have the same fields at every
level (values such as timestamps and hashes differ run to run); the metrics example
must list exactly the series its command prints.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvindex.api.app import create_app
from kvindex.api.cli import format_score_table
from kvindex.api.service import Service
from kvindex.api.settings_load import from_flags
from kvindex.api.testing import free_port
from kvindex.events.endpoints import from_source
from kvindex.events.publisher import EnginePublisher
from kvindex.events.testing import wait_until
from kvindex.events.wire import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig

README = Path(__file__).resolve().parents[1] / "README.md"
MODEL = "Qwen/Qwen3-8B"
HASHER = BlockHasher(HashConfig())
TOKENS = list(range(1, 8193))  # the README's prompt: 512 blocks
OTHER = list(range(100_001, 100_001 + 16 * 200))  # another conversation


def examples() -> list[tuple[str, str]]:
    """Every ``$ command`` of the README's console blocks with the output under it."""
    found: list[tuple[str, str]] = []
    blocks = re.findall(r"```console\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    for block in blocks:
        command: list[str] | None = None
        output: list[str] = []
        continued = False
        for line in block.splitlines():
            if continued and command is not None:
                command.append(line)
            elif line.startswith("$ "):
                if command is not None:
                    found.append((" ".join(command), "\n".join(output)))
                command, output = [line[2:]], []
            else:
                output.append(re.sub(r"\s{2,}#.*$", "", line))
                continue
            # A command goes on past a trailing backslash or inside an open quote.
            text = " ".join(command)
            continued = line.endswith("\\") or text.count("'") % 2 == 1
        if command is not None:
            found.append((" ".join(command), "\n".join(output)))
    return found


def curl(command: str) -> tuple[str, str]:
    """``(METHOD, path)`` of a README curl command."""
    path = re.search(r"localhost:8080(/[^\s'\"]*)", command)
    assert path, command
    method = "DELETE" if "-X DELETE" in command else "POST" if "-X POST" in command else None
    method = method or ("POST" if " -d " in command else "GET")
    return method, path.group(1)


def fields(value: Any, at: str = "") -> set[str]:
    """Every field path of a JSON value; keys that are data (pod ids, members, model
    names: they hold ':' or '/') are written '*'."""
    out: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            name = "*" if (":" in key or "/" in key) else key
            out.add(f"{at}.{name}")
            out |= fields(item, f"{at}.{name}")
    elif isinstance(value, list):
        for item in value:
            out |= fields(item, f"{at}[]")
    return out


def publish(endpoint: str, host: str, batches: list[list[BlockStored]], service: Service) -> None:
    pod = f"{host}:8000"
    with EnginePublisher(from_source(endpoint, host), topic=f"kv@{pod}@{MODEL}") as pub:
        assert pub.wait_for_subscribers(1, 5.0)
        for events in batches:
            pub.publish(events)
        assert wait_until(
            lambda: any(
                s.pod == pod and s.delivered == len(batches) for s in service.subscriber.streams()
            ),
            10.0,
        )


def stored(tokens: list[int], start: int, end: int, medium: str | None = None) -> BlockStored:
    keys = HASHER.keys(tokens[: end * 16])
    parent = keys[start - 1] if start else None
    return BlockStored(keys[start:end], parent, tokens[start * 16 : end * 16], 16, medium=medium)


@pytest.fixture
def cluster() -> Iterator[TestClient]:
    """The README's situation: .11 holds the whole prompt on GPU; .12 its first 200
    blocks on GPU, the next 100 and 200 blocks of another conversation in CPU memory;
    .13 four blocks of that other conversation. Admin token s3cret."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = Service(from_flags(zmq_bind=[endpoint], admin_token="s3cret"))
    with TestClient(create_app(service)) as client:
        publish(endpoint, "127.0.0.11", [[stored(TOKENS, 0, 512)]], service)
        twelve = [
            [stored(TOKENS, 0, 200)],
            [stored(TOKENS, 200, 300, "CPU"), stored(OTHER, 0, 200, "CPU")],
        ]
        publish(endpoint, "127.0.0.12", twelve, service)
        publish(endpoint, "127.0.0.13", [[stored(OTHER, 0, 4)]], service)
        yield client


def request(client: TestClient, command: str) -> Any:
    """The README command sent to the test service (its elided token lists filled in)."""
    method, path = curl(command)
    headers = {"Authorization": "Bearer s3cret"} if "Bearer s3cret" in command else {}
    if "KVINDEX_ADMIN_TOKEN" not in command and method == "DELETE" and not headers:
        with TestClient(create_app(Service(from_flags()), manage_lifecycle=False)) as bare:
            return bare.delete(path)  # "no token configured"
    if method != "POST":
        return client.request(method, path, headers=headers)
    body = re.search(r"-d '(.*?)'", command, re.S)
    if body is None:
        return client.post(path, headers=headers)
    text = re.sub(r"\s+", " ", body.group(1))
    if "content-type: text/plain" in command:
        return client.post(path, content=text, headers={"content-type": "text/plain"})
    text = re.sub(r"\[1, 2, \.\.\., (\d+)\]", lambda m: json.dumps(TOKENS[: int(m[1])]), text)
    return client.post(path, content=text, headers={"content-type": "application/json"})


def test_the_readme_has_the_examples_this_test_checks() -> None:
    paths = {curl(c)[1].split("?")[0] for c, _ in examples() if "localhost:8080" in c}
    assert {"/score", "/route", "/index/pods/127.0.0.12:8000", "/healthz", "/metrics"} <= paths


def test_http_examples_are_real_answers(cluster: TestClient) -> None:
    checked = 0
    for command, shown in examples():
        if "localhost:8080" not in command or "/metrics" in command:
            continue
        real = request(cluster, command).json()
        expected = json.loads(shown)
        if "error" in expected or curl(command)[1] in ("/healthz", "/readyz"):
            assert real == expected, command
        else:
            assert fields(real) == fields(expected), (command, json.dumps(real))
        checked += 1
    assert checked >= 13


def test_the_metrics_example_is_what_its_command_prints(cluster: TestClient) -> None:
    ((command, shown),) = [(c, o) for c, o in examples() if "localhost:8080/metrics" in c]
    pattern = re.search(r"grep -E '([^']+)'", command)
    assert pattern
    for earlier, _ in examples():  # the README's requests, in its order
        if "localhost:8080" in earlier and earlier is not command:
            request(cluster, earlier)
    text = cluster.get("/metrics").text
    printed = [line for line in text.splitlines() if re.search(pattern.group(1), line)]

    def series(lines: list[str]) -> list[str]:
        return sorted(line.rsplit(" ", 1)[0] for line in lines if line.strip())

    assert series(shown.splitlines()) == series(printed), "\n".join(printed)


def test_the_score_table_example_has_the_real_columns(cluster: TestClient) -> None:
    ((_, shown),) = [(c, o) for c, o in examples() if c.startswith("kvindex score")]
    answer = cluster.post("/score", json={"model": MODEL, "token_ids": TOKENS[:4096]}).json()
    real = format_score_table(answer).splitlines()
    lines = shown.splitlines()
    assert lines[0] == real[0] and lines[1].split() == real[1].split()
    assert lines[2].split()[0] == "127.0.0.11:8000" and real[2].split()[0] == "127.0.0.11:8000"

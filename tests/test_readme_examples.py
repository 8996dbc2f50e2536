"""Every runnable shell example of README.md and docs/ runs as written, with the real
``curl``, against a running ``kvindex serve`` (issue 14: examples that were not what the
service answers; issue 30: this test used to add a Content-Type the examples lacked,
which hid that ``curl -d`` without one got a 415).

The situation the examples describe: pods on 127.0.0.11-13 publishing over real ZMQ,
admin token s3cret. Each ``console`` block is parsed into (command, output) pairs and
each command is run by bash exactly as written; the only help it gets is a ``curl``
first on PATH that sends ``localhost:8080`` to this test's service (and
``KVINDEX_URL`` for ``kvindex score``). Refusals must match word for word; answers must
have the same fields at every level (values such as timestamps and hashes differ run to
run); the metrics example must list exactly the series its command prints. The ``sh``
and ``bash`` blocks of requests (curl, ``python -c``) run whole and must succeed;
``tests/test_docs.py`` checks the blocks that cannot run here (vLLM, kubectl).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvindex.api.serve.cli import format_score_table
from kvindex.api.testing import ServeProcess, free_port
from kvindex.events.ingest.testing import wait_until
from kvindex.events.wire.endpoints import from_source
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig

ROOT = Path(__file__).resolve().parents[1]
# The order the examples run in: the README, the quickstart, then the other pages.
PAGES = [
    ROOT / "README.md",
    ROOT / "docs" / "quickstart.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "quickstart.md"),
]
MODEL = "Qwen/Qwen3-8B"
HASHER = BlockHasher(HashConfig())
TOKENS = list(range(1, 8193))  # the examples' prompt, seq 1 8192: 512 blocks
OTHER = list(range(100_001, 100_001 + 16 * 200))  # another conversation
RUNNABLE = re.compile(r"^(curl|python3? -c) ")  # what a sh/bash block may run here


def blocks(kind: str) -> list[tuple[Path, str]]:
    """Every fenced block of ``kind`` (``console``, ``sh``, ``bash``) in the pages."""
    return [
        (page, block)
        for page in PAGES
        for block in re.findall(rf"^```{kind}\n(.*?)^```", page.read_text("utf-8"), re.S | re.M)
    ]


def examples() -> list[tuple[str, str]]:
    """Every ``$ command`` of the pages' console blocks with the output under it."""
    found: list[tuple[str, str]] = []
    for _, block in blocks("console"):
        command: list[str] | None = None
        output: list[str] = []
        continued = False
        for line in block.splitlines():
            if continued and command is not None:
                command.append(line)
            elif line.startswith("$ "):
                if command is not None:
                    found.append(("\n".join(command), "\n".join(output)))
                command, output = [line[2:]], []
            else:
                output.append(re.sub(r"\s{2,}#.*$", "", line))
                continue
            # A command goes on past a trailing backslash or inside an open quote.
            text = "\n".join(command)
            continued = line.endswith("\\") or text.count("'") % 2 == 1
        if command is not None:
            found.append(("\n".join(command), "\n".join(output)))
    return found


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


def stored(tokens: list[int], start: int, end: int, medium: str | None = None) -> BlockStored:
    keys = HASHER.keys(tokens[: end * 16])
    parent = keys[start - 1] if start else None
    return BlockStored(keys[start:end], parent, tokens[start * 16 : end * 16], 16, medium=medium)


def publish(endpoint: str, host: str, batches: list[list[BlockStored]], url: str) -> None:
    pod = f"{host}:8000"
    with EnginePublisher(from_source(endpoint, host), topic=f"kv@{pod}@{MODEL}") as pub:
        assert pub.wait_for_subscribers(1, 10.0)
        for events in batches:
            pub.publish(events)

        def delivered() -> bool:
            answer = httpx.get(f"{url}/index/pods/{pod}", timeout=5.0)
            streams = answer.json().get("streams", []) if answer.status_code == 200 else []
            return any(s["delivered"] == len(batches) for s in streams)

        assert wait_until(delivered, 20.0, 0.05), pod


class Shell:
    """Runs an example as bash runs it, ``localhost:8080`` being ``service``."""

    def __init__(self, tmp: Path, service: ServeProcess) -> None:
        real_curl = shutil.which("curl")
        assert real_curl, "the examples use curl: install it"
        shim = tmp / "bin"
        shim.mkdir(parents=True, exist_ok=True)
        (shim / "curl").write_text(
            "#!/usr/bin/env bash\n"
            'args=(); for a in "$@"; do args+=("${a//localhost:8080/$KVTEST_DOCS_HOST}"); done\n'
            f'exec {real_curl} "${{args[@]}}"\n'
        )
        (shim / "curl").chmod(0o755)
        self.cwd = tmp
        self.env = {
            **os.environ,
            "PATH": f"{shim}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "KVTEST_DOCS_HOST": f"127.0.0.1:{service.port}",
            "KVINDEX_URL": service.url,
        }

    def run(self, command: str) -> str:
        done = subprocess.run(
            ["bash", "-c", "set -o pipefail\n" + command],
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, (command, done.stdout, done.stderr)
        return done.stdout


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Shell]]:
    """The examples' situation: .11 holds the whole prompt on GPU; .12 its first 200
    blocks on GPU, the next 100 and 200 blocks of another conversation in CPU memory;
    .13 four blocks of that other conversation. Admin token s3cret. Beside it, a
    service with no admin token, for the example that shows that refusal."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "KVINDEX_ADMIN_TOKEN": "s3cret"}
    bare_env = {k: v for k, v in os.environ.items() if k != "KVINDEX_ADMIN_TOKEN"}
    with (
        ServeProcess("--zmq-bind", endpoint, env=env) as main,
        ServeProcess("--zmq-bind", f"tcp://127.0.0.1:{free_port()}", env=bare_env) as bare,
    ):
        main.wait_ready(60.0)
        bare.wait_ready(60.0)
        publish(endpoint, "127.0.0.11", [[stored(TOKENS, 0, 512)]], main.url)
        twelve = [
            [stored(TOKENS, 0, 200)],
            [stored(TOKENS, 200, 300, "CPU"), stored(OTHER, 0, 200, "CPU")],
        ]
        publish(endpoint, "127.0.0.12", twelve, main.url)
        publish(endpoint, "127.0.0.13", [[stored(OTHER, 0, 4)]], main.url)
        yield {
            "main": Shell(tmp_path_factory.mktemp("main"), main),
            "bare": Shell(tmp_path_factory.mktemp("bare"), bare),
        }


def shell_for(services: dict[str, Shell], command: str) -> Shell:
    """The example's own comment says when it is about a service with no token."""
    return services["bare"] if "# no token configured" in command else services["main"]


def test_the_pages_have_the_examples_this_test_checks() -> None:
    paths = {
        m.group(1).split("?")[0]
        for c, _ in examples()
        if (m := re.search(r"localhost:8080(/[^\s'\"]*)", c))
    }
    assert {"/score", "/route", "/index/pods/127.0.0.12:8000", "/healthz", "/metrics"} <= paths


def test_every_console_command_is_one_this_test_runs() -> None:
    """A console example this test would not run is an example nobody checks."""
    for command, _ in examples():
        assert command.startswith(("curl ", "kvindex score ")), command


def test_http_examples_are_real_answers(services: dict[str, Shell]) -> None:
    checked = 0
    for command, shown in examples():
        if "localhost:8080/metrics" in command:
            continue
        printed = shell_for(services, command).run(command)
        if command.startswith("kvindex score"):
            continue  # a table: test_the_score_table_example_has_the_real_columns
        real, expected = json.loads(printed), json.loads(shown)
        if "error" in expected or re.search(r"localhost:8080/(healthz|readyz)\b", command):
            assert real == expected, command
        else:
            assert fields(real) == fields(expected), (command, printed)
        checked += 1
    assert checked >= 13


def test_the_metrics_example_is_what_its_command_prints(services: dict[str, Shell]) -> None:
    ((command, shown),) = [(c, o) for c, o in examples() if "localhost:8080/metrics" in c]
    for earlier, _ in examples():  # the pages' requests, in their order
        if earlier is not command and "# no token configured" not in earlier:
            services["main"].run(earlier)
    printed = services["main"].run(command)

    def series(text: str) -> list[str]:
        return sorted(line.rsplit(" ", 1)[0] for line in text.splitlines() if line.strip())

    assert series(shown) == series(printed), printed


def test_the_score_table_example_has_the_real_columns(services: dict[str, Shell]) -> None:
    ((command, shown),) = [(c, o) for c, o in examples() if c.startswith("kvindex score")]
    real = services["main"].run(command).splitlines()
    lines = shown.splitlines()
    assert lines[0] == real[0] and lines[1].split() == real[1].split()
    assert lines[2].split()[0] == "127.0.0.11:8000" and real[2].split()[0] == "127.0.0.11:8000"
    answer = httpx.post(
        services["main"].env["KVINDEX_URL"] + "/score",
        json={"model": MODEL, "token_ids": TOKENS[:4096]},
        timeout=10.0,
    ).json()
    assert format_score_table(answer).splitlines()[0] == real[0]


def test_request_blocks_run_as_written(services: dict[str, Shell]) -> None:
    """The sh/bash blocks of requests (curl, python -c) run whole and answer no error."""
    ran = 0
    for page, block in blocks("sh") + blocks("bash"):
        commands = [line for line in block.splitlines() if line and not line.startswith("#")]
        if not all(RUNNABLE.match(c) or c.startswith(" ") for c in commands):
            continue  # not requests: tests/test_docs.py checks it
        printed = services["main"].run(block)
        assert '"error"' not in printed, (page.name, block, printed)
        ran += 1
    assert ran >= 2

"""What an operator sees: one clear line instead of a traceback, --version, the startup
line, the help listing every KVINDEX_* variable, warnings for unknown ones, Redis outages
logged once when they start and once when they end, build and process metrics."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvindex.api.http.app import create_app
from kvindex.api.serve import cli
from kvindex.api.serve.health import BackendHealthLog
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings import SECTIONS
from kvindex.api.serve.settings_derived import ConfigError
from kvindex.api.serve.settings_sources import from_flags
from kvindex.api.testing import ServeProcess, free_port
from kvindex.api.version import VERSION, implementations
from kvindex.indexer.redis.backend import RedisBackend
from tests.redis_fixtures import RedisServer

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``kvindex ARGS`` as a child process; bounded (a server that started is a failure)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}
    return subprocess.run(
        [sys.executable, "-m", "kvindex.api.serve.cli", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def one_clear_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 or lines[0].startswith("usage:"), result.stderr
    return lines[-1]


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout == f"kvindex {VERSION} ({implementations()})\n"  # one line, unwrapped


def test_zmq_bind_without_a_scheme_is_one_line() -> None:
    line = one_clear_line(run_cli("serve", "--zmq-bind", "127.0.0.1:5557"))
    assert "did you mean tcp://127.0.0.1:5557" in line


def test_http_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_clear_line(run_cli("serve", "--listen", f"127.0.0.1:{port}"))
    assert f"127.0.0.1:{port}" in line and "in use" in line


def test_zmq_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_clear_line(
            run_cli(
                "serve",
                "--listen",
                f"127.0.0.1:{free_port()}",
                "--zmq-bind",
                f"tcp://127.0.0.1:{port}",
            )
        )
    assert "--zmq-bind" in line and "in use" in line


def test_bad_token_ids_are_one_line() -> None:
    line = one_clear_line(run_cli("score", "--model", "m", "--tokens", "1,2,x"))
    assert "'x' is not a token id" in line


def test_record_and_replay_say_what_is_wrong_with_a_path_in_one_line(tmp_path: Path) -> None:
    nowhere = tmp_path / "no-such-dir" / "x.cap"
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: nothing is sent
    line = one_clear_line(run_cli("record", endpoint, str(nowhere), "--duration", "0.1"))
    assert line == f"kvindex record: {nowhere}: No such file or directory"
    line = one_clear_line(run_cli("replay", str(nowhere), endpoint))
    assert line == f"kvindex replay: {nowhere}: No such file or directory"
    line = one_clear_line(run_cli("replay", str(tmp_path), endpoint))
    assert line == f"kvindex replay: {tmp_path}: Is a directory"
    line = one_clear_line(run_cli("record", "127.0.0.1:5557", str(tmp_path / "x.cap")))
    assert line.startswith("kvindex record: endpoint '127.0.0.1:5557': Invalid argument")


def test_replaying_a_file_that_is_no_capture_says_so(tmp_path: Path) -> None:
    not_capture = tmp_path / "notes.txt"
    not_capture.write_text("hello, this is no capture")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    line = one_clear_line(run_cli("replay", str(not_capture), endpoint))
    assert line == f"kvindex replay: {not_capture} is not a kvindex capture (no capture header)"
    empty = tmp_path / "empty.cap"
    empty.write_bytes(b"")
    line = one_clear_line(run_cli("replay", str(empty), endpoint))
    assert line == f"kvindex replay: {empty} is empty, not a kvindex capture"


def test_a_mistyped_flag_suggests_the_right_one() -> None:
    line = one_clear_line(run_cli("serve", "--zmq-bnd", "tcp://127.0.0.1:5557"))
    assert "did you mean --zmq-bind?" in line


def test_the_removed_admin_token_flag_says_what_to_use() -> None:
    line = one_clear_line(run_cli("serve", "--admin-token", "s3cret"))
    assert "KVINDEX_ADMIN_TOKEN" in line and "--admin-token-file" in line


def test_serve_help_lists_every_setting_as_a_variable() -> None:
    text = run_cli("serve", "--help").stdout
    found = 0
    for section, cls in SECTIONS.items():
        prefix = cls.flag_prefix.replace("-", "_").upper()
        for name in cls.__struct_fields__:
            if section == "scoring" and name.endswith("_weights"):
                continue  # tables: the config file only
            assert f"KVINDEX_{prefix}{name.upper()}" in text, (section, name)
            found += 1
    assert found >= 45 and "KVINDEX_MODEL_CONFIG" in text


def test_env_settings_reach_serve() -> None:
    args = cli.build_parser().parse_args(["serve"])
    env = {"KVINDEX_ADMIN_TOKEN": "tok", "KVINDEX_BODY_TIMEOUT": "2.5", "KVINDEX_MAX_PODS": "7"}
    settings = cli._settings_from(args, env)
    assert (settings.http.admin_token, settings.http.body_timeout, settings.http.max_pods) == (
        "tok",
        2.5,
        7,
    )
    assert cli.unknown_variables({"KVINDEX_ZMQ_BINDS": "x", "KVINDEX_MODEL": "m"}) == [
        "KVINDEX_ZMQ_BINDS"
    ]


def test_a_missing_tokenizer_directory_fails_at_startup(tmp_path: Path) -> None:
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": {"m": {"tokenizer": str(tmp_path / "nowhere")}}}))
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        Service(from_flags(model_config=str(config)))
    line = one_clear_line(run_cli("serve", "--model-config", str(config)))
    assert "'m'" in line and "nowhere" in line


def test_startup_line_and_unknown_variable_warning() -> None:
    zmq_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}
    env["KVINDEX_ZMQ_BINDD"] = "tcp://127.0.0.1:1"
    with ServeProcess("--zmq-bind", f"tcp://127.0.0.1:{zmq_port}", "--model", "m", env=env) as s:
        s.wait_ready(30.0)
        log = s.log_tail()
    assert "KVINDEX_ZMQ_BINDD is not a kvindex setting" in log
    assert (
        f"kvindex {VERSION} started: backend=memory ({implementations()}) "
        "hash_algo=sha256 block_size=16 "
        f"key_mode=engine models=m listen=127.0.0.1:{s.port} "
        f"events=bind tcp://127.0.0.1:{zmq_port}"
    ) in log


def test_readyz_without_an_event_source_says_why() -> None:
    with TestClient(create_app(Service(from_flags()))) as client:
        answer = client.get("/readyz")
    assert answer.status_code == 503
    assert any("no event source" in p for p in answer.json()["problems"])


def test_build_info_and_process_metrics() -> None:
    with TestClient(create_app(Service(from_flags(zmq_bind=["tcp://127.0.0.1:0"])))) as client:
        text = client.get("/metrics").text
    assert f'kvindex_build_info{{backend="memory",version="{VERSION}"}} 1.0' in text
    assert "process_resident_memory_bytes" in text and "process_open_fds" in text


def test_redis_outage_is_logged_once_at_start_and_once_at_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisServer(tmp_path / "redis", appendonly=False)
    backend = RedisBackend.from_url(server.url, prefix="kvtest-health")
    health = BackendHealthLog(backend)
    caplog.set_level(logging.WARNING, logger="kvindex.api.serve.health")
    try:
        health.start()  # nothing listens yet: said once at startup
        health.stop()
        health._thread = object()  # type: ignore[assignment]  # as if running
        for _ in range(3):
            health.check()
        server.start()
        for _ in range(3):
            health.check()
        server.stop()
        for _ in range(3):
            health.check()
        server.start()
        health.check()
    finally:
        server.stop()
        backend.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("starting with the index backend unavailable")
    assert [line.split(":")[0].split(" after")[0] for line in lines[1:]] == [
        "index backend available again",
        "index backend unavailable",
        "index backend available again",
    ]
    assert health.outages == 2


def test_serve_starts_against_a_down_redis_and_says_so() -> None:
    """A Redis that is down at startup is an outage to report and wait out, not a reason
    to exit: the process serves /healthz, is unready, and its log says why."""
    down = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    with ServeProcess("--backend", down, "--model", "m") as s:
        s.wait_ready(30.0, path="/healthz")
        assert not s.answers("/readyz")
        log = s.log_tail()
    assert "starting with the index backend unavailable" in log
    assert "started: backend=redis://127.0.0.1" in log and "models=m " in log


def test_the_repositorys_own_variables_are_not_warned_about() -> None:
    """Every ``KVINDEX_*`` variable the test suite, CI or a script reads is one kvindex
    serve knows: a test-only variable under the prefix (it was KVINDEX_VLLM_PYTHON) made
    ``serve`` warn in every CI run that exported it. Test-only ones are ``KVTEST_*``."""
    read = re.compile(r"""(?:environ(?:\.get)?\(|environ\[|getenv\(|\$\{?|name: )["']?(KV\w+)""")
    names = set()
    for pattern in ("tests/**/*.py", "tests/**/*.sh", "bench/**/*.py", ".ci/*", "deploy/**/*"):
        for path in ROOT.glob(pattern):
            if path.is_file():
                names.update(read.findall(path.read_text(encoding="utf-8", errors="replace")))
    assert {"KVTEST_VLLM_PYTHON", "KVTEST_REDIS_URL", "KVINDEX_ADMIN_TOKEN"} <= names
    assert cli.unknown_variables(dict.fromkeys(names, "x")) == []


def test_serving_processes_need_the_memory_backend_and_a_count_of_one_or_more() -> None:
    redis = run_cli(
        "serve", "--listen", "127.0.0.1:0", "--backend", "redis://127.0.0.1:6379/15",
        "--processes", "2",
    )  # fmt: skip
    assert "--processes above 1 needs the memory backend" in one_clear_line(redis)
    zero = run_cli("serve", "--listen", "127.0.0.1:0", "--processes", "0")
    assert "--processes 0: must be at least 1" in one_clear_line(zero)

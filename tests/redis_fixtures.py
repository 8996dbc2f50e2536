"""Real Redis for tests: the shared server, private servers on free ports, a 3-master cluster.

The shared server's URL comes from ``KVTEST_REDIS_URL`` (default
``redis://127.0.0.1:6379/15``: db 15, so a developer's db 0 is never written; CI may point
it at a throwaway server). Tests that stop or
restart Redis start their own :class:`RedisServer`. Every test works under a key prefix
of its own and deletes it afterwards; that cleanup is the only place a SCAN is used.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from kvindex.api.testing import free_port
from kvindex.indexer.redis.backend import RedisBackend

REDIS_URL = os.environ.get("KVTEST_REDIS_URL", "redis://127.0.0.1:6379/15")
_STARTUP_S = 10.0


def _wait(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def shared_redis() -> redis.Redis:
    """The shared test server; skips the test when it is not reachable."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {REDIS_URL} (set KVTEST_REDIS_URL): {exc}")
    return client


def delete_prefix(client: redis.Redis | RedisCluster, prefix: str) -> None:
    """Test cleanup only: delete every key under ``prefix``."""
    keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
    for start in range(0, len(keys), 500):
        client.delete(*keys[start : start + 500])  # a cluster client splits by slot


_ROOTS: dict[int, tuple[str, list[int]]] = {}


def _prefix(request: pytest.FixtureRequest, client: redis.Redis | RedisCluster) -> str:
    """A prefix no other backend uses. Backends of one test share a root, deleted once
    when the test ends (a property test makes hundreds of backends)."""
    node = id(request.node)
    root = _ROOTS.get(node)
    if root is None:
        root = _ROOTS[node] = (f"kvtest-{uuid.uuid4().hex[:12]}", [0])

        def cleanup() -> None:
            del _ROOTS[node]
            delete_prefix(client, root[0])

        request.addfinalizer(cleanup)
    root[1][0] += 1
    return f"{root[0]}-{root[1][0]}"


def redis_backend_factory(request: pytest.FixtureRequest) -> RedisBackend:
    """A fresh, empty RedisBackend on the shared server (contract suite factory)."""
    client = shared_redis()
    request.addfinalizer(client.close)
    return RedisBackend.from_url(REDIS_URL, prefix=_prefix(request, client))


def cluster_backend_factory(request: pytest.FixtureRequest) -> RedisBackend:
    """A fresh, empty RedisBackend on the session's 3-master cluster."""
    cluster: RedisClusterProcess = request.getfixturevalue("redis_cluster")
    return RedisBackend.from_url(cluster.url, prefix=_prefix(request, cluster.client))


class RedisServer:
    """A redis-server process of a test's own on a free loopback port.

    ``appendonly`` keeps data across :meth:`restart` (the deployment's setting); the
    data directory is private to the server.
    """

    def __init__(self, directory: Path, *, appendonly: bool = True, port: int | None = None):
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.process: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            "redis-server",
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "always",
            "--daemonize", "no",
        ]  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        try:
            _wait(lambda: client.ping(), _STARTUP_S, f"redis-server on port {self.port}")
        finally:
            client.close()

    def stop(self) -> None:
        """A clean shutdown (SIGTERM): the append-only file is complete."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _free_cluster_port() -> int:
    """A free port P below 55536 whose cluster bus port P + 10000 is free too."""
    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            for candidate in (port, port + 10000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _cluster_state(node: redis.Redis) -> str:
    info = node.execute_command("CLUSTER INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("cluster_state:"):
            return line.split(":", 1)[1].strip()
    return info.get("cluster_state", "") if isinstance(info, dict) else ""


class RedisClusterProcess:
    """Three cluster-enabled redis-servers on free loopback ports, one master each."""

    def __init__(self, directory: Path) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            pytest.skip("redis-server and redis-cli are needed for the cluster tests")
        self.directory = directory
        self.ports = [_free_cluster_port() for _ in range(3)]
        self.processes: list[subprocess.Popen[bytes]] = []
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0?cluster=yes"
        self.client: RedisCluster

    def start(self) -> None:
        for port in self.ports:
            args = [
                "redis-server",
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.directory / f"nodes-{port}.conf"),
                "--dir", str(self.directory),
                "--save", "",
                "--appendonly", "no",
                "--daemonize", "no",
            ]  # fmt: skip
            self.processes.append(
                subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        for port in self.ports:
            node = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
            _wait(lambda node=node: node.ping(), _STARTUP_S, f"cluster node {port}")
            node.close()
        create = ["redis-cli", "--cluster", "create"]
        create += [f"127.0.0.1:{p}" for p in self.ports]
        create += ["--cluster-replicas", "0", "--cluster-yes"]
        subprocess.run(
            create,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
        for port in self.ports:
            node = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
            _wait(
                lambda node=node: _cluster_state(node) == "ok",
                _STARTUP_S,
                f"cluster_state:ok on {port}",
            )
            node.close()
        self.client = RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=2)

    def stop(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcess]:
    cluster = RedisClusterProcess(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()

"""`kvindex serve --peers`: a new memory replica copies a live peer's index and resumes
every stream by replay from the copy's positions. Real processes: two replicas, engines
publishing over loopback ZMQ with replay buffers, the dump over HTTP.

Each engine keeps the set of blocks it holds, so the checks compare both replicas with
what the engines really hold. A relay between the replicas (a plain HTTP server in the
test) holds a real dump while the engines go on publishing, so events between the dump
and the new replica's start must come from the replay; it also serves a dump cut short,
damaged, of another format version, or forged, as a broken peer would.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvindex.api.serve.peers import DUMP_PATH, DUMP_SIZE_HEADER
from kvindex.api.testing import ServeProcess, eventually, free_port
from kvindex.indexer.memory.snapshot_file import SnapshotBytes, read_snapshot_from
from tests.support.engine import MODEL, Engine

pytestmark = pytest.mark.slow

TOKEN = "t0ken"


#: Each engine's replay buffer, in batches: shorter than the first test's history, so a
#: replica that ignored the copy's positions could not rebuild it from seq 0.
BUFFER_STEPS = 24


class Replica:
    """One `kvindex serve` over the engines, with the admin token in its environment."""

    def __init__(self, tmp: Path, name: str, engines: list[Engine], *flags: str, token=TOKEN):
        args = ["--log-format", "json", *flags]
        for engine in engines:
            args += ["--zmq-connect", engine.connect]
        self.server = ServeProcess(
            *args,
            env={**os.environ, "KVINDEX_ADMIN_TOKEN": token},
            log_path=tmp / f"{name}.log",
        )
        self.server.wait_ready(30.0)
        self.url = self.server.url

    def blocks(self, engine: Engine) -> list[int] | None:
        answer = httpx.get(
            f"{self.url}/index/pods/{engine.pod}/blocks", params={"model": MODEL}, timeout=5
        )
        return answer.json()["blocks"].get(engine.pod) if answer.status_code == 200 else None

    def exact(self, engine: Engine) -> bool:
        return self.blocks(engine) == sorted(engine.held)

    def state(self, engine: Engine) -> str | None:
        answer = httpx.get(f"{self.url}/index/pods/{engine.pod}", timeout=5)
        return answer.json()["stream_state"] if answer.status_code == 200 else None

    def scores(self, hashes: list[int]) -> list[dict]:
        """/score by block hash, one request per hash: the pods that hold it."""
        out = []
        for key in hashes:
            body = {"model": MODEL, "block_hashes": [key]}
            answer = httpx.post(f"{self.url}/score", json=body, timeout=5).json()
            out.append(
                {p["pod"]: p["matched_blocks"] for p in answer["pods"] if p["matched_blocks"]}
            )
        return out

    def readyz(self) -> dict:
        return httpx.get(f"{self.url}/readyz", timeout=5).json()

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def dump(self) -> bytes:
        answer = httpx.get(
            f"{self.url}{DUMP_PATH}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
        )
        assert answer.status_code == 200, answer.text
        assert int(answer.headers[DUMP_SIZE_HEADER]) == len(answer.content)
        return answer.content


class Relay:
    """A peer that serves fixed bytes as its dump (what a live peer sent earlier, or a
    broken peer's version of it)."""

    def __init__(self, body: bytes, size: int | None = None) -> None:
        stated = len(body) if size is None else size

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header(DUMP_SIZE_HEADER, str(stated))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[Callable[..., object]]:
    replay_port = free_port()
    engines = [
        Engine(f"127.0.0.{41 + i}", replay_port, seed=i, buffer_steps=BUFFER_STEPS)
        for i in range(2)
    ]
    replicas: list[Replica] = []
    relays: list[Relay] = []

    def replica(name: str, *flags: str, token: str = TOKEN) -> Replica:
        made = Replica(tmp_path, name, engines, "--replay-port", str(replay_port), *flags,
                       token=token)  # fmt: skip
        replicas.append(made)
        for engine in engines:
            assert engine.pub.wait_for_subscribers(len(replicas), 10.0)
        return made

    def relay(body: bytes, size: int | None = None) -> Relay:
        made = Relay(body, size)
        relays.append(made)
        return made

    yield engines, replica, relay
    for made in replicas:
        made.server.stop(signal.SIGKILL)
    for made_relay in relays:
        made_relay.close()
    for engine in engines:
        engine.pub.close()


#: Sockets bound but never listening, held until the module ends: a connection to one is
#: refused at once, and no other test can take the port in the meantime (a port that is
#: merely free can be, which turns "unreachable" into a timeout).
_CLOSED_PORTS: list[socket.socket] = []


def closed_port_url() -> str:
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    _CLOSED_PORTS.append(held)
    return f"http://127.0.0.1:{held.getsockname()[1]}"


@pytest.fixture(scope="module", autouse=True)
def _release_closed_ports() -> Iterator[None]:
    yield
    while _CLOSED_PORTS:
        _CLOSED_PORTS.pop().close()


def ingest(replica: Replica, engines: list[Engine], batches: int) -> None:
    for _ in range(batches):
        for engine in engines:
            engine.step()
    for engine in engines:
        eventually(lambda e=engine: replica.exact(e), f"{engine.pod} indexed by {replica.url}")


def probes(engines: list[Engine]) -> list[int]:
    """Hashes to score: some each engine holds, and one nobody holds."""
    keys = [key for engine in engines for key in sorted(engine.held)[:6]]
    return [*keys, 12345]


def held_by(engines: list[Engine], keys: list[int]) -> list[dict[str, int]]:
    """What /score must say of each key: the engines that hold it, one block each."""
    return [{e.pod: 1 for e in engines if key in e.held} for key in keys]


def test_a_new_replica_copies_a_peer_and_replays_what_came_after_the_dump(world) -> None:
    engines, replica, relay = world
    peer = replica("peer", "--peers", closed_port_url())  # its own peer is not up: empty
    assert "peer recovery failed" in " ".join(peer.readyz()["notes"])
    for _ in range(3):  # in steps the buffers hold: a peer behind catches up by replay
        ingest(peer, engines, 10)
    dump = peer.dump()
    assert len(dump) > 1000
    # Published after the dump was taken: the new replica has them only by replay from
    # the dump's positions (the relay serves the bytes of the earlier dump).
    for _ in range(12):  # seq 30..41: the buffers keep 18..41, the dump ends at 29
        for engine in engines:
            engine.step()
    fresh = replica("fresh", "--peers", relay(dump).url)
    assert any("index copied at start from peer" in n for n in fresh.readyz()["notes"])
    assert 'kvindex_peer_recovery{result="copied"} 1.0' in fresh.metrics()
    for engine in engines:  # more events flow; both replicas follow them
        engine.step()
    for engine in engines:
        for made in (peer, fresh):
            eventually(lambda e=engine, r=made: r.exact(e), f"{engine.pod} exact in {made.url}")
            eventually(lambda e=engine, r=made: r.state(e) == "live", f"{engine.pod} live")
    keys = probes(engines)
    assert fresh.scores(keys) == peer.scores(keys)
    assert fresh.scores(keys) == held_by(engines, keys)


def test_a_replica_of_several_processes_copies_a_peer_of_several_processes(world) -> None:
    """Restore happens in the primary before the serving workers map the index, as a
    snapshot's does; a dump asked of a worker is relayed from the primary as a stream."""
    engines, replica, _ = world
    peer = replica("peer", "--processes", "2", "--peers", closed_port_url())
    ingest(peer, engines, 20)
    dumps = {peer.dump() for _ in range(6)}  # fresh connections: primary and worker answer
    assert all(read_snapshot_from(io.BytesIO(d), len(d), "dump") for d in dumps)
    fresh = replica("fresh", "--processes", "2", "--peers", peer.url)
    assert 'kvindex_peer_recovery{result="copied"} 1.0' in fresh.metrics()
    for engine in engines:
        engine.step()
    for engine in engines:
        eventually(lambda e=engine: fresh.exact(e) and peer.exact(e), f"{engine.pod} exact")
    keys = probes(engines)
    held = held_by(engines, keys)
    eventually(lambda: fresh.scores(keys) == held, "every process answers what engines hold")
    assert fresh.scores(keys) == peer.scores(keys)


def _truncated(dump: bytes) -> tuple[bytes, int | None]:
    return dump[: len(dump) // 2], len(dump)


def _flipped(dump: bytes) -> tuple[bytes, int | None]:
    damaged = bytearray(dump)
    damaged[len(damaged) * 2 // 3] ^= 0x40
    return bytes(damaged), None


def _other_version(dump: bytes) -> tuple[bytes, int | None]:
    return dump[:8] + (99).to_bytes(4, "big") + dump[12:], None


def _forged(dump: bytes) -> tuple[bytes, int | None]:
    """A valid checksum over a table whose counters do not hold."""
    tree = read_snapshot_from(io.BytesIO(dump), len(dump), "dump")
    tree["index"]["tables"][MODEL]["counts"][0, 0] = 18
    forged = b"".join(bytes(c) for c in SnapshotBytes(tree).chunks())
    return forged, None


@pytest.mark.parametrize(
    ("broken", "result"),
    [
        pytest.param(None, "unreachable", id="peer-down"),
        pytest.param("token", "unauthorized", id="wrong-token"),
        pytest.param(_truncated, "truncated", id="truncated"),
        pytest.param(_flipped, "corrupt", id="tampered"),
        pytest.param(_other_version, "version", id="unknown-version"),
        pytest.param(_forged, "invalid", id="forged"),
    ],
)
def test_a_peer_that_gives_no_usable_dump_leaves_the_replica_empty_and_replaying(
    world, broken: Callable[[bytes], tuple[bytes, int | None]] | str | None, result: str
) -> None:
    engines, replica, relay = world
    peer = replica("peer", "--peers", closed_port_url())
    ingest(peer, engines, 10)
    if broken is None:
        url, token = closed_port_url(), TOKEN
    elif broken == "token":
        url, token = peer.url, "not-the-token"
    else:
        assert callable(broken)
        url, token = relay(*broken(peer.dump())).url, TOKEN
    fresh = replica("fresh", "--peers", url, token=token)
    ready = fresh.readyz()
    assert ready["status"] == "ready"
    note = " ".join(ready["notes"])
    assert "peer recovery failed" in note and f"{url}: {result}" in note, note
    assert f'kvindex_peer_recovery{{result="{result}"}} 1.0' in fresh.metrics()
    log = fresh.server.log_tail(20_000)
    assert "cannot copy the index from peer" in log and "Traceback" not in log
    if result == "version":
        assert "format v99; this kvindex reads v1" in log
    # Empty, then the engines' replay (their buffers reach seq 0) rebuilds it exactly.
    for engine in engines:
        engine.step()
    for engine in engines:
        eventually(lambda e=engine: fresh.exact(e), f"{engine.pod} rebuilt by replay")
        eventually(lambda e=engine: fresh.state(e) == "live", f"{engine.pod} live")
    keys = probes(engines)
    assert fresh.scores(keys) == peer.scores(keys)

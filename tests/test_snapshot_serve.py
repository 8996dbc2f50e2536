"""Restarting `kvindex serve --snapshot`: real processes, real ZMQ engines with replay
buffers, real snapshot files.

Each engine is an :class:`EnginePublisher` bound on its own loopback address (connect
mode) that also keeps the set of blocks it holds, so every check compares the index
with what the engine really holds, not with a number written down in the test.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port
from kvindex.indexer.memory.snapshot_file import read_snapshot, write_snapshot
from tests.support.engine import MODEL, Engine

pytestmark = pytest.mark.slow
#: Resuming by replay *with the digest check* and the ``incomplete`` state (cleared by
#: AllBlocksCleared) are the subscriber's side of the resume interface, in
#: ``events/ingest/recovery.py``; the tests of those outcomes run wherever it is present.
needs_resume_check = pytest.mark.skipif(
    importlib.util.find_spec("kvindex.events.ingest.recovery") is None,
    reason="the subscriber's resume check (events/ingest/recovery.py) is not in this tree",
)

INCOMPLETE = ("incomplete", "gapped")  # the subscriber's name for history it lacks


class Cluster:
    def __init__(self, tmp_path: Path, engines: list[Engine], interval_s: float, replay_port: int):
        self.path = tmp_path / "kvindex.snap"
        self.engines = engines
        self._flags = [
            "--snapshot", str(self.path),
            "--snapshot-interval", str(interval_s),
            "--replay-port", str(replay_port),
            "--log-format", "json",
        ]  # fmt: skip
        for engine in engines:
            self._flags += ["--zmq-connect", engine.connect]
        self._tmp = tmp_path
        self._runs = 0
        self.server: ServeProcess | None = None

    def start(self) -> ServeProcess:
        self._runs += 1
        self.server = ServeProcess(
            *self._flags,
            env={**os.environ, "KVINDEX_ADMIN_TOKEN": "t0ken"},  # the token never in argv
            log_path=self._tmp / f"serve-{self._runs}.log",
        )
        self.server.wait_ready(30.0)
        return self.server

    def stop(self, sig: int) -> None:
        assert self.server is not None
        self.server.stop(sig)

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def blocks(self, engine: Engine) -> list[int] | None:
        answer = httpx.get(
            f"{self.url}/index/pods/{engine.pod}/blocks", params={"model": MODEL}, timeout=5
        )
        if answer.status_code != 200:
            return None
        return answer.json()["blocks"].get(engine.pod)

    def exact(self, engine: Engine) -> bool:
        return self.blocks(engine) == sorted(engine.held)

    def pod(self, engine: Engine) -> dict:
        return httpx.get(f"{self.url}/index/pods/{engine.pod}", timeout=5).json()

    def state(self, engine: Engine) -> str | None:
        answer = httpx.get(f"{self.url}/index/pods/{engine.pod}", timeout=5)
        return answer.json()["stream_state"] if answer.status_code == 200 else None

    def warnings(self, engine: Engine) -> list[str]:
        body = {"model": MODEL, "token_ids": list(range(64)), "pods": [engine.pod]}
        return httpx.post(f"{self.url}/score", json=body, timeout=5).json()["warnings"]

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def saved(self) -> dict[str, int]:
        """Pod -> seq in the snapshot file now ({} when there is none yet)."""
        if not self.path.exists():
            return {}
        return {s["pod"]: s["seq"] for s in read_snapshot(self.path)["streams"]}

    def wait_connected(self) -> None:
        for engine in self.engines:
            assert engine.pub.wait_for_subscribers(self._runs, 10.0)


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []
    replay_port = free_port()

    def build(*buffers: int, interval_s: float = 0.2) -> Cluster:
        engines = [
            Engine(f"127.0.0.{31 + i}", replay_port, seed=i, buffer_steps=b)
            for i, b in enumerate(buffers)
        ]
        cluster = Cluster(tmp_path, engines, interval_s, replay_port)
        made.append(cluster)
        return cluster

    yield build
    for cluster in made:
        if cluster.server is not None:
            cluster.server.stop(signal.SIGKILL)
        for engine in cluster.engines:
            engine.pub.close()


def ingest(cluster: Cluster, batches: int) -> None:
    for _ in range(batches):
        for engine in cluster.engines:
            engine.step()
    for engine in cluster.engines:
        eventually(lambda e=engine: cluster.exact(e), f"{engine.pod} indexed")


def wait_for_snapshot(cluster: Cluster) -> None:
    want = {e.pod: e.last_seq for e in cluster.engines}
    eventually(lambda: cluster.saved() == want, "a snapshot of the last batches")


def test_kill_9_after_a_snapshot_replays_the_tail_and_ends_exact(make) -> None:
    cluster = make(10_000, 10_000)
    cluster.start()
    cluster.wait_connected()
    ingest(cluster, 40)
    wait_for_snapshot(cluster)
    cluster.stop(signal.SIGKILL)
    a, b = cluster.engines
    for _ in range(25):  # published while kvindex is down: only the replay buffer has them
        a.step()
    b.step()
    cluster.start()
    cluster.wait_connected()
    for engine in cluster.engines:  # restored before any new batch
        assert cluster.state(engine) == "restored"
        assert any(engine.pod in w for w in cluster.warnings(engine))
    a.step()
    b.step()
    for engine in cluster.engines:
        eventually(lambda e=engine: cluster.exact(e), f"{engine.pod} exact after the replay")
        eventually(lambda e=engine: cluster.state(e) == "live", f"{engine.pod} live")
        eventually(lambda e=engine: cluster.warnings(e) == [], "no warning (cached a second)")
        report = cluster.pod(engine)
        assert report["streams"][0]["missed_batches"] == 0
    assert 'kvindex_snapshot_restore{result="restored"} 1.0' in cluster.metrics()


@needs_resume_check
def test_an_engine_whose_buffer_no_longer_reaches_the_snapshot_is_incomplete_until_cleared(
    make,
) -> None:
    cluster = make(8, 10_000)
    cluster.start()
    cluster.wait_connected()
    ingest(cluster, 12)
    wait_for_snapshot(cluster)
    cluster.stop(signal.SIGKILL)
    short, fine = cluster.engines
    for _ in range(30):  # far more than its 8-batch buffer
        short.step()
    fine.step()
    cluster.start()
    cluster.wait_connected()
    short.step()
    fine.step()
    eventually(lambda: cluster.state(short) in INCOMPLETE, "the short engine incomplete")
    eventually(lambda: cluster.exact(fine) and cluster.state(fine) == "live", "the other exact")
    warned = cluster.warnings(short)
    assert len(warned) == 1 and short.pod in warned[0], warned
    assert cluster.warnings(fine) == []
    assert "kvindex_score_warnings_total 1.0" in cluster.metrics()
    # The engine clears its cache: nothing it held before matters any more.
    short.clear()
    short.step()
    eventually(lambda: cluster.state(short) == "live", "cleared engine live again")
    eventually(lambda: cluster.exact(short), "cleared engine exact")
    eventually(lambda: cluster.warnings(short) == [], "no warning (cached a second)")


@pytest.mark.parametrize(
    "published",
    [
        # Past the saved seq: only the digest of the batch at that seq can tell.
        pytest.param(25, id="past-the-snapshot-seq", marks=needs_resume_check),
        # Below the saved seq: the engine's buffer has nothing at or after it.
        pytest.param(3, id="below-the-snapshot-seq", marks=needs_resume_check),
    ],
)
def test_an_engine_that_restarted_while_kvindex_was_down_is_reset(make, published: int) -> None:
    cluster = make(10_000, 10_000)
    cluster.start()
    cluster.wait_connected()
    ingest(cluster, 10)
    wait_for_snapshot(cluster)
    cluster.stop(signal.SIGKILL)
    restarted, steady = cluster.engines
    restarted.restart()
    for _ in range(published):
        restarted.step()
    steady.step()
    cluster.start()
    cluster.wait_connected()
    restarted.step()
    steady.step()
    for engine in cluster.engines:
        eventually(lambda e=engine: cluster.exact(e), f"{engine.pod}: what its engine holds")
        eventually(lambda e=engine: cluster.state(e) == "live", f"{engine.pod} live")
    assert cluster.pod(restarted)["restarts"] == 1
    assert cluster.pod(steady)["restarts"] == 0


def test_sigterm_writes_a_final_snapshot_and_idle_pods_come_back_restored(make) -> None:
    cluster = make(10_000, 10_000, interval_s=3600)  # no periodic snapshot in this test
    cluster.start()
    cluster.wait_connected()
    ingest(cluster, 15)
    assert cluster.saved() == {}
    cluster.stop(signal.SIGTERM)
    assert cluster.saved() == {e.pod: e.last_seq for e in cluster.engines}
    cluster.start()
    cluster.wait_connected()
    idle, busy = cluster.engines
    for engine in cluster.engines:
        assert cluster.exact(engine)  # restored from the file, nothing replayed yet
    busy.step()
    eventually(lambda: cluster.exact(busy) and cluster.state(busy) == "live", "busy pod live")
    # The idle pod is never heard: restored, unverified, and said so everywhere.
    assert cluster.state(idle) == "restored"
    assert [s["state"] for s in cluster.pod(idle)["streams"]] == ["restored"]
    warned = cluster.warnings(idle)
    assert len(warned) == 1 and idle.pod in warned[0] and "restored" in warned[0]
    metrics = cluster.metrics()
    assert 'kvindex_streams_unverified{state="restored"} 1.0' in metrics
    assert f'kvindex_pod_stream_unverified{{pod="{idle.pod}",state="restored"}} 1.0' in metrics
    # An operator who knows the pod is gone purges it: entries and mark go together.
    purged = httpx.delete(
        f"{cluster.url}/index/pods/{idle.pod}", headers={"Authorization": "Bearer t0ken"}
    )
    assert purged.json()["entries_removed"] == len(idle.held)
    # Its entries and mark are gone; still configured and never heard since the
    # restart, it is unheard: its engine's cache is unknown, not empty.
    assert cluster.state(idle) == "unheard"
    assert 'kvindex_streams_unverified{state="restored"} 0.0' in cluster.metrics()
    eventually(
        lambda: ["not heard from" in w for w in cluster.warnings(idle)] == [True],
        "only the unheard warning once purged",
    )


def test_a_corrupt_snapshot_is_refused_and_nothing_is_reported_live_falsely(make) -> None:
    cluster = make(6, 10_000)
    short, whole = cluster.engines
    for _ in range(20):  # before kvindex starts: the short engine's seq 0 is gone
        short.step()
    whole.step()
    write_snapshot(cluster.path, {"index": {"keys": np.arange(1000, dtype=np.uint64)}})
    damaged = bytearray(cluster.path.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40  # ours, but one bit flipped
    cluster.path.write_bytes(bytes(damaged))
    server = cluster.start()
    cluster.wait_connected()
    assert "cannot use snapshot" in server.log_tail()
    assert (cluster.path.parent / "kvindex.snap.refused").exists()
    short.step()
    whole.step()
    eventually(lambda: cluster.state(short) in INCOMPLETE, "the short engine not live")
    eventually(lambda: cluster.exact(whole) and cluster.state(whole) == "live", "whole one exact")
    assert any(short.pod in w for w in cluster.warnings(short))
    assert 'kvindex_snapshot_restore{result="corrupt"} 1.0' in cluster.metrics()


def _tamper_count(tree: dict, mid: int) -> None:
    tree["index"]["tables"][MODEL]["counts"][0, mid] = 18  # GPU blocks of the pod


def _tamper_probe(tree: dict, mid: int) -> None:
    """Move one key (its masks and reverse record with it) half the table away from its
    home: every counter still agrees, but probing can never find it there."""
    table = tree["index"]["tables"][MODEL]
    keys, masks, cap = table["keys"], table["masks"][0], table["cap"]
    slot = int(np.flatnonzero(keys)[0])
    to = (slot + cap // 2) % cap
    while keys[to]:
        to = (to + 1) % cap
    keys[to], keys[slot] = keys[slot], 0
    masks[to], masks[slot] = masks[slot], 0
    table["log_slots"][table["log_slots"] == slot] = to


def _tamper_long_name(tree: dict, mid: int) -> None:
    tree["index"]["names"][mid] = "x" * 5000 + ":8000"


def _tamper_unnamed(tree: dict, mid: int) -> None:
    tree["index"]["names"][mid] = None  # its blocks stay: a lookup finds no name for them


@pytest.mark.parametrize(
    "tamper", [_tamper_count, _tamper_probe, _tamper_long_name, _tamper_unnamed],
    ids=["count", "probe-invariant", "overlong-name", "unnamed-member"],
)  # fmt: skip
def test_a_snapshot_forged_with_a_valid_checksum_is_refused_and_scores_stay_sound(
    make, tamper: Callable[[dict, int], None]
) -> None:
    """The checksum only proves the file is what was written: a table whose counters,
    probe invariant or names do not hold is refused and moved aside like a damaged file,
    and the index is rebuilt from the engine's replay instead of served wrong."""
    cluster = make(10_000)
    (engine,) = cluster.engines
    cluster.start()
    cluster.wait_connected()
    for _ in range(5):
        engine.step(stores=8, removes=0)
    eventually(lambda: cluster.exact(engine), "40 blocks indexed")
    held = sorted(engine.held)[:1]
    cluster.stop(signal.SIGTERM)  # the final snapshot
    tree = read_snapshot(cluster.path)
    tamper(tree, tree["index"]["names"].index(engine.pod))
    write_snapshot(cluster.path, tree)  # the writer's own checksum: the file reads fine
    read_snapshot(cluster.path)
    server = cluster.start()

    def scores() -> list[int]:
        body = {"model": MODEL, "block_hashes": held}  # lookups that reach its entries
        return [
            httpx.post(f"{cluster.url}/score", json={**body, "pods": pods}, timeout=5).status_code
            for pods in (None, [engine.pod])
        ]

    assert set(scores()) <= {200, 404}  # nothing known of the model yet: never a 500
    assert "cannot use snapshot" in server.log_tail()
    assert (cluster.path.parent / "kvindex.snap.refused").exists()
    assert 'kvindex_snapshot_restore{result="invalid"} 1.0' in cluster.metrics()
    cluster.wait_connected()
    engine.step(stores=1, removes=0)  # heard again: its whole history is replayed from seq 0
    eventually(lambda: cluster.exact(engine), "what the engine holds, from its replay")
    assert cluster.pod(engine)["blocks"]["gpu"] == 41
    eventually(lambda: cluster.state(engine) == "live", "live after the replay")
    assert scores() == [200, 200]

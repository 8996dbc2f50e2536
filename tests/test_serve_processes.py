"""``kvindex serve --processes 2``: a real primary and a real serving worker on one port,
fed by real ZMQ engines. Every answer, whichever process gives it, is the index's exact
answer; the worker's requests show in the primary's /metrics; what only the primary
knows (speculative entries from /route) reaches every answer; a killed worker comes
back; and stopping the primary leaves no process and no shared memory behind.
"""

from __future__ import annotations

import os
import random
import signal
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvindex.api.serve.worker_process import ScoreReports, _report
from kvindex.api.testing import ServeProcess, eventually, free_port
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored

pytestmark = pytest.mark.slow

MODEL = "acme/chat-7b"
REQUESTS = 40  # each on its own connection: the kernel spreads them over both processes


def exited(pid: int) -> bool:
    """``pid`` is gone, or a zombie nobody reaped yet (a worker whose primary was killed
    belongs to whichever process adopts orphans here, which may reap it late)."""
    try:
        with open(f"/proc/{pid}/stat") as src:
            return src.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def children(pid: int) -> list[int]:
    """The child processes of ``pid``, whichever of its threads started them."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as src:
                out += [int(p) for p in src.read().split()]
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return sorted(out)


class Fleet:
    """Three engines, each holding one chain of block hashes (what /score must say)."""

    def __init__(self) -> None:
        rng = random.Random(11)
        self.engines = []
        self.chains: dict[str, list[int]] = {}
        for n in range(3):
            pod = f"127.0.0.{n + 1}:8000"
            pub = EnginePublisher(f"tcp://127.0.0.{n + 1}:{free_port()}", bind=True)
            self.engines.append((pod, pub))
            self.chains[pod] = [rng.getrandbits(63) for _ in range(8 * (n + 1))]

    def flags(self) -> list[str]:
        out = ["--model", MODEL]
        for pod, pub in self.engines:
            out += ["--zmq-connect", f"{pod}@{MODEL}={pub.endpoint}"]
        return out

    def publish(self) -> None:
        for pod, pub in self.engines:
            pub.publish([BlockStored(self.chains[pod], None, [], 16)])

    def close(self) -> None:
        for _, pub in self.engines:
            pub.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[ServeProcess, Fleet]]:
    fleet = Fleet()
    server = ServeProcess(
        *fleet.flags(),
        "--processes",
        "2",
        "--speculative-ttl",
        "30",
        log_path=tmp_path / "serve.log",
    )
    try:
        server.wait_ready(30.0, path="/healthz")
        eventually(lambda: len(children(server.process.pid)) == 1, "the serving worker")
        fleet.publish()
        longest = max(fleet.chains.values(), key=len)
        eventually(
            lambda: _score(server.url, longest)["pods"][0]["matched_blocks"] == len(longest),
            "the events to reach the index",
        )
        # Before their first batch the engines were unheard, which answers said; the
        # workers learn they were heard with the primary's next facts. Sixteen fresh
        # connections in a row reach both processes (the kernel spreads them by source
        # port: one missing the worker 2**-16 of the time), so both must have learnt it.
        eventually(
            lambda: all(_score(server.url, longest)["warnings"] == [] for _ in range(16)),
            "every pod heard, by every process",
        )
        yield server, fleet
    finally:
        if server.process.poll() is None:
            server.stop()
        fleet.close()
        print(server.log_tail())


#: Successful /score answers per server URL: every one the primary must count, the
#: fixture's own included (a worker's counts reach the primary's /metrics a moment later,
#: so a count read before the test's requests may not hold the fixture's yet).
_ANSWERED: Counter[str] = Counter()


def _score(url: str, hashes: list[int], **extra: object) -> dict:
    # a fresh connection each time (no keep-alive): any process may take it
    with httpx.Client(base_url=url, timeout=10) as client:
        reply = client.post("/score", json={"model": MODEL, "block_hashes": hashes, **extra})
    assert reply.status_code == 200, reply.text
    _ANSWERED[url] += 1
    return reply.json()


def _ok_count(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('kvindex_score_requests_total{outcome="ok"}'):
            return float(line.split()[-1])
    return 0.0


def test_every_process_answers_score_exactly_and_the_primary_counts_them_all(
    served: tuple[ServeProcess, Fleet],
) -> None:
    server, fleet = served
    rng = random.Random(2)
    pods = sorted(fleet.chains)
    for _ in range(REQUESTS):
        pod = rng.choice(pods)
        chain = fleet.chains[pod]
        cut = rng.randint(1, len(chain))
        answer = _score(server.url, [*chain[:cut], rng.getrandbits(63)])
        # every engine's chain is its own: exactly the one pod holds exactly the cut
        assert [(p["pod"], p["matched_blocks"]) for p in answer["pods"]] == [(pod, cut)]
        assert answer["warnings"] == []
    answered = _ANSWERED[server.url]  # the fixture's and these REQUESTS
    eventually(lambda: _ok_count(server.url) == answered, "every /score in /metrics")
    # the rest is the primary's, relayed by the worker on the connections it holds
    for _ in range(8):
        with httpx.Client(base_url=server.url, timeout=10) as client:
            assert client.get("/healthz").json() == {"status": "ok"}
            listed = client.get("/index/pods").json()
            assert sorted(p["pod"] for p in listed["pods"]) == pods
            refused = client.get("/score")
            assert refused.status_code == 405 and refused.json()["error"] == "method_not_allowed"
            bad = client.post("/score", json={"model": MODEL, "block_hashes": []})
            assert bad.status_code == 400 and bad.json()["error"]


def test_speculative_entries_of_the_primary_reach_every_score_answer(
    served: tuple[ServeProcess, Fleet],
) -> None:
    server, fleet = served
    pod = "127.0.0.1:8000"
    prompt = fleet.chains[pod] + [7001, 7002, 7003]
    with httpx.Client(base_url=server.url, timeout=10) as client:
        routed = client.post("/route", json={"model": MODEL, "block_hashes": prompt, "pods": [pod]})
    assert routed.status_code == 200, routed.text
    for _ in range(REQUESTS // 2):
        answer = _score(server.url, prompt, pods=[pod])
        row = answer["pods"][0]
        assert (row["pod"], row["matched_blocks"], row["speculative_blocks"]) == (pod, 8, 3)


def test_a_killed_worker_comes_back_and_a_stopped_primary_leaves_nothing(
    served: tuple[ServeProcess, Fleet],
) -> None:
    server, fleet = served
    (worker,) = children(server.process.pid)
    os.kill(worker, signal.SIGKILL)

    def replaced() -> bool:  # one reading: the dead one may be reaped between two
        now = children(server.process.pid)
        return len(now) == 1 and now != [worker]

    eventually(replaced, "a new serving worker")
    pod = "127.0.0.2:8000"
    for _ in range(REQUESTS // 2):
        assert _score(server.url, fleet.chains[pod])["pods"][0]["matched_blocks"] == 16
    (replacement,) = children(server.process.pid)
    with open(f"/proc/{replacement}/cmdline", "rb") as src:
        directory = (
            src.read().split(b"\0")[3].decode()
        )  # python -m kvindex.api.serve.worker_process DIR
    assert os.path.isdir(directory)
    server.stop(signal.SIGTERM)
    assert server.process.returncode == 0
    eventually(lambda: exited(replacement), "the worker to exit")
    assert not os.path.exists(directory)


def test_a_signal_to_the_whole_group_stops_without_starting_workers_again(
    served: tuple[ServeProcess, Fleet],
) -> None:
    """Ctrl-C or GNU ``timeout`` signal the process group: the worker may exit before
    the primary has seen its own signal, and that is a shutdown, not a worker to start
    again (nor a warning to log)."""
    server, _ = served
    (worker,) = children(server.process.pid)
    os.kill(worker, signal.SIGTERM)
    # The supervisor sees the worker gone first (reaped: its /proc entry is gone); it
    # would start another after 1 s.
    eventually(lambda: not os.path.exists(f"/proc/{worker}"), "the worker reaped", 10)
    server.stop(signal.SIGTERM)
    assert server.process.returncode == 0, server.log_tail()
    log = server.log_tail(100_000)
    assert "exited (code" not in log and "starting another" not in log, log


def test_a_reset_channel_means_the_primary_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A primary killed with a worker's report unread resets their channel: the
    worker's recv raises ECONNRESET instead of reading the end. That killed the thread
    that watches the primary (a clean-clone CI run), so the worker outlived it; it is
    the primary gone like an end read."""
    worker_end, primary_end = socket.socketpair()
    worker_end.sendall(b"a report the primary never read")
    primary_end.close()
    directory = tmp_path / "shared"
    directory.mkdir()
    signals: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: signals.append(sig))
    _report(worker_end, ScoreReports(), str(directory))  # returns: the primary is gone
    assert signals == [signal.SIGTERM] and not directory.exists()
    worker_end.close()


def test_workers_of_a_killed_primary_exit_and_remove_the_shared_memory(
    served: tuple[ServeProcess, Fleet],
) -> None:
    server, _ = served
    (worker,) = children(server.process.pid)
    with open(f"/proc/{worker}/cmdline", "rb") as src:
        directory = src.read().split(b"\0")[3].decode()
    server.stop(signal.SIGKILL)  # no chance to clean up after itself
    eventually(lambda: exited(worker), "the worker to exit")
    assert not os.path.exists(directory)

"""What a gateway knows of each pod's load: the gauges of vLLM's ``/metrics`` as of the
last scrape tick, the same for every policy, and the pages kvindex scrapes them from.

**One scrape clock for all.** A gateway sees a pod's load only by scraping it, every
``interval_s`` of virtual time (:class:`ScrapeClock`; default 50 ms, the scrape interval
of llm-d's endpoint picker: gateway-api-inference-extension's
``DefaultRefreshMetricsInterval``, ``pkg/epp/server/runserver.go``, also llm-d-router's
minimum). Between two ticks every policy that reads load (least-loaded, prefix-hash,
the pick rule of approximate/precise/greedy-perfect, llm-d, and kvindex itself) reads
the tick's :class:`Gauges`; a policy may add what it routed itself since (a gateway
knows what it just sent), as kvindex's in-flight ledger does. Dynamo's router reads no
scrape: its cost runs on its own predictions of what it routed (``ActiveSequences``).

**kvindex scrapes that same snapshot.** Each pod serves a vLLM-style ``/metrics`` page
(:class:`PodMetricsServers`) holding the current tick's gauges, and kvindex scrapes it
over HTTP as in a cluster. To make kvindex's view exactly the tick's, whatever the wall
clock does, a scrape of a pod already served this tick is held until the next tick (or
``hold_s``, then served again), and before a kvindex decision the runner waits until
kvindex has *stored* the current tick (:meth:`PodMetricsServers.wait_scraped`): every
pod served it, and then asked again - kvindex's scraper starts a round only after
storing the previous one. Only kvindex's own connections count (:class:`ScraperCheck`):
anyone else on the host may GET a pod's page (another run's kvindex scraping the same
pod addresses), and such a GET proves nothing about what this kvindex stored. kvindex
runs with a scrape interval of a few ms of wall time and a staleness limit far above the
hold, so its load view never goes stale in wall time while the simulation is busy
elsewhere.

The page holds what ``kvindex.scoring.load_metrics`` reads from vLLM 0.33's Prometheus
logger: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (labelled ``model_name`` and ``engine``), and
``process_start_time_seconds`` from prometheus_client's process collector, which
vLLM's API server exposes: the pod's last (re)start on the clock its KV-event batches
are stamped with (the wall clock: the publisher stamps ``time.time()``), so kvindex can
tell a restarted pod it has not heard from since, as it would in a cluster.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.sim.pod import SimPod
from bench.sim.pool import BlockPool
from bench.sim.service import ServiceError

#: llm-d's endpoint picker scrapes every 50 ms by default (see the module docstring).
DEFAULT_SCRAPE_S = 0.05


@dataclass(frozen=True, slots=True)
class Gauges:
    """One pod's ``/metrics`` gauges at one scrape tick."""

    running: int
    waiting: int
    kv_usage: float
    started_at: float  # the pod's last (re)start, on the clock its event batches carry

    @classmethod
    def of(cls, pod: SimPod) -> Gauges:
        return cls(len(pod.running), len(pod.waiting), pod.kv_usage, pod.started_at)


class ScrapedPod:
    """A pod as a gateway sees it between two ticks: the last tick's gauges, plus the
    pool (its block size, and the true cache for ``greedy-perfect``'s and ``precise``'s
    bookkeeping only)."""

    __slots__ = ("kv_usage", "max_num_seqs", "pool", "running", "tick", "waiting_count")

    def __init__(self, pool: BlockPool, gauges: Gauges, max_num_seqs: int, tick: int) -> None:
        self.pool = pool
        self.running = gauges.running
        self.waiting_count = gauges.waiting
        self.kv_usage = gauges.kv_usage
        self.max_num_seqs = max_num_seqs
        self.tick = tick  # the scrape these figures come from

    @property
    def load(self) -> int:
        """Requests in the system at the scrape: ``num_requests_running`` + ``_waiting``."""
        return self.running + self.waiting_count

    @property
    def saturated(self) -> bool:
        """At the scrape a new request would have waited: a queue, or every slot taken."""
        return self.waiting_count > 0 or self.running >= self.max_num_seqs


class ScrapeClock:
    """Scrape ticks in virtual time: :meth:`advance` before handling an event at ``now``
    takes the snapshot of any tick passed since (the pods' state is constant between
    events, so the state now is the state at the tick)."""

    def __init__(self, pods: Sequence[SimPod], interval_s: float = DEFAULT_SCRAPE_S) -> None:
        if interval_s <= 0:
            raise ValueError("the scrape interval must be positive")
        self.pods = pods
        self.interval_s = interval_s
        self.tick = -1
        self.gauges: list[Gauges] = []
        self.views: list[ScrapedPod] = []
        self.ticks_taken = 0

    def advance(self, now: float) -> bool:
        """Take the snapshot if a tick passed by ``now``; True when one was taken."""
        tick = math.floor(now / self.interval_s)
        if tick <= self.tick:
            return False
        self.tick = tick
        self.ticks_taken += 1
        self.gauges = [Gauges.of(pod) for pod in self.pods]
        self.views = [
            ScrapedPod(pod.pool, g, pod.costs.max_num_seqs, tick)
            for pod, g in zip(self.pods, self.gauges, strict=True)
        ]
        return True


def page(gauges: Gauges, model: str) -> bytes:
    labels = f'{{engine="0",model_name="{model}"}}'
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{labels} {gauges.running}\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{labels} {gauges.waiting}\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{labels} {gauges.kv_usage:.6f}\n"
        "# TYPE process_start_time_seconds gauge\n"
        f"process_start_time_seconds {gauges.started_at!r}\n"
    ).encode()


class _Board:
    """The tick's pages and, per pod, which tick its scraper was served and whether it
    came back since (the proof that kvindex stored it). Shared by the handler threads
    and the runner under one condition."""

    def __init__(self, pods: int, hold_s: float) -> None:
        self.cond = threading.Condition()
        self.tick = -1
        self.pages: list[bytes] = [b""] * pods
        self.served = [-2] * pods  # the tick each pod's page was last served for
        self.back = [False] * pods  # asked again after serving the current tick
        self.hold_s = hold_s
        self.closed = False

    def serve(self, i: int, scraper: bool = True) -> bytes:
        """Pod ``i``'s page. Only kvindex's ``scraper`` moves the board (and is held
        once served this tick); anyone else just reads the page."""
        with self.cond:
            if not scraper:
                return self.pages[i]
            if self.served[i] == self.tick and not self.back[i]:
                self.back[i] = True
                self.cond.notify_all()
            deadline = time.monotonic() + self.hold_s
            while self.served[i] == self.tick and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            self.served[i] = self.tick
            return self.pages[i]

    def publish(self, tick: int, pages: list[bytes]) -> None:
        with self.cond:
            self.tick, self.pages = tick, pages
            self.back = [False] * len(pages)
            self.cond.notify_all()

    def wait_scraped(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            tick = self.tick
            while not all(s == tick and b for s, b in zip(self.served, self.back, strict=True)):
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return False
                self.cond.wait(left)
            return True

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class ScraperCheck:
    """Tells whether a connection to a pod's server comes from the kvindex process
    ``pid``: the client end's socket is one of that process's open files.

    Read from Linux's ``/proc`` (the TCP table gives the client socket's inode, the
    process's fd links name its sockets), once per connection: kvindex's scraper keeps
    its connections open. Where ``/proc`` cannot tell (another OS, no permission),
    every connection counts, as if kvindex were the only client."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def __call__(self, connection: socket.socket) -> bool:
        try:
            client_end, server_end = connection.getpeername(), connection.getsockname()
            inode = _client_inode(client_end, server_end)
            if inode is None:
                return True  # no TCP table to read: cannot tell
            fds = f"/proc/{self.pid}/fd"
            names = os.listdir(fds)
        except (OSError, ValueError):
            return True
        wanted = f"socket:[{inode}]"
        for name in names:
            with contextlib.suppress(OSError):  # an fd closed while we look
                if os.readlink(f"{fds}/{name}") == wanted:
                    return True
        return False


def _client_inode(client_end: tuple[str, int], server_end: tuple[str, int]) -> str | None:
    """The inode of the socket whose local end is ``client_end`` and remote end
    ``server_end`` in ``/proc/net/tcp`` (IPv4: the pods' servers listen on IPv4);
    "0" when no open socket is listed, None when the table cannot be read."""
    try:
        with open("/proc/net/tcp") as table:
            lines = table.read().splitlines()[1:]
    except OSError:
        return None
    local, remote = _tcp_table_address(*client_end), _tcp_table_address(*server_end)
    for line in lines:
        fields = line.split()
        # inode 0: a closed connection's TIME_WAIT entry, which may share the address pair
        if len(fields) > 9 and fields[1] == local and fields[2] == remote and fields[9] != "0":
            return fields[9]
    return "0"


def _tcp_table_address(host: str, port: int) -> str:
    """``host:port`` as ``/proc/net/tcp`` writes it: the address as a native-order u32
    and the port, both in upper-case hex."""
    (address,) = struct.unpack("=I", socket.inet_aton(host))
    return f"{address:08X}:{port:04X}"


class PodMetricsServers:
    """One HTTP server per pod on the pod id's own port serving the tick's page;
    ``close`` stops them. ``scraper_pid``: the kvindex process whose scrapes
    :meth:`wait_scraped` waits for (None: any client's, for a scraper in this process)."""

    def __init__(
        self,
        pods: Sequence[SimPod],
        model: str,
        hold_s: float = 0.2,
        scraper_pid: int | None = None,
    ) -> None:
        self.model = model
        self._board = _Board(len(pods), hold_s)
        scraper = ScraperCheck(scraper_pid) if scraper_pid is not None else None
        self._servers: list[ThreadingHTTPServer] = []
        self.waits = 0  # decisions that waited for kvindex to store a new tick
        self.timeouts = 0
        self.wait_s = 0.0
        try:
            for i, pod in enumerate(pods):
                host, _, port = pod.pod_id.rpartition(":")
                server = ThreadingHTTPServer((host, int(port)), _handler(self._board, i, scraper))
                server.daemon_threads = True
                # polled every 50 ms: close() waits for one poll per server
                threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
                self._servers.append(server)
        except OSError as exc:
            self.close()
            raise ServiceError(f"cannot serve a pod's /metrics ({exc}); try --first-port") from exc

    @property
    def tick(self) -> int:
        return self._board.tick

    def publish(self, clock: ScrapeClock) -> None:
        """Serve ``clock``'s current tick from now on."""
        self._board.publish(clock.tick, [page(g, self.model) for g in clock.gauges])

    def wait_scraped(self, timeout_s: float) -> bool:
        """Wait until kvindex has stored the current tick of every pod; False on timeout
        (counted: the decision then reads an older tick)."""
        started = time.monotonic()
        ok = self._board.wait_scraped(timeout_s)
        self.waits += 1
        self.wait_s += time.monotonic() - started
        if not ok:
            self.timeouts += 1
        return ok

    def close(self) -> None:
        self._board.close()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers = []


def _handler(board: _Board, i: int, scraper: ScraperCheck | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # Keep-alive: kvindex's scraper reuses its connection, so a scrape is one request
        # on a connection thread that lives as long as the run (not a thread each).
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body go in two writes
        from_scraper: bool | None = None  # per connection (one handler each), asked once

        def do_GET(self) -> None:  # the stdlib handler's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            if self.from_scraper is None:
                self.from_scraper = scraper is None or scraper(self.connection)
            body = board.serve(i, self.from_scraper)
            # A scraper may hang up mid-answer (kvindex stopped at the end of a run, or
            # a scrape past its timeout): nothing to report, and no traceback to print.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler

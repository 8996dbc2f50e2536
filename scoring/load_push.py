"""Live load that SGLang pods push: each scheduler's ``LoadStat`` on the pod's load topic,
kept as the pod's :class:`~kvindex.scoring.load.PodLoad` with ``source="push"``.

SGLang 0.5.23 (``srt/managers/scheduler_components/load_publisher.py``, opt-in with
``--load-publish-endpoint``) binds one PUB socket per data-parallel rank, at
``load_endpoint_port_base + rank``, and sends ``[b"load", seq, LoadStat]`` from its
scheduler loop: a changed gauge at once (after every prefill batch, else every few loop
iterations), an unchanged one again at most once a second (a heartbeat). Its ``/metrics``
gauges are refreshed only where SGLang logs its stats (each prefill batch, every 40th
decode step), so a live push is never older news than a scrape. The port base and the
rank count are advertised in the pod's ``/server_info`` (``kv_events``); kvindex asks it
of each pod ``pods_source`` names (pods kvindex knows, never an address from a request)
and subscribes to every rank at the pod's own host.

One thread owns every SUB socket and every rank's last LoadStat; it publishes each pod's
immutable PodLoad by one dict assignment (:meth:`PushedLoads.current`), once each of its
ranks has reported: requests summed over the ranks, KV usage ``num_tokens /
max_total_num_tokens`` per rank (mean and max, as a scrape gives them), and
``scraped_at`` the receipt time of its oldest rank's figure. Which of a pod's two records
a decision reads, pushed or scraped, is :class:`~kvindex.scoring.load.LoadView`'s rule.
A bad message is counted against its pod (``invalid_load``, ``bad_frame``) and logged at
most every ten seconds; it never stops the thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq

from kvindex.events.ingest.ratelog import RateLimitedLog
from kvindex.events.wire.endpoints import prepare_socket
from kvindex.events.wire.identity import IdentityError, pod_host
from kvindex.events.wire.sglang import LOAD_TOPIC, LoadStat, decode_load, load_endpoints
from kvindex.events.wire.vllm import DecodeError
from kvindex.scoring.load import PodLoad
from kvindex.scoring.load_metrics import MAX_REQUESTS, EngineLoad

log = logging.getLogger(__name__)

#: A LoadStat is a few dozen bytes; ZMQ drops the connection of a peer sending more
#: than this before buffering it, for good (a protocol error ends the session: the
#: silence rule below subscribes again).
MAX_LOAD_MESSAGE = 64 * 1024
#: Far above SGLang's descriptor with every server argument in it: a bound, not a size.
MAX_SERVER_INFO_BYTES = 4 * 1024 * 1024
#: How often the pods to follow are read from ``pods_source``.
REFRESH_S = 1.0
#: A pod whose /server_info could not be read is asked again after this long.
RETRY_S = 10.0
#: A pod that advertises no load socket (SGLang without --load-publish-endpoint, a vLLM
#: pod, an older SGLang) is asked again after this long: it may restart with one. A
#: rank silent this long (SGLang's heartbeat is a second) has its pod's sockets closed
#: and /server_info asked again: the pod may have restarted on other ports, or ZMQ
#: ended the connection.
RECHECK_S = 60.0
#: Messages taken from one socket per wake-up, so one chatty pod cannot starve others.
_BATCH = 256


def default_server_info_url(pod: str) -> str:
    return f"http://{pod}/server_info"


@dataclass(slots=True)
class _Pod:
    """One followed pod, the thread's alone."""

    sockets: list[zmq.Socket] = field(default_factory=list)
    stats: list[tuple[LoadStat, float] | None] = field(default_factory=list)
    heard: list[float] = field(default_factory=list)  # monotonic, per rank
    asking: Future | None = None
    ask_at: float = 0.0  # monotonic time of the next /server_info request
    silent_noted: bool = False  # "advertises no load socket" logged once
    failing: bool = False  # its /server_info failed last time (logged once per episode)


class PushedLoads:
    """Subscriber thread of every followed SGLang pod's load topic."""

    def __init__(
        self,
        pods_source: Callable[[], Iterable[str]],
        *,
        clock: Callable[[], float] = time.monotonic,
        timeout_s: float = 0.5,
        server_info_url: Callable[[str], str] = default_server_info_url,
        recheck_s: float = RECHECK_S,
    ) -> None:
        self._pods_source = pods_source
        self._recheck_s = recheck_s
        self._clock = clock
        self._timeout_s = timeout_s
        self._server_info_url = server_info_url
        self._pods: dict[str, _Pod] = {}
        self._socket_owner: dict[zmq.Socket, tuple[str, int]] = {}
        self._poller = zmq.Poller()
        # Published for other threads; this thread is the only writer of each.
        self._loads: dict[str, PodLoad] = {}
        self._received: dict[str, int] = {}
        self._errors: dict[str, dict[str, int]] = {}
        self._ranks: dict[str, int] = {}
        self._bad = RateLimitedLog(log)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._context: zmq.Context | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._client = None

    # -- read from any thread -------------------------------------------------------

    def current(self) -> Mapping[str, PodLoad]:
        """Each followed pod's last complete pushed load (every rank reported); fresh or
        not is the reader's rule. No lock: records are replaced, never changed."""
        return self._loads

    def received(self) -> dict[str, int]:
        """LoadStat messages applied, per pod."""
        return dict(self._received)

    def errors(self) -> dict[str, dict[str, int]]:
        """Messages and /server_info answers that could not be used, per pod, by reason:
        invalid_load, bad_frame, invalid_server_info, server_info_unreachable."""
        return {pod: dict(kinds) for pod, kinds in list(self._errors.items())}

    def advertised(self) -> dict[str, int]:
        """Per followed pod whose /server_info answered: the load sockets (ranks) it
        advertises and kvindex subscribed to, 0 when it advertises none."""
        return dict(self._ranks)

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        import httpx

        self._stop.clear()
        self._client = httpx.Client(
            timeout=httpx.Timeout(self._timeout_s), follow_redirects=False, trust_env=False
        )
        self._context = zmq.Context()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvindex-server-info")
        self._thread = threading.Thread(target=self._run, name="kvindex-load-push", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        ended = True
        if self._thread is not None:
            self._thread.join(timeout=self._timeout_s + 5)
            ended = not self._thread.is_alive()
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._context is not None:
            if ended:  # its sockets are closed (the thread closes them as it ends)
                self._context.term()
            self._context = None

    # -- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        next_refresh = 0.0
        try:
            while not self._stop.is_set():
                try:
                    if time.monotonic() >= next_refresh:
                        self._refresh()
                        next_refresh = time.monotonic() + REFRESH_S
                    self._harvest()
                    if not self._socket_owner:
                        self._stop.wait(0.1)
                        continue
                    touched = set()
                    for sock, _ in self._poller.poll(100):
                        pod = self._drain(sock)
                        if pod is not None:
                            touched.add(pod)
                    for pod in touched:
                        self._publish(pod)
                except Exception as exc:  # a bug, not a pod's fault (those are counted)
                    self._bad.error("round", "load push round failed: %r", exc)
                    self._stop.wait(0.1)
        finally:
            for pod in list(self._pods):
                self._forget(pod)

    def _refresh(self) -> None:
        wanted = set(self._pods_source())
        for pod in [p for p in self._pods if p not in wanted]:
            self._forget(pod)
        now = time.monotonic()
        for pod in wanted:
            state = self._pods.get(pod)
            if state is None:
                state = self._pods[pod] = _Pod()
            if state.sockets and now - min(state.heard) > self._recheck_s:
                log.info(
                    "%s's load topic silent for %gs: asking its /server_info again",
                    pod,
                    self._recheck_s,
                )
                self._unsubscribe(state)
            if not state.sockets and state.asking is None and now >= state.ask_at:
                assert self._pool is not None
                state.asking = self._pool.submit(self._server_info, pod)

    def _harvest(self) -> None:
        for pod, state in self._pods.items():
            future = state.asking
            if future is None or not future.done():
                continue
            state.asking = None
            body, kind, message = future.result()
            if kind is not None:
                self._count(pod, kind)
                if not state.failing:
                    log.warning("%s (asked again every %gs)", message, RETRY_S)
                state.failing = True
                state.ask_at = time.monotonic() + RETRY_S
                continue
            state.failing = False
            if body is None:  # no such page: not a pod that pushes load
                self._advertises_none(pod, state, message)
                continue
            try:
                endpoints = load_endpoints(body, pod_host(pod))
            except (DecodeError, IdentityError) as exc:
                self._count(pod, "invalid_server_info")
                if not state.failing:
                    log.warning("%s /server_info: %s (asked again every %gs)", pod, exc, RETRY_S)
                state.failing = True
                state.ask_at = time.monotonic() + RETRY_S
                continue
            if not endpoints:
                self._advertises_none(pod, state, "its kv_events advertise no load range")
                continue
            self._subscribe(pod, state, endpoints)

    def _advertises_none(self, pod: str, state: _Pod, why: str) -> None:
        self._ranks[pod] = 0
        if not state.silent_noted:
            state.silent_noted = True
            log.info(
                "%s pushes no load (%s): its /metrics alone gives its load; SGLang pushes it "
                "with --load-publish-endpoint auto",
                pod,
                why,
            )
        state.ask_at = time.monotonic() + self._recheck_s

    def _subscribe(self, pod: str, state: _Pod, endpoints: list[str]) -> None:
        assert self._context is not None
        for rank, endpoint in enumerate(endpoints):
            sock = self._context.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_LOAD_MESSAGE)
            sock.setsockopt(zmq.RCVHWM, 64)  # a gauge: the newest reading is what counts
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5_000)
            sock.setsockopt(zmq.SUBSCRIBE, LOAD_TOPIC)
            prepare_socket(sock, endpoint)
            sock.connect(endpoint)
            self._poller.register(sock, zmq.POLLIN)
            self._socket_owner[sock] = (pod, rank)
            state.sockets.append(sock)
        state.stats = [None] * len(endpoints)
        state.heard = [time.monotonic()] * len(endpoints)
        self._ranks[pod] = len(endpoints)
        log.info("following %s's load topic: %s", pod, ", ".join(endpoints))

    def _forget(self, pod: str) -> None:
        state = self._pods.pop(pod, None)
        if state is None:
            return
        if state.asking is not None:
            state.asking.cancel()
        self._unsubscribe(state)
        self._loads.pop(pod, None)
        self._ranks.pop(pod, None)
        self._received.pop(pod, None)
        self._errors.pop(pod, None)

    def _unsubscribe(self, state: _Pod) -> None:
        """Close the pod's sockets; its last record stays, to go stale on its own."""
        for sock in state.sockets:
            self._poller.unregister(sock)
            del self._socket_owner[sock]
            sock.close(linger=0)
        state.sockets, state.stats, state.heard = [], [], []

    def _drain(self, sock: zmq.Socket) -> str | None:
        """Take up to a batch of the socket's waiting messages; the pod, if any applied."""
        pod, rank = self._socket_owner[sock]
        state = self._pods[pod]
        applied = False
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            if len(frames) != 3 or frames[0] != LOAD_TOPIC:
                self._reject(pod, "bad_frame", f"{len(frames)} frames, topic {frames[0][:32]!r}")
                continue
            try:
                stat = decode_load(frames[2])
            except DecodeError as exc:
                self._reject(pod, exc.reason, exc.detail)
                continue
            if max(stat.num_running_reqs, stat.num_waiting_reqs) > MAX_REQUESTS:
                self._reject(pod, "invalid_load", f"more than {MAX_REQUESTS} requests")
                continue
            state.stats[rank] = (stat, self._clock())
            state.heard[rank] = time.monotonic()
            self._received[pod] = self._received.get(pod, 0) + 1
            applied = True
        return pod if applied else None

    def _reject(self, pod: str, reason: str, detail: str) -> None:
        self._count(pod, reason)
        self._bad.warning(f"{reason}:{pod}", "%s load topic: %s skipped: %s", pod, reason, detail)

    def _count(self, pod: str, reason: str) -> None:
        kinds = self._errors.get(pod)
        if kinds is None:
            kinds = self._errors[pod] = {}
        kinds[reason] = kinds.get(reason, 0) + 1

    def _publish(self, pod: str) -> None:
        stats = [entry for entry in self._pods[pod].stats if entry is not None]
        if len(stats) < len(self._pods[pod].stats):
            return  # a sum over some ranks only would read as an idle pod
        engines = {
            str(rank): EngineLoad(stat.num_running_reqs, stat.num_waiting_reqs, stat.kv_usage)
            for rank, (stat, _) in enumerate(stats)
        }
        oldest = min(at for _, at in stats)
        self._loads[pod] = PodLoad.of_engines(pod, engines, oldest, source="push")

    # -- /server_info, on the pool ---------------------------------------------------

    def _server_info(self, pod: str) -> tuple[bytes | None, str | None, str]:
        """The body of the pod's /server_info, or (None, kind, why): kind None when the
        pod has no such page (404), invalid_server_info for a body over the bound, else
        server_info_unreachable."""
        import httpx

        client = self._client
        assert client is not None
        url = self._server_info_url(pod)
        try:
            with client.stream("GET", url) as response:
                if response.status_code == 404:
                    return None, None, f"GET {url}: HTTP 404"
                if response.status_code != 200:
                    why = f"GET {url}: HTTP {response.status_code}"
                    return None, "server_info_unreachable", why
                chunks, size = [], 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > MAX_SERVER_INFO_BYTES:
                        return None, "invalid_server_info", f"GET {url}: body over the bound"
                    chunks.append(chunk)
            return b"".join(chunks), None, ""
        except httpx.HTTPError as exc:
            return None, "server_info_unreachable", f"GET {url}: {type(exc).__name__}: {exc}"
        except Exception as exc:  # never the thread's failure
            return None, "server_info_unreachable", f"GET {url}: {type(exc).__name__}"

"""Live load per pod, for routing decisions: what each vLLM or SGLang pod's ``/metrics``
said in its last good scrape, or what an SGLang pod last pushed on its load topic
(:class:`PodLoad`, :mod:`kvindex.scoring.load_push`), or why it is not known
(:class:`Unknown`).

Only the pods kvindex knows are scraped (``set_pods`` or ``pods_source``), never a name
taken from a request: that would make kvindex a proxy for GETs to any address. A pod
whose last good scrape is older than ``stale_after_s`` is Unknown, never idle; the one
exception is ``pending`` (its first scrape not tried yet: nothing is known against it).
Scrape failures are counted per pod and never raise. Requests are summed over a pod's
engines (data-parallel ranks); KV usage is kept as mean, max and per engine. The scraper
thread is the only writer of scrape results and publishes each pod's immutable record by
one dict assignment, so ``snapshot`` takes no lock. Metrics are the caller's to wrap
around ``scrape_errors`` and ``snapshot``: this module holds no registry.

A pod that pushes its load has two records, each with one writer: the scraper's and the
push thread's. ``snapshot`` picks, without a lock: the pushed record while it is fresh
(every rank heard within ``stale_after_s``, and at least :data:`PUSH_FRESH_S`: SGLang
sends a changed gauge at once and an unchanged one every second, so a live push is never
older news than a scrape), else the scrape while it is fresh, else Unknown. The pushed
record is read with the scrape's ``started`` (a restart shows on ``/metrics`` only).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import msgspec
from msgspec.structs import replace

from kvindex.scoring.load_metrics import (
    EngineLoad,
    MetricsError,
    parse_engine_loads,
    parse_start_time,
    totals,
)
from kvindex.scoring.route.outlier import Outcome, OutlierDetector

if TYPE_CHECKING:
    from kvindex.scoring.load_push import PushedLoads

log = logging.getLogger(__name__)

_MAX_BODY_BYTES = 8 * 1024 * 1024  # far above any vLLM metrics page: a bound, not a size


class PodLoad(msgspec.Struct, frozen=True, gc=False):
    """A pod's load as of its last good scrape, or its last push (kvindex's own in-flight
    routes are the ledger's: :class:`kvindex.scoring.route.inflight.InFlightLedger`)."""

    pod: str
    running: int
    waiting: int
    kv_usage: float | None  # mean over engines, 0..1; None if the pod exports none
    kv_usage_max: float | None
    engines: Mapping[str, EngineLoad]
    #: When the scrape that produced these figures ended, or when the oldest of a push's
    #: rank figures arrived, on the view's clock (:meth:`LoadView.age` says how long ago).
    scraped_at: float
    #: ``process_start_time_seconds`` (unix seconds): when the pod's server started;
    #: None when its page has none.
    started: float | None = None
    #: Where the figures came from: the pod's /metrics, or its load topic (SGLang).
    source: Literal["scrape", "push"] = "scrape"

    @classmethod
    def of_engines(
        cls,
        pod: str,
        engines: Mapping[str, EngineLoad],
        at: float,
        started: float | None = None,
        source: Literal["scrape", "push"] = "scrape",
    ) -> PodLoad:
        """The pod's load from its engines' (data-parallel ranks') figures, summed once
        here rather than per request."""
        total = totals(engines)
        return cls(
            pod, total.running, total.waiting, total.kv_usage, total.kv_usage_max, engines,
            at, started, source,
        )  # fmt: skip


class Unknown(msgspec.Struct, frozen=True, gc=False):
    """A pod whose load kvindex cannot see now; route to it as a last resort only."""

    pod: str
    reason: str  # "pending" (first scrape not tried yet), "not_scraped" or "stale"
    last_error: str | None
    age_s: float | None  # since the last good scrape or push, None if there was none


@dataclass(slots=True)
class _PodState:
    good: PodLoad | None = None
    last_error: str | None = None
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    silent_in_a_row: int = 0  # scrapes timed out since its last answer


#: The least time a push stays fresh: three of SGLang 0.5.23's one-second heartbeats
#: (``LOAD_PUBLISH_HEARTBEAT_S``, the interval it re-sends an unchanged LoadStat at), so an
#: idle pod's push does not lapse between two of them under a short --load-stale-after.
PUSH_FRESH_S = 3.0

#: Scrapes in a row that time out, of a pod that answered one before, that report it to
#: the outlier detector as a timeout: a frozen engine answers neither requests nor
#: /metrics, and a non-streamed request would otherwise learn it only at the gateway's
#: read timeout (its status line comes with the whole answer). More than one, so a pod
#: slow to render one page under load is not set aside for it.
SILENT_SCRAPES_EJECT = 3


def default_metrics_url(pod: str) -> str:
    return f"http://{pod}/metrics"


class LoadView:
    """Background scraper of every pod's vLLM metrics."""

    def __init__(
        self,
        *,
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        stale_after_s: float | None = None,
        metrics_url: Callable[[str], str] = default_metrics_url,
        max_workers: int = 16,
        clock: Callable[[], float] = time.monotonic,
        pods_source: Callable[[], Iterable[str]] | None = None,
        outliers: OutlierDetector | None = None,
        pushes: PushedLoads | None = None,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be positive")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        # Three missed rounds before a pod counts as unknown: one slow scrape is noise.
        self.stale_after_s = stale_after_s if stale_after_s is not None else 3 * interval_s
        self.push_stale_after_s = max(self.stale_after_s, PUSH_FRESH_S)
        self._metrics_url = metrics_url
        self._clock = clock
        # Told of pods whose scrapes keep timing out (a frozen engine): it sets them aside.
        self._outliers = outliers
        self._pods: tuple[str, ...] = ()
        # Asked before every background round, so pods found later are scraped too.
        self._pods_source = pods_source
        self._states: dict[str, _PodState] = {}
        # The pods' pushed loads (SGLang's load topic), read beside the scrapes.
        self._pushes = pushes
        self._max_workers = max_workers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = None
        self._pool: ThreadPoolExecutor | None = None

    def set_pods(self, pods: Iterable[str]) -> None:
        """The pods to scrape from the next round on; pods no longer listed are forgotten
        at that round (the scraper thread is the only writer of their state)."""
        self._pods = tuple(dict.fromkeys(pods))

    @property
    def pods(self) -> tuple[str, ...]:
        """The pods being scraped."""
        return self._pods

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvindex-load", daemon=True)
        self._thread.start()
        if self._pushes is not None:
            self._pushes.start()

    @property
    def pushes(self) -> PushedLoads | None:
        """The pushed loads read beside the scrapes, if any pod may push."""
        return self._pushes

    def stop(self) -> None:
        if self._pushes is not None:
            self._pushes.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 5)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._client is not None:
            self._client.close()
            self._client = None

    def scrape_once(self) -> None:
        """One round over every pod, concurrently; returns when all have answered or
        timed out. The background thread calls this every ``interval_s``."""
        pods = self._pods
        wanted = set(pods)
        for gone in [p for p in self._states if p not in wanted]:
            del self._states[gone]
        if not pods:
            return
        client = self._http()
        if self._pool is None:
            # Kept for the view's life: starting threads every round (a few times a
            # second) competes for the GIL with the requests this process answers.
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="kvindex-scrape")
        results = list(self._pool.map(lambda pod: (pod, self._fetch(client, pod)), pods))
        for pod, result in results:
            state = self._states.get(pod)
            if state is None:
                state = self._states[pod] = _PodState()
            if isinstance(result, PodLoad):
                state.good = result
                state.last_error = None
                state.silent_in_a_row = 0
            else:
                kind, message = result
                state.failures_by_kind[kind] = state.failures_by_kind.get(kind, 0) + 1
                state.last_error = message
                if kind == "bad_metrics":
                    state.good = None
                if kind == "timeout" and state.good is not None:
                    state.silent_in_a_row += 1
                    if state.silent_in_a_row >= SILENT_SCRAPES_EJECT:
                        state.silent_in_a_row = 0
                        if self._outliers is not None:
                            self._outliers.report(pod, Outcome.TIMEOUT)

    def snapshot(self, pods: Iterable[str]) -> dict[str, PodLoad | Unknown]:
        """Each of ``pods`` as a PodLoad (its fresh push, else its fresh scrape), or
        Unknown when its figures are missing or older than ``stale_after_s`` (a push's:
        ``push_stale_after_s``). No I/O; safe from any thread."""
        now = self._clock()
        stale_after, push_stale_after = self.stale_after_s, self.push_stale_after_s
        out: dict[str, PodLoad | Unknown] = {}
        states = self._states
        pushed = self._pushes.current() if self._pushes is not None else None
        for pod in pods:
            state = states.get(pod)
            good = state.good if state is not None else None
            push = pushed.get(pod) if pushed else None
            if push is not None and now - push.scraped_at <= push_stale_after:
                started = good.started if good is not None else None
                out[pod] = push if push.started == started else replace(push, started=started)
            elif good is not None and now - good.scraped_at <= stale_after:
                out[pod] = good  # the usual case: the scrape's own record
            else:
                out[pod] = self._unknown(pod, state, good, push, now)
        return out

    def age(self, load: PodLoad) -> float:
        """Seconds since the scrape that produced ``load``."""
        return max(0.0, self._clock() - load.scraped_at)

    def _unknown(
        self,
        pod: str,
        state: _PodState | None,
        good: PodLoad | None,
        push: PodLoad | None,
        now: float,
    ) -> Unknown:
        error = state.last_error if state is not None else None
        latest = max((r.scraped_at for r in (good, push) if r is not None), default=None)
        if latest is None:
            # Never tried yet, but about to be: nothing known against it.
            untried = state is None and pod in self._pods
            return Unknown(pod, "pending" if untried else "not_scraped", error, None)
        return Unknown(pod, "stale", error, max(0.0, now - latest))

    def scrape_errors(self) -> dict[str, dict[str, int]]:
        """Failed scrapes per pod, by kind (connect, timeout, http_status, too_large,
        bad_metrics: unreadable, or impossible values)."""
        return {
            pod: dict(state.failures_by_kind)
            for pod, state in list(self._states.items())
            if state.failures_by_kind
        }

    def _run(self) -> None:
        # Rounds are paced on the wall clock whatever the view's clock: a clock that
        # moves only when told (a simulator's) must not stall or spin the scraper.
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if self._pods_source is not None:
                    self.set_pods(self._pods_source())
                self.scrape_once()
            except Exception:  # a bug, not a pod's failure (those are counted): keep going
                log.exception("load scrape round failed")
            elapsed = time.monotonic() - started
            self._stop.wait(max(0.0, self.interval_s - elapsed))

    def _http(self):  # -> httpx.Client
        if self._client is None:
            import httpx

            self._client = httpx.Client(
                timeout=httpx.Timeout(self.timeout_s),
                limits=httpx.Limits(max_connections=self._max_workers * 2),
                follow_redirects=False,
                trust_env=False,
            )
        return self._client

    def _fetch(self, client, pod: str) -> PodLoad | tuple[str, str]:
        import httpx

        url = self._metrics_url(pod)
        deadline = time.monotonic() + self.timeout_s
        try:
            with client.stream("GET", url) as response:
                if response.status_code != 200:
                    return ("http_status", f"GET {url}: HTTP {response.status_code}")
                chunks = []
                size = 0
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > _MAX_BODY_BYTES:
                        return ("too_large", f"GET {url}: body over {_MAX_BODY_BYTES} bytes")
                    if time.monotonic() > deadline:
                        return ("timeout", f"GET {url}: body not read within {self.timeout_s}s")
                    chunks.append(chunk)
            text = b"".join(chunks).decode("utf-8", errors="replace")
        except httpx.TimeoutException:
            return ("timeout", f"GET {url}: no answer within {self.timeout_s}s")
        except httpx.HTTPError as exc:
            return ("connect", f"GET {url}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # never the round's failure: the other pods go on
            log.warning("scraping %s failed: %r", pod, exc)
            return ("connect", f"GET {url}: {type(exc).__name__}")
        try:
            engines = parse_engine_loads(text)
            started = parse_start_time(text)
            scraped = PodLoad.of_engines(pod, engines, self._clock(), started)
        except MetricsError as exc:
            return ("bad_metrics", f"GET {url}: {exc}")
        except Exception as exc:  # a page the checks missed is still this pod's failure
            log.warning("reading %s's metrics page failed: %r", pod, exc)
            return ("bad_metrics", f"GET {url}: unreadable page ({type(exc).__name__})")
        return scraped

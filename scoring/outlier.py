"""Faulty pods stop drawing traffic: passive outlier detection, in the manner of Envoy's.

Whoever sends a routed request to its pod reports how the pod answered (the gateway in
this process, or any gateway over ``POST /route/{id}/done`` with an ``outcome``):

- ``ok``: the pod answered (any status below 500: a 4xx is the client's error);
- ``connect_error``: refused, reset, or closed without a status line;
- ``timeout``: no connection, or no status line, within the gateway's timeouts;
- ``http_5xx``: the pod answered with a 5xx status;
- ``broken``: the answer broke off after it began.

The load scraper reports too: a pod whose ``/metrics`` answered before and then times
out :data:`~kvindex.scoring.load.SILENT_SCRAPES_EJECT` times in a row is a ``timeout``
(a frozen engine, which a non-streamed request would otherwise find only at the
gateway's read timeout). A good scrape clears nothing: only an answer to a request does.

``eject_after`` consecutive failures eject the pod for ``eject_base x times_ejected``
seconds (capped at :data:`MAX_EJECTION_S` or the base, whichever is longer). Once that
ejection time has passed the pod is on probation: one request may go to it as a probe
(another one each ``eject_base`` while no answer came back); a probe that fails ejects it
again at once, for longer; any answer that is not a failure makes it healthy and forgets
its ejections. A pod that never answers, such as one whose packets are dropped, is
therefore tried once per ejection, each time less often.

Never more than ``max_percent`` of a decision's candidates count as ejected (at least
one may be): those ejected until latest (the latest and most repeated failures) stay
out, the others, most likely healthy again, come back first. So a fault that hits every
pod at once (a network partition on the gateway's side) degrades to plain routing
instead of refusing everything. And a decision whose every admissible candidate is
ejected still chooses among them (:mod:`kvindex.scoring.router`).

Why one failure ejects by default: a client's retry after a 5xx carries nothing that
ties it to the failed request, so unless the pod is set aside at once the same prefix
sends the retry straight back to it. nginx's passive checks make the same choice
(``max_fails=1``, ``fail_timeout=10s``); the percentage bound limits the harm of a
failure that was the request's fault, not the pod's.

:func:`judge` and :func:`standing` are the rules, pure; :class:`OutlierDetector` owns
every pod's record and applies them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from enum import StrEnum

import msgspec

#: The longest one ejection lasts, unless ``eject_base`` is longer (Envoy's default).
MAX_EJECTION_S = 300.0


class Outcome(StrEnum):
    """How a pod answered one request (see the module docstring)."""

    OK = "ok"
    CONNECT_ERROR = "connect_error"
    TIMEOUT = "timeout"
    HTTP_5XX = "http_5xx"
    BROKEN = "broken"


class EjectionPolicy(msgspec.Struct, frozen=True):
    eject_after: int = 1  # consecutive failures that eject a pod; 0: never eject
    base_s: float = 10.0  # the first ejection's length; the n-th lasts n times this
    max_percent: float = 50.0  # of a decision's candidates, at most this share ejected


class PodHealth(msgspec.Struct, frozen=True, gc=False):
    """One pod's record. ``ejected_until`` 0: never ejected since it last answered."""

    failures: int = 0  # consecutive, since its last good answer
    times_ejected: int = 0
    ejected_until: float = 0.0
    probe_at: float = 0.0  # on probation: when the next probe may be sent
    last_failure: str = ""

    def ejection_s(self, policy: EjectionPolicy) -> float:
        return min(policy.base_s * self.times_ejected, max(MAX_EJECTION_S, policy.base_s))


HEALTHY = PodHealth()


def judge(health: PodHealth, outcome: Outcome, now: float, policy: EjectionPolicy) -> PodHealth:
    """``health`` after a request reported ``outcome`` at ``now``."""
    if outcome is Outcome.OK:
        if health.ejected_until > now:
            return health  # sent before the ejection: says nothing of the pod now
        return HEALTHY
    if health.ejected_until > now:
        return health  # sent before the ejection: it is out already
    failures = health.failures + 1
    on_probation = health.times_ejected > 0
    if policy.eject_after <= 0 or (failures < policy.eject_after and not on_probation):
        return msgspec.structs.replace(health, failures=failures, last_failure=outcome.value)
    ejected = PodHealth(failures, health.times_ejected + 1, 0.0, 0.0, outcome.value)
    until = now + ejected.ejection_s(policy)
    return msgspec.structs.replace(ejected, ejected_until=until, probe_at=until)


def standing(health: PodHealth, now: float) -> str | None:
    """Why a pod is out of routing at ``now`` (``ejected`` or ``probing``), or None: it
    may be chosen (healthy, or its probe may be sent now)."""
    if health.times_ejected == 0:
        return None
    if health.ejected_until > now:
        return "ejected"
    return None if health.probe_at <= now else "probing"


class OutlierDetector:
    """Every pod's :class:`PodHealth`: written by reports (the gateway's relays, the HTTP
    handlers) and read by routing decisions, under one lock (a gateway over HTTP reports
    from the event loop, the in-process gateway too, but /route's index work runs in
    threads)."""

    def __init__(self, policy: EjectionPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._clock = clock
        self._health: dict[str, PodHealth] = {}
        self._lock = threading.Lock()
        self.ejections = 0  # pods ejected, since start (a counter for /metrics)

    def report(self, pod: str, outcome: Outcome) -> None:
        with self._lock:
            before = self._health.get(pod, HEALTHY)
            after = judge(before, outcome, self._clock(), self.policy)
            if after is HEALTHY:
                self._health.pop(pod, None)
            else:
                self._health[pod] = after
            if after.times_ejected > before.times_ejected:
                self.ejections += 1

    def excluded(self, pods: Sequence[str]) -> dict[str, str]:
        """The candidates among ``pods`` to leave out of a decision, each with its reason
        (for the answer's rows). A pod whose probe may go is granted it here: the next
        decisions see it ``probing`` until its answer is reported or ``base_s`` passes."""
        if not self._health:
            return {}
        now = self._clock()
        with self._lock:
            out: list[tuple[float, str, str]] = []
            for pod in pods:
                health = self._health.get(pod)
                if health is None:
                    continue
                state = standing(health, now)
                if state is None:
                    if health.times_ejected:  # its probe: once per base_s
                        self._health[pod] = msgspec.structs.replace(
                            health, probe_at=now + self.policy.base_s
                        )
                    continue
                why = (
                    f"{state}: {health.failures} failure(s) in a row, last {health.last_failure}"
                    f", ejected {health.times_ejected} time(s)"
                )
                out.append((health.ejected_until, pod, why))
        allowed = max(1, int(len(pods) * self.policy.max_percent / 100))
        out.sort(reverse=True)  # ejected until latest first
        return {pod: why for _, pod, why in out[:allowed]}

    def ejected_now(self) -> int:
        """Pods ejected or on probation now (a gauge)."""
        now = self._clock()
        with self._lock:
            return sum(1 for h in self._health.values() if standing(h, now) is not None)

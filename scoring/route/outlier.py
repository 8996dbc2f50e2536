"""Faulty pods stop drawing traffic: passive outlier detection, in the manner of Envoy's.

Whoever sends a routed request reports how its pod answered (:class:`Outcome`: ok,
connect_error, timeout, http_5xx, broken); the load scraper reports a pod whose
``/metrics`` keeps timing out. ``eject_after`` consecutive
failures eject the pod for ``eject_base x times_ejected`` seconds; then it is on
probation, one probe at a time, and any good answer makes it healthy. One failure
ejects by default because a client's retry carries nothing tying it to the failed
request: the same prefix would send it straight back. At most ``max_percent`` of a
decision's candidates count as ejected, so a fault hitting every pod degrades to plain
routing. :func:`judge` and :func:`standing` are the rules, pure; :class:`OutlierDetector`
owns every pod's record.
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

    OK = "ok"  # any status below 500: a 4xx is the client's error
    CONNECT_ERROR = "connect_error"  # refused, reset, or closed without a status line
    TIMEOUT = "timeout"  # no connection or status line in time; or its scrapes time out
    HTTP_5XX = "http_5xx"
    BROKEN = "broken"  # the answer broke off after it began


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

"""The roster: what discovery has told its target, per pod, and the grace timers.

Pure bookkeeping over :mod:`kvindex.events.discovery.pods`' plans, driven by one thread
(discovery's applier): a pod seen serving is subscribed, one that stops serving is
forgotten after the grace period, one deleted or moved is forgotten at once. The
Kubernetes API side (list, watch, backoff) is :mod:`kvindex.events.discovery.kubernetes`; the
rules are in its module docstring.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.discovery.pods import (
    DiscoveryConfig,
    PodConfigError,
    PodFacts,
    PodPlan,
    plan_pod,
    pod_role,
)
from kvindex.events.ingest.ratelog import RateLimitedLog
from kvindex.events.wire.endpoints import PodEndpoint

log = logging.getLogger("kvindex.events.discovery.kubernetes")  # one logger for all of discovery


class DiscoveryTarget(Protocol):
    """What discovery drives: the subscriber's socket and pod calls."""

    def connect(self, target: PodEndpoint) -> None: ...

    def disconnect(self, endpoint: str) -> bool: ...

    def forget_pod(self, pod: str) -> None: ...


@dataclass(slots=True)
class _Tracked:
    facts: PodFacts
    plan: PodPlan | None
    problem: str | None
    #: What the target currently has for this pod (connected, or known in bind mode).
    active: PodPlan | None = None
    #: Monotonic time the active pod was first seen not serving; None while it serves.
    unready_since: float | None = None


class PodRoster:
    """Applies pod observations to a target; owns the grace timers.

    Not thread-safe for writers: one thread (discovery's applier) calls ``seen``,
    ``gone``, ``listed`` and ``expire``. ``snapshot`` may be called from any thread.
    ``known`` (optional) is kept equal to the active pods, with their replay-endpoint
    annotations: bind mode accepts only those pods' streams.
    """

    def __init__(
        self,
        target: DiscoveryTarget,
        config: DiscoveryConfig,
        clock: Callable[[], float] = time.monotonic,
        known: KnownPods | None = None,
    ) -> None:
        self._target = target
        self._known = known
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], _Tracked] = {}
        self._ratelog = RateLimitedLog(log, 60.0)

    def listed(self, namespace: str, pods: Iterable[PodFacts]) -> None:
        """A full list of ``namespace``: pods not in it are gone.

        The vanished are forgotten before the listed are applied: a pod deleted while
        the watch was down may have passed its IP to a pod in this very list.
        """
        pods = list(pods)
        names = {p.key for p in pods}
        with self._lock:
            vanished = [t for k, t in self._pods.items() if k[0] == namespace and k not in names]
        for tracked in vanished:
            self.gone(tracked.facts)
        for facts in pods:
            self.seen(facts)

    def seen(self, facts: PodFacts) -> None:
        """A pod was added or changed (or listed)."""
        with self._lock:
            tracked = self._pods.get(facts.key)
            plan, problem = self._plan(facts)
            if tracked is None:
                tracked = self._pods[facts.key] = _Tracked(facts, plan, problem)
            else:
                tracked.facts, tracked.plan, tracked.problem = facts, plan, problem
            if facts.finished:
                why = "terminating" if facts.terminating else f"phase {facts.phase}"
                self._drop(tracked, why)
                return
            active = tracked.active
            if (
                active is not None
                and plan is not None
                and (plan.pod_id != active.pod_id or plan.uid != active.uid)
            ):
                self._drop(tracked, f"now {plan.pod_id} (uid {plan.uid})")
            if facts.serving and plan is not None:
                self._activate(tracked, plan)
            elif tracked.active is not None and tracked.unready_since is None:
                tracked.unready_since = self._clock()
                log.info(
                    "discovery: pod %s/%s (%s) is not ready; forgetting it in %gs "
                    "unless it recovers",
                    facts.namespace,
                    facts.name,
                    tracked.active.pod_id,
                    self._config.grace_s,
                )

    def gone(self, facts: PodFacts) -> None:
        """A pod was deleted."""
        with self._lock:
            tracked = self._pods.pop(facts.key, None)
            if tracked is not None:
                self._drop(tracked, "deleted")

    def expire(self) -> float | None:
        """Forget pods not ready for longer than the grace period; return the monotonic
        time the next one is due, or None."""
        grace = self._config.grace_s
        now = self._clock()
        due: float | None = None
        with self._lock:
            for tracked in self._pods.values():
                since = tracked.unready_since
                if since is None:
                    continue
                if now - since >= grace:
                    self._drop(tracked, f"not ready for {grace:g}s")
                else:
                    due = since + grace if due is None else min(due, since + grace)
        return due

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every pod with an id, as ``/index/pods`` shows it under ``discovery``."""
        now = self._clock()
        out: dict[str, dict[str, Any]] = {}
        with self._lock:
            for tracked in self._pods.values():
                plan = tracked.active or tracked.plan
                if plan is None:
                    continue
                facts = tracked.facts
                role, role_problem = pod_role(facts, self._config)
                if tracked.active is None:
                    state = "waiting"
                elif tracked.unready_since is not None:
                    state = "unready"
                else:
                    state = "subscribed"
                entry: dict[str, Any] = {
                    "name": facts.name,
                    "namespace": facts.namespace,
                    "uid": facts.uid,
                    "node": facts.node,
                    "ip": facts.ip,
                    "address": plan.pod_id,
                    "phase": facts.phase,
                    "ready": facts.serving,
                    "state": state,
                    "mode": self._config.mode.value,
                    "model": plan.model,
                    "data_parallel_size": plan.data_parallel_size,
                    "role": role,
                    "endpoints": [e.endpoint for e in plan.endpoints],
                    "replay_endpoints": [e.replay_endpoint for e in plan.endpoints]
                    or ([plan.replay_endpoint] if plan.replay_endpoint else []),
                }
                if tracked.unready_since is not None:
                    entry["unready_for_s"] = round(now - tracked.unready_since, 3)
                if tracked.problem or role_problem:
                    entry["problem"] = tracked.problem or role_problem
                out[plan.pod_id] = entry
        return out

    # -- under the lock --------------------------------------------------------------

    def _plan(self, facts: PodFacts) -> tuple[PodPlan | None, str | None]:
        if not facts.ip:
            return None, None
        try:
            return plan_pod(facts, self._config), None
        except PodConfigError as exc:
            self._ratelog.warning(
                f"bad-pod:{facts.namespace}/{facts.name}",
                "discovery: %s; the pod is ignored until it is fixed",
                exc,
            )
            return None, str(exc)

    def _activate(self, tracked: _Tracked, plan: PodPlan) -> None:
        """Make the target hold ``plan`` for this pod; clears the grace timer."""
        tracked.unready_since = None
        old = tracked.active
        if old == plan:
            return
        for other in self._pods.values():
            if other is not tracked and other.active and other.active.pod_id == plan.pod_id:
                # Only possible with conflicting pod specs (hostNetwork on one node); the
                # newest wins, as a gateway routing to that address would reach it.
                self._drop(other, f"its address now belongs to {tracked.facts.name}")
        wanted = {e.endpoint: e for e in plan.endpoints}
        try:
            for endpoint in old.endpoints if old is not None else ():
                if endpoint.endpoint not in wanted:
                    self._target.disconnect(endpoint.endpoint)
            for endpoint in plan.endpoints:
                self._target.connect(endpoint)
        except Exception as exc:
            # Left inactive: the next event or resync of this pod tries again.
            log.error("discovery: subscribing to pod %s failed: %r", plan.pod_id, exc)
            return
        tracked.active = plan
        if self._known is not None:
            self._known.learn(plan.pod_id, plan.replay_endpoint)
        log.info(
            "discovery: %s pod %s/%s as %s (%d rank(s))",
            "subscribed to" if plan.endpoints else "tracking",
            tracked.facts.namespace,
            tracked.facts.name,
            plan.pod_id,
            plan.data_parallel_size,
        )

    def _drop(self, tracked: _Tracked, why: str) -> None:
        """Forget the pod's active id in the target (sockets and index entries)."""
        tracked.unready_since = None
        active, tracked.active = tracked.active, None
        if active is None:
            return
        if self._known is not None:
            self._known.forget(active.pod_id)  # first: its stragglers are refused from now
        try:
            self._target.forget_pod(active.pod_id)
        except Exception as exc:
            log.error("discovery: forgetting pod %s failed: %r", active.pod_id, exc)
            return
        log.info(
            "discovery: forgot pod %s/%s (%s): %s",
            tracked.facts.namespace,
            tracked.facts.name,
            active.pod_id,
            why,
        )

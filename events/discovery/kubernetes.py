"""Kubernetes pod discovery: keep the subscriber pointed at the vLLM pods that exist now.

Discovery watches the pods that match a label selector in one or more namespaces and
drives a :class:`DiscoveryTarget` (the :class:`~kvindex.events.ingest.subscriber.Subscriber`):
a Running, Ready pod with an IP is subscribed; one that stops being ready keeps its
subscription for ``grace_s`` (a readiness flap must not wipe a warm cache); a deleted,
terminating or finished pod is forgotten at once; one whose address changes is
forgotten under the old id and subscribed under the new. What a pod object means is
worked out by :mod:`kvindex.events.discovery.pods`;
:class:`~kvindex.events.discovery.roster.PodRoster`
keeps the target in line. The ``kubernetes`` package is the optional ``k8s`` extra,
imported only when discovery starts.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvindex.events.discovery.known_pods import KnownPods
from kvindex.events.discovery.pods import (
    DiscoveryConfig,
    PodFacts,
)
from kvindex.events.discovery.roster import DiscoveryTarget, PodRoster

log = logging.getLogger(__name__)

#: A watch connection may stay silent for its whole server-side timeout; the client's
#: read timeout is that plus this margin, so a connection the API server dropped without
#: a FIN is noticed instead of hanging the watcher forever.
_READ_MARGIN_S = 30.0


class DiscoveryError(RuntimeError):
    """Discovery cannot start (the ``kubernetes`` package or its configuration is missing)."""


# -- reading the API ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Listed:
    namespace: str
    pods: tuple[PodFacts, ...]


@dataclass(frozen=True, slots=True)
class _Seen:
    facts: PodFacts


@dataclass(frozen=True, slots=True)
class _Gone:
    facts: PodFacts


_Observation = _Listed | _Seen | _Gone


class _Counters:
    """Plain counters the watchers bump and tests and the service read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class _NamespaceWatcher:
    """List + watch of one namespace's pods, on its own thread, forever until stopped.

    List (the full truth, with a ``resourceVersion``), then watch from that version. A
    watch that expires (``410 Gone``: etcd compacted past our version) is answered with
    a fresh list; an unreachable API server with a relist after exponential backoff,
    because events may have been missed meanwhile; and every ``resync_s`` the list is
    redone anyway, so a missed event cannot leave a stale subscription for long. The
    watchers only read: one thread of :class:`KubernetesDiscovery` turns what they saw
    into calls on the target and runs the grace timers, so those calls are never
    concurrent or reordered.
    """

    def __init__(
        self,
        core: Any,
        namespace: str,
        config: DiscoveryConfig,
        emit: Callable[[_Observation], None],
        stopping: threading.Event,
        counters: _Counters,
    ) -> None:
        self._core = core
        self.namespace = namespace
        self._config = config
        self._emit = emit
        self._stopping = stopping
        self._counters = counters
        self._watch: Any = None
        self._lock = threading.Lock()
        self.listed_once = False
        self.last_error: str | None = None
        self._failing = False
        self.thread = threading.Thread(
            target=self._run, name=f"kvindex-discovery-{namespace}", daemon=True
        )

    def interrupt(self) -> None:
        """Unblock a watch in progress (its socket is shut down); safe from any thread."""
        with self._lock:
            watch = self._watch
        if watch is not None:
            watch.stop()

    def _run(self) -> None:
        config = self._config
        backoff = config.backoff_initial_s
        version: str | None = None
        resync_at = 0.0
        expired_in_a_row = 0
        while not self._stopping.is_set():
            try:
                if version is None or time.monotonic() >= resync_at:
                    version = self._list()
                    resync_at = time.monotonic() + config.resync_s
                version = self._follow(version, resync_at)
                backoff = config.backoff_initial_s
                expired_in_a_row = 0
            except Exception as exc:
                if self._stopping.is_set():
                    break
                # Whatever went wrong, the version we hold may be useless now: relist.
                version = None
                if getattr(exc, "status", None) == 410:
                    # Watch expired (etcd compacted past our version): an ordinary event
                    # in a long-lived watch, answered by a new list at once - unless even
                    # a fresh list's version expires, which only backing off can help.
                    self._counters.add("expired")
                    expired_in_a_row += 1
                    log.info("discovery: watch of %s expired (410); relisting", self.namespace)
                    if expired_in_a_row > 1:
                        backoff = self._pause(backoff)
                    continue
                # Unreachable or restarting API server, or refused: events may have been
                # missed while it was away. Back off, then relist.
                self._failed(exc)
                backoff = self._pause(backoff)

    def _list(self) -> str | None:
        answer = self._core.list_namespaced_pod(
            self.namespace,
            label_selector=self._config.label_selector,
            _request_timeout=self._config.request_timeout_s,
        )
        pods = tuple(PodFacts.from_pod(p) for p in answer.items or [])
        self._emit(_Listed(self.namespace, pods))
        self._counters.add("lists")
        self.listed_once = True
        if self._failing:
            log.info("discovery: the API server answers again for %s", self.namespace)
        self._failing = False
        self.last_error = None
        return answer.metadata.resource_version if answer.metadata else None

    def _follow(self, version: str | None, resync_at: float) -> str | None:
        """Watch from ``version`` until the resync is due; return the last version seen."""
        from kubernetes import watch as k8s_watch

        timeout = max(1, math.ceil(resync_at - time.monotonic()))
        watch = k8s_watch.Watch()
        with self._lock:
            self._watch = watch
        if self._stopping.is_set():
            return version
        self._counters.add("watches")
        kwargs: dict[str, Any] = {
            "label_selector": self._config.label_selector,
            "timeout_seconds": timeout,  # also turns off the client's own 410 retry
            "allow_watch_bookmarks": True,
            "_request_timeout": (self._config.request_timeout_s, timeout + _READ_MARGIN_S),
        }
        if version:
            kwargs["resource_version"] = version
        try:
            for event in watch.stream(self._core.list_namespaced_pod, self.namespace, **kwargs):
                if self._stopping.is_set():
                    break
                kind = event.get("type")
                if kind not in ("ADDED", "MODIFIED", "DELETED"):
                    continue  # BOOKMARK: only moves the version (the client tracks it)
                facts = PodFacts.from_pod(event["object"])
                self._emit(_Gone(facts) if kind == "DELETED" else _Seen(facts))
                self._counters.add("events")
        finally:
            with self._lock:
                self._watch = None
        return watch.resource_version or version

    def _failed(self, exc: Exception) -> None:
        self._counters.add("errors")
        status = getattr(exc, "status", None)
        if status in (401, 403):
            text = (
                f"the API server refused to list/watch pods in namespace {self.namespace} "
                f"(HTTP {status}): kvindex's ServiceAccount needs a Role with get, list and "
                f"watch on pods in that namespace, bound by a RoleBinding "
                f"(deploy/base/rbac.yaml)"
            )
        else:
            text = f"cannot list/watch pods in namespace {self.namespace}: {exc!r}"
        self.last_error = text
        if not self._failing:
            log.warning("discovery: %s; retrying with backoff", text)
        self._failing = True

    def _pause(self, backoff: float) -> float:
        # Jitter: many kvindex replicas must not hammer a recovering API server in step.
        self._stopping.wait(backoff * random.uniform(0.5, 1.0))
        return min(self._config.backoff_max_s, backoff * 2)


# -- the public face ---------------------------------------------------------------------


def _default_api_client() -> Any:
    """In a pod: the ServiceAccount's token; elsewhere: ~/.kube/config (or $KUBECONFIG)."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            # $KUBECONFIG as it is now: the client library reads it once, at import.
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
        except Exception as exc:
            raise DiscoveryError(
                "Kubernetes discovery found neither an in-cluster ServiceAccount nor a "
                f"kubeconfig: {exc}"
            ) from None
    return client.ApiClient()


class KubernetesDiscovery:
    """Follows labelled vLLM pods and keeps ``target`` subscribed to the ready ones.

    ``api_client`` is a ``kubernetes.client.ApiClient``; without one, the in-cluster
    configuration (or the local kubeconfig) is loaded at :meth:`start`. ``known`` is
    kept equal to the subscribed pods (see :class:`PodRoster`).
    """

    def __init__(
        self,
        target: DiscoveryTarget,
        config: DiscoveryConfig | None = None,
        *,
        api_client: Any = None,
        clock: Callable[[], float] = time.monotonic,
        known: KnownPods | None = None,
        on_synced: Callable[[frozenset[str]], None] | None = None,
    ) -> None:
        self._config = config if config is not None else DiscoveryConfig()
        self._api_client = api_client
        self._on_synced = on_synced
        self._lists_applied: set[str] = set()
        self._roster = PodRoster(target, self._config, clock, known)
        self._clock = clock
        self._queue: queue.Queue[_Observation | None] = queue.Queue()
        self._stopping = threading.Event()
        self._counters = _Counters()
        self._watchers: list[_NamespaceWatcher] = []
        self._applier: threading.Thread | None = None
        self._started = False

    @property
    def config(self) -> DiscoveryConfig:
        return self._config

    def start(self) -> None:
        """Start watching; raise DiscoveryError when the client cannot be set up."""
        if self._started:
            raise RuntimeError("discovery already started")
        try:
            from kubernetes import client
        except ImportError as exc:
            raise DiscoveryError(
                f"Kubernetes discovery needs the k8s extra: pip install 'kvindex[k8s]' ({exc})"
            ) from None
        api_client = self._api_client or _default_api_client()
        core = client.CoreV1Api(api_client)
        self._started = True
        self._applier = threading.Thread(
            target=self._apply_loop, name="kvindex-discovery-apply", daemon=True
        )
        self._applier.start()
        for namespace in dict.fromkeys(self._config.namespaces):
            watcher = _NamespaceWatcher(
                core, namespace, self._config, self._queue.put, self._stopping, self._counters
            )
            self._watchers.append(watcher)
            watcher.thread.start()
        log.info(
            "discovery: watching pods %r in %s (%s mode, grace %gs)",
            self._config.label_selector,
            ", ".join(self._config.namespaces),
            self._config.mode.value,
            self._config.grace_s,
        )

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop every thread within about ``timeout_s``; subscriptions stay as they are."""
        if not self._started or self._stopping.is_set():
            return
        self._stopping.set()
        self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for watcher in self._watchers:
            # A watch that had not yet reached the server when interrupt() first ran
            # does not see it: interrupt again until the thread ends.
            while watcher.thread.is_alive() and time.monotonic() < deadline:
                watcher.interrupt()
                watcher.thread.join(0.05)
            if watcher.thread.is_alive():
                log.warning("discovery: watcher of %s did not stop in time", watcher.thread.name)
        if self._applier is not None:
            self._applier.join(max(0.0, deadline - time.monotonic()))

    def discovered(self) -> dict[str, dict[str, Any]]:
        """Every discovered pod with an IP, by pod id: name, namespace, uid, node, ip,
        address, phase, ready, state (subscribed | unready | waiting), mode, model,
        data_parallel_size, endpoints, replay_endpoints, unready_for_s, problem."""
        return self._roster.snapshot()

    def stats(self) -> dict[str, int]:
        """Counters since start: lists, watches, events, expired (410s), errors, applied."""
        return self._counters.snapshot()

    def problems(self) -> list[str]:
        """Why discovery is not yet useful: namespaces never listed, with the last error.

        Once a namespace has been listed, a later outage is not a problem here (the last
        known pods stay subscribed and a relist follows when the API server is back).
        """
        return [
            f"pod discovery has not listed namespace {w.namespace} yet"
            + (f": {w.last_error}" if w.last_error else "")
            for w in self._watchers
            if not w.listed_once
        ]

    def _listed(self, namespace: str) -> None:
        """Once every namespace's first list is applied, tell ``on_synced`` which pods
        exist: only then does a pod's absence mean it is gone (a snapshot restored
        before discovery holds pods deleted while kvindex was down)."""
        if self._on_synced is None:
            return
        self._lists_applied.add(namespace)
        if self._lists_applied.issuperset(self._config.namespaces):
            on_synced, self._on_synced = self._on_synced, None
            on_synced(frozenset(self.discovered()))

    def _apply_loop(self) -> None:
        """The only caller of the roster's writers: observations in order, grace timers."""
        due: float | None = None
        while not self._stopping.is_set():
            timeout = None if due is None else max(0.0, due - self._clock())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None  # a grace period may have ended
            try:
                if isinstance(item, _Listed):
                    self._roster.listed(item.namespace, item.pods)
                    self._listed(item.namespace)
                elif isinstance(item, _Seen):
                    self._roster.seen(item.facts)
                elif isinstance(item, _Gone):
                    self._roster.gone(item.facts)
                if item is not None:
                    self._counters.add("applied")
                due = self._roster.expire()
            except Exception:
                log.exception("discovery: applying a pod change failed")

"""The simulated pods of one run, and their event streams.

Every pod publishes through a real :class:`~kvindex.events.wire.publisher.EnginePublisher` (a PUB
socket that connects to kvindex's bound SUB socket, topic ``kv@<pod>@<model>``, one
seq per batch, a replay ROUTER on a free loopback port) when the run goes through
kvindex. Runs whose policies never ask the index drop the events instead of publishing
them: the pods, their pools and their events are the same code either way; only the
socket is skipped, which keeps those runs fast.

A pod's step emits one batch (everything its pool recorded while scheduling the step),
which leaves the pod when the step ends and reaches the index after the run's event
lag (:mod:`bench.sim.lag`): :meth:`Cluster.emit` queues it, :meth:`Cluster.release`
publishes what is due, :meth:`Cluster.sync` waits until kvindex applied it (all of it,
or what a decision on given block keys depends on: :mod:`bench.sim.streams`).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from bench.sim.costs import CostModel
from bench.sim.lag import LagModel
from bench.sim.pod import SimPod
from bench.sim.pool import BlockPool, Event
from bench.sim.service import IndexClient, ServiceError
from bench.sim.streams import IndexSync
from kvindex.events.wire.identity import make_topic
from kvindex.events.wire.publisher import EnginePublisher


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The pods of a run. Pod ids are ``host:first_port``, ``host:first_port+1``, ...;
    each pod publishes its events from ``host`` (the ZMQ connection's source address), as
    an engine sends from its pod's IP."""

    pods: int = 4
    blocks_per_pod: int = 16_384
    block_size: int = 16
    costs: CostModel = field(default_factory=CostModel)
    host: str = "127.0.0.1"
    first_port: int = 8001

    def pod_ids(self) -> list[str]:
        return [f"{self.host}:{self.first_port + i}" for i in range(self.pods)]

    def for_run(self, n: int) -> ClusterSpec:
        """The spec for run ``n`` of many sharing one kvindex: its own loopback host
        (127.1.0.1, 127.1.0.2, ...) and ports.

        Pod ids must differ between runs (a shared index still holds the last run's
        pods), and so must their host: in bind mode kvindex lets one sender address
        open at most ``max_streams_per_sender`` (64) streams, and a stream outlives its
        engine for ``stream_idle_s`` (an hour). Pods of every run on 127.0.0.1 filled
        that cap after 16 runs of 4 pods; from then on kvindex dropped every event of
        the new pods and each decision waited out the sync deadline.

        The second octet follows the process id, so two simulations on one machine (two
        test workers) never bind the same pod address.
        """
        if not 0 <= n < 250 * 256:
            raise ValueError(f"run number {n} out of range")
        host = f"127.{1 + os.getpid() % 250}.{n // 250}.{n % 250 + 1}"
        return replace(self, host=host, first_port=10_000 + (n % 2_000) * 16)


class Cluster:
    """Pods plus, when ``zmq_endpoint`` is given, one publisher per pod connected to it."""

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        model: str = "sim-model",
        zmq_endpoint: str | None = None,
        vllm_version: str = "0.33",
        lag: LagModel | None = None,
        seed: int = 0,
        subscribe_timeout_s: float = 10.0,
    ) -> None:
        self.spec = spec
        self.model = model
        self.pods = [
            SimPod(pod_id, i, BlockPool(spec.blocks_per_pod, spec.block_size), spec.costs)
            for i, pod_id in enumerate(spec.pod_ids())
        ]
        self._lag = (lag or LagModel(0.0)).sampler(seed)
        self.publishers: list[EnginePublisher] = []
        self._pending: list[deque[tuple[float, list[Event]]]] = [deque() for _ in self.pods]
        self.batches = 0
        self.events = 0
        self.restarts = 0
        self.resets = 0
        self.resets_refused = 0
        if zmq_endpoint is not None:
            # ZMQ's "tcp://source;destination": the pod's own host is the sender address.
            source = f"tcp://{spec.host}:0;{zmq_endpoint.removeprefix('tcp://')}"
            try:
                for pod in self.pods:
                    self.publishers.append(
                        EnginePublisher(
                            source,
                            topic=make_topic(pod.pod_id, model),
                            vllm_version=vllm_version,
                            replay_endpoint=f"tcp://{spec.host}:0",
                            bind=False,
                        )
                    )
                # A PUB drops what it sends before the subscription arrives (slow joiner).
                for publisher in self.publishers:
                    if not publisher.wait_for_subscribers(1, subscribe_timeout_s):
                        raise ServiceError(f"kvindex never subscribed to {publisher.topic}")
            except BaseException:
                self.close()
                raise
        self.streams = IndexSync(self.ids(), self.publishers)

    def emit(self, index: int, now: float) -> None:
        """Pod ``index``'s step ended at ``now``: its pending events become one batch,
        due at the index after the lag (and after the pod's earlier batches)."""
        pool = self.pods[index].pool
        if not pool.events:
            return
        events = pool.drain_events()
        self.events += len(events)
        self.batches += 1
        if not self.publishers:
            return
        queue = self._pending[index]
        due = now + self._lag.delay_s()
        if queue and queue[-1][0] > due:
            due = queue[-1][0]
        queue.append((due, events))

    def release(self, now: float) -> None:
        """Publish every batch due by ``now``."""
        for pod, queue in zip(self.pods, self._pending, strict=True):
            while queue and queue[0][0] <= now:
                _, events = queue.popleft()
                self.streams.publish(pod.index, events)

    def sync(
        self, client: IndexClient, timeout_s: float, keys: Sequence[int] | None = None
    ) -> bool:
        """Wait until the index applied every batch published so far, or (``keys``) every
        one that touches those block keys (:mod:`bench.sim.streams`); no-op if it did."""
        if keys is None:
            return self.streams.wait_all(client, timeout_s)
        return self.streams.wait_for(client, keys, timeout_s)

    def restart_pod(self, index: int, now: float, client: IndexClient | None = None) -> list:
        """The pod's engine restarts at ``now``: cache lost, seq back to 0, batches in
        flight lost. Returns the requests that were on it. ``client`` (runs that
        publish) tells the restart count kvindex has before it (:mod:`bench.sim.streams`)."""
        pod = self.pods[index]
        lost = pod.restart(now)
        self.restarts += 1
        self._pending[index].clear()
        if self.publishers:
            self.publishers[index].restart()
            restarts_seen = client.position(pod.pod_id)[1] if client is not None else 0
            self.streams.restarted(index, restarts_seen)
        return lost

    def reset_pod(self, index: int, now: float = 0.0) -> bool:
        """vLLM's reset_prefix_cache on one pod; refused (False) while blocks are in use."""
        pool = self.pods[index].pool
        if pool.used_blocks:
            self.resets_refused += 1
            return False
        pool.reset()
        self.resets += 1
        self.emit(index, now)
        return True

    def ids(self) -> Sequence[str]:
        return [p.pod_id for p in self.pods]

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close()
        self.publishers = []

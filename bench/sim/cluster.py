"""The simulated pods of one run, and their event streams.

Every pod publishes through a real :class:`~kvindex.events.EnginePublisher` (a PUB
socket that connects to kvindex's bound SUB socket, topic ``kv@<pod>@<model>``, one
seq per batch, a replay ROUTER on a free loopback port) when the run goes through
kvindex. Runs whose policy never asks the index drop the events instead of publishing
them: the pods, their pools and their events are the same code either way; only the
socket is skipped, which keeps those runs fast.

A *step* is one instant of virtual time: everything a pod's pool emitted at that time
is published as one batch, as vLLM publishes once per scheduler step that produced
events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.sim.costs import CostModel
from bench.sim.pod import SimPod
from bench.sim.pool import BlockPool
from bench.sim.service import IndexClient, ServiceError
from kvindex.events.identity import make_topic
from kvindex.events.publisher import EnginePublisher


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The pods of a run. Pod ids are ``host:first_port``, ``host:first_port+1``, ..."""

    pods: int = 4
    blocks_per_pod: int = 16_384
    block_size: int = 16
    costs: CostModel = field(default_factory=CostModel)
    host: str = "127.0.0.1"
    first_port: int = 8001

    def pod_ids(self) -> list[str]:
        return [f"{self.host}:{self.first_port + i}" for i in range(self.pods)]


class Cluster:
    """Pods plus, when ``zmq_endpoint`` is given, one publisher per pod connected to it."""

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        model: str = "sim-model",
        zmq_endpoint: str | None = None,
        vllm_version: str = "0.33",
        subscribe_timeout_s: float = 10.0,
    ) -> None:
        self.spec = spec
        self.model = model
        self.pods = [
            SimPod(pod_id, i, BlockPool(spec.blocks_per_pod, spec.block_size), spec.costs)
            for i, pod_id in enumerate(spec.pod_ids())
        ]
        self.publishers: list[EnginePublisher] = []
        self._published: dict[str, int] = {}  # pod id -> last seq sent
        self._synced: dict[str, int] = {}  # pod id -> last seq the index was seen to apply
        self.batches = 0
        self.events = 0
        self.syncs = 0
        if zmq_endpoint is not None:
            try:
                for pod in self.pods:
                    self.publishers.append(
                        EnginePublisher(
                            zmq_endpoint,
                            topic=make_topic(pod.pod_id, model),
                            vllm_version=vllm_version,
                            replay_endpoint="tcp://127.0.0.1:0",
                        )
                    )
                # A PUB drops what it sends before the subscription arrives (slow joiner).
                for publisher in self.publishers:
                    if not publisher.wait_for_subscribers(1, subscribe_timeout_s):
                        raise ServiceError(f"kvindex never subscribed to {publisher.topic}")
            except BaseException:
                self.close()
                raise

    def flush(self) -> None:
        """End the step: each pod's pending events become one batch."""
        publishers = self.publishers
        for pod in self.pods:
            if not pod.pool.events:
                continue
            events = pod.pool.drain_events()
            self.events += len(events)
            self.batches += 1
            if publishers:
                self._published[pod.pod_id] = publishers[pod.index].publish(events)

    def sync(self, client: IndexClient, timeout_s: float) -> bool:
        """Wait until the index applied every batch published so far (no-op if it did)."""
        behind = {
            pod: seq for pod, seq in self._published.items() if self._synced.get(pod, -1) < seq
        }
        if not behind:
            return True
        self.syncs += 1
        if not client.wait_applied(behind, timeout_s):
            return False
        self._synced.update(behind)
        return True

    def reset_pod(self, index: int) -> None:
        """vLLM's reset_prefix_cache on one idle pod (publishes AllBlocksCleared)."""
        self.pods[index].pool.reset()
        self.flush()

    def ids(self) -> Sequence[str]:
        return [p.pod_id for p in self.pods]

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close()
        self.publishers = []

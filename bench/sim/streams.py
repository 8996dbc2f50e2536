"""Which published event batches kvindex has applied, and waiting for the ones a
decision depends on.

Before a kvindex policy decides at virtual time t, the index must hold every batch
released by t (:mod:`bench.sim.lag`). Waiting for *all* of them made a run through
kvindex mostly wait: nearly every decision found some pod's newest batch unapplied
(~60 ms per wait on the shared two cores). Yet a decision on a prompt only reads what
the index holds for that prompt's blocks: a batch that neither stores nor removes any
of them (nor clears the pod) leaves the answer as it was. :class:`IndexSync` therefore
keeps, per pod, the batches published but not yet seen applied, with the keys each one
touches, and :meth:`IndexSync.wait_for` waits only for the batches that touch the
prompt's keys - so the answer is exactly what a fully synced index gives, and the
agreement check still ends each run with a full :meth:`IndexSync.wait_all`.

A pod's seq numbers only grow within one engine life, so "applied >= the batch's seq"
says the batch is in. After a restart the seq starts again at 0 while kvindex still
reports the old one until it applies the new first batch - and the old one may equal
the new (old seq 0, new seq 0). So a restarted pod is waited for in full until kvindex
shows both the restart (its restart count) and the new life's last seq.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from bench.sim.pool import Event
from bench.sim.service import IndexClient, ServiceError
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import AllBlocksCleared, BlockRemoved, BlockStored

#: Decisions between two refreshes of every pod's applied seq (forgets applied batches).
REFRESH_EVERY = 64


class IndexSync:
    """Per pod: published seqs, the keys of batches not yet seen applied, waits."""

    def __init__(self, pod_ids: Sequence[str], publishers: Sequence[EnginePublisher]) -> None:
        self.pod_ids = list(pod_ids)
        self.publishers = list(publishers)
        self._index = {pod: i for i, pod in enumerate(self.pod_ids)}
        self.published: dict[str, int] = {}  # pod -> last seq sent
        self._applied: dict[str, int] = {}  # pod -> last seq seen applied (this engine life)
        self._open: list[deque[tuple[int, list[int] | None]]] = [deque() for _ in pod_ids]
        self._keys: list[dict[int, int]] = [{} for _ in pod_ids]  # key -> newest open seq
        self._clear: list[int] = [-1] * len(pod_ids)  # newest open seq with a clear
        self._restarted: dict[str, int] = {}  # pod -> restart count kvindex must reach
        self._decisions = 0
        self.syncs = 0  # waits that found the index behind on a batch that mattered
        self.skipped = 0  # decisions that needed no wait although batches were open
        self.nudges = 0
        self.sync_timeouts = 0

    # -- what the pods send ---------------------------------------------------------

    def publish(self, i: int, events: list[Event]) -> None:
        pod = self.pod_ids[i]
        seq = self.publishers[i].publish(events)
        self.published[pod] = seq
        keys: list[int] | None = []
        for event in events:
            if isinstance(event, AllBlocksCleared):
                keys = None
                break
            if isinstance(event, (BlockStored, BlockRemoved)):
                keys.extend(event.block_hashes)  # type: ignore[union-attr]
        self._open[i].append((seq, keys))
        if keys is None:
            self._clear[i] = seq
        else:
            touched = self._keys[i]
            for key in keys:
                touched[key] = seq

    def restarted(self, i: int, restarts_seen: int) -> None:
        """Pod ``i``'s engine restarted: its seq starts again; wait for it in full.

        ``restarts_seen`` is kvindex's restart count for the pod now. kvindex counts a
        restart when a new life's batch follows a life it heard from, so the count to
        wait for grows by one per life that published; a pod restarting again before
        kvindex confirmed the last restart keeps the count it was already owed."""
        pod = self.pod_ids[i]
        published = 1 if pod in self.published else 0
        self._restarted[pod] = self._restarted.get(pod, restarts_seen) + published
        self._open[i].clear()
        self._keys[i].clear()
        self._clear[i] = -1
        self._applied.pop(pod, None)
        self.published.pop(pod, None)  # nothing to wait for until its first new batch

    # -- waiting --------------------------------------------------------------------

    def wait_for(self, client: IndexClient, keys: Iterable[int], timeout_s: float) -> bool:
        """Wait until kvindex applied every published batch that touches ``keys`` (or
        clears a pod), and restarted pods in full; False on timeout."""
        self._decisions += 1
        if self._decisions % REFRESH_EVERY == 0:
            self._refresh(client)
        wanted = list(keys)
        targets: dict[str, int] = {}
        for i, pod in enumerate(self.pod_ids):
            if pod in self._restarted and pod in self.published:
                targets[pod] = self.published[pod]
                continue
            if not self._open[i]:
                continue
            touched = self._keys[i]
            seq = self._clear[i]
            for key in wanted:
                s = touched.get(key, -1)
                if s > seq:
                    seq = s
            if seq > self._applied.get(pod, -1):
                targets[pod] = seq
        if not targets:
            if any(self._open):
                self.skipped += 1
            return True
        return self._wait(client, targets, timeout_s)

    def wait_all(self, client: IndexClient, timeout_s: float) -> bool:
        """Wait until kvindex applied every batch published so far."""
        targets = {
            pod: seq
            for pod, seq in self.published.items()
            if pod in self._restarted or self._applied.get(pod, -1) < seq
        }
        if not targets:
            return True
        return self._wait(client, targets, timeout_s)

    def _wait(
        self, client: IndexClient, targets: dict[str, int], timeout_s: float, nudge_s: float = 0.5
    ) -> bool:
        """A PUB socket may drop a batch (a full queue under CPU pressure); kvindex sees
        the gap only when the pod's next batch arrives, and a simulated pod between steps
        sends none. So after ``nudge_s`` the pods still behind publish an empty batch, as
        a busy engine soon would: kvindex then replays the missing seq."""
        self.syncs += 1
        restarted = {pod: self._restarted[pod] for pod in targets if pod in self._restarted}
        waited = 0.0
        behind = dict(targets)
        while True:
            applied = client.wait_applied(
                behind, min(nudge_s, timeout_s - waited), restarted=restarted, seen=self._seen
            )
            if applied:
                break
            waited += nudge_s
            if waited >= timeout_s:
                self.sync_timeouts += 1
                client.sync_timeouts += 1
                self._check_streams(client, behind)
                return False
            for pod in list(behind):
                if self._applied.get(pod, -1) < behind[pod] or pod in restarted:
                    self.nudges += 1
                    i = self._index[pod]
                    seq = self.publishers[i].publish([])
                    self.published[pod] = seq
                    self._open[i].append((seq, []))
                    if pod in restarted:
                        behind[pod] = seq
        for pod in restarted:
            del self._restarted[pod]
            self._seen(pod, behind[pod])
        return True

    def _seen(self, pod: str, seq: int) -> None:
        """kvindex reported ``seq`` applied for ``pod``: forget the batches up to it."""
        if pod in self._restarted or seq <= self._applied.get(pod, -1):
            return
        self._applied[pod] = seq
        i = self._index[pod]
        queue, touched = self._open[i], self._keys[i]
        while queue and queue[0][0] <= seq:
            done, keys = queue.popleft()
            for key in keys or ():
                if touched.get(key) == done:
                    del touched[key]
        if self._clear[i] <= seq:
            self._clear[i] = -1

    def _refresh(self, client: IndexClient) -> None:
        for i, pod in enumerate(self.pod_ids):
            if self._open[i] and pod not in self._restarted:
                self._seen(pod, client.applied_seq(pod))

    def _check_streams(self, client: IndexClient, behind: dict[str, int]) -> None:
        """After a wait timed out: a pod kvindex has no stream for at all will never
        catch up (its events are skipped at the door), so fail now, saying why, rather
        than let every later decision wait out the deadline."""
        unknown = sorted(pod for pod in behind if client.applied_seq(pod) < 0)
        if unknown:
            raise ServiceError(
                f"kvindex has no stream for pod(s) {', '.join(unknown)} after "
                f"{self.syncs} syncs; its skipped events by reason: {client.event_errors()}"
            )

"""The pods Kubernetes discovery knows, as the bind-mode receiver needs them.

In bind mode every engine connects to kvindex and names itself in its topic; discovery
is the independent witness of which pods exist. It records each pod it subscribes to (in
either discovery mode) here, with the replay endpoint its ``kvindex.io/replay-endpoint``
annotation gives, and removes it when it forgets the pod. The receiver reads this to
accept only streams of discovered pods (:mod:`kvindex.events.ingest.admission`) and to find a
stream's replay endpoint (:mod:`kvindex.events.ingest.replay_endpoints`).

Written by discovery's single applier thread, read by the receiver thread: each call is
one dict operation, atomic under the GIL, so no lock is needed.
"""

from __future__ import annotations


class KnownPods:
    """Pod id -> its rank-0 replay endpoint from discovery (None: no annotation)."""

    def __init__(self) -> None:
        self._pods: dict[str, str | None] = {}

    def learn(self, pod: str, replay_endpoint: str | None = None) -> None:
        """``pod`` exists (it is a normalised pod id, ``host:port``)."""
        self._pods[pod] = replay_endpoint

    def forget(self, pod: str) -> None:
        self._pods.pop(pod, None)

    def __contains__(self, pod: object) -> bool:
        return pod in self._pods

    def __len__(self) -> int:
        return len(self._pods)

    def replay_endpoint(self, pod: str) -> str | None:
        """The replay endpoint discovery learned for ``pod`` (rank 0), or None."""
        return self._pods.get(pod)

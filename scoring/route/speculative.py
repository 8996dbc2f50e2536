"""Speculative entries: blocks a pod will hold because ``/route`` just sent it the prompt.

Between a decision and the chosen pod's ``BlockStored`` events, a burst of same-prefix
requests would see no pod holding the prefix and scatter; so a routed prompt's blocks
count as present on the chosen member for a short TTL (llm-d's speculative indexing).
They are kept apart from the index backends so that a confirmed count never includes a
guess. Per (model, member) a key maps to its latest deadline; along a chain, the live
keys past the confirmed prefix form a run, found by binary search. Confirmation is
checked at query time: keys the confirmed prefix covers leave. Each entry's outcome
(confirmed, superseded, expired, evicted) is counted when it ends; at most
``max_blocks`` keys are held, oldest evicted first.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from kvindex.scoring.scorer import PodScore, ScoreResult

OUTCOMES = ("added", "confirmed", "superseded", "expired", "evicted")


@dataclass(frozen=True, slots=True)
class _Entry:
    deadline: float
    model: str
    member: str
    keys: tuple[int, ...]


class SpeculativeIndex:
    """Routed-but-unconfirmed prompt blocks per member, each for ``ttl_s`` seconds
    (0: switched off, nothing is added)."""

    def __init__(
        self,
        ttl_s: float = 2.0,
        max_blocks: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 0:
            raise ValueError("ttl_s must not be negative")
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        self._lock = threading.Lock()
        # model -> member -> key -> deadline
        self._live: dict[str, dict[str, dict[int, float]]] = {}
        self._fifo: deque[_Entry] = deque()  # one TTL: deadline order is insertion order
        self._blocks = 0  # keys over the entries in the FIFO
        self.counts = dict.fromkeys(OUTCOMES, 0)
        #: Called with each new entry's deadline (``clock`` time): serving workers in
        #: other processes must not answer /score without these (api/serve/worker_pool.py).
        self.on_add: Callable[[float], None] | None = None

    def add(self, model: str, member: str, keys: Sequence[int], confirmed: int = 0) -> None:
        """``member`` will hold the chain ``keys`` (block 0 first) for ``ttl_s``; its
        first ``confirmed`` blocks are in the index already and are not entered (a hot
        prefix routed again costs nothing here)."""
        if len(keys) <= confirmed or not self.ttl_s:
            return
        keys = tuple(keys[confirmed : confirmed + self.max_blocks])
        with self._lock:
            now = self._clock()
            self._expire(now)
            while self._fifo and self._blocks + len(keys) > self.max_blocks:
                self._finish(self._fifo.popleft(), "evicted")
            deadline = now + self.ttl_s
            live = self._live.setdefault(model, {}).setdefault(member, {})
            for key in keys:
                live[key] = deadline
            self._fifo.append(_Entry(deadline, model, member, keys))
            self._blocks += len(keys)
            self.counts["added"] += 1
        if self.on_add is not None:
            self.on_add(deadline)

    def prefixes(
        self, model: str, keys: Sequence[int], confirmed: Mapping[str, int]
    ) -> dict[str, int]:
        """Members whose speculative prefix of ``keys`` goes past their confirmed one
        (``confirmed[member]``, 0 when absent), with the blocks past it. Speculative keys
        the confirmed prefix covers are dropped as confirmed."""
        if not self._live.get(model) or not keys:  # unlocked fast path: nothing to read
            return {}
        out: dict[str, int] = {}
        with self._lock:
            self._expire(self._clock())
            members = self._live.get(model)
            if not members:
                return {}
            for member, live in list(members.items()):
                have = min(confirmed.get(member, 0), len(keys))
                if have and keys[have - 1] in live:
                    for key in keys[:have]:  # the events arrived: no longer a guess
                        live.pop(key, None)
                    if not live:
                        del members[member]
                        continue
                extra = _run(live, keys, have)
                if extra:
                    out[member] = extra
            if not members:
                del self._live[model]
        return out

    def members(self, model: str) -> Collection[str]:
        """Members that have live speculative keys for ``model`` (maybe expired ones)."""
        return tuple(self._live.get(model, ()))

    def outcomes(self) -> dict[str, int]:
        with self._lock:
            self._expire(self._clock())
            return dict(self.counts)

    def __len__(self) -> int:
        """Live entries."""
        with self._lock:
            self._expire(self._clock())
            return len(self._fifo)

    def blocks(self) -> int:
        """Keys held over the live entries."""
        with self._lock:
            self._expire(self._clock())
            return self._blocks

    def _expire(self, now: float) -> None:
        fifo = self._fifo
        while fifo and fifo[0].deadline <= now:
            self._finish(fifo.popleft(), None)

    def _finish(self, entry: _Entry, outcome: str | None) -> None:
        """Count ``entry``'s outcome and drop its keys that no later entry renewed."""
        self._blocks -= len(entry.keys)
        members = self._live.get(entry.model)
        live = members.get(entry.member) if members else None
        last = live.get(entry.keys[-1]) if live is not None else None
        if outcome is None:
            if last is None:
                outcome = "confirmed"
            elif last > entry.deadline:
                outcome = "superseded"
            else:
                outcome = "expired"
        self.counts[outcome] += 1
        if live is None:
            return
        deadline = entry.deadline
        for key in entry.keys:
            if live.get(key) == deadline:
                del live[key]
        if not live and members is not None:
            del members[entry.member]
            if not members:
                del self._live[entry.model]


def _run(live: Mapping[int, float], keys: Sequence[int], start: int) -> int:
    """How many keys from ``keys[start]`` on are in ``live``, by binary search (the keys
    of a chain in ``live`` form a prefix of it from the confirmed point; see module)."""
    if start >= len(keys) or keys[start] not in live:
        return 0
    lo, hi = start + 1, len(keys)  # keys[lo - 1] is in; find the first one that is not
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] in live:
            lo = mid + 1
        else:
            hi = mid
    return lo - start


def annotate(
    result: ScoreResult, index: SpeculativeIndex, candidates: Collection[str] | None = None
) -> dict[str, int]:
    """Fill each pod's ``speculative_blocks`` in a score result (a member with
    speculation and no confirmed match is listed with 0 confirmed blocks); returns the
    speculative blocks per member. Confirmed fields are left as the index gave them."""
    if not index.members(result.model):
        return {}
    confirmed = {p.pod: p.matched_blocks for p in result.pods}
    extra = index.prefixes(result.model, result.keys, confirmed)
    if candidates is not None:
        wanted = set(candidates)
        extra = {m: n for m, n in extra.items() if m in wanted}
    if not extra:
        return {}
    for score in result.pods:
        score.speculative_blocks = extra.get(score.pod, 0)
    listed = set(confirmed)
    result.pods.extend(
        PodScore(member, 0, 0, 0, 0, 0, 0.0, n)
        for member, n in sorted(extra.items())
        if member not in listed
    )
    return extra

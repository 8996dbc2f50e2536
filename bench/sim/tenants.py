"""Multi-tenant chat: many tenants' long system prompts, per-user conversations, and
the ways real clients make them hard to place.

* every tenant has its own long system prompt; tenants are picked by Zipf popularity
  (a few big tenants, a long tail), so the hot set is more than one pod holds;
* conversations may carry no session id (``session_ids`` off): the client sends
  none, so a session-affinity router sees a new "session" per request;
* a conversation may *fork* (``fork_p``): it resends an earlier conversation of the
  same tenant up to one of its turns (a regenerated or edited message, a branch in a
  chat UI), then goes its own way - the shared prefix is that whole history;
* conversations may start in bursts (``burst`` at once, e.g. a class or a batch job).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from bench.sim.workloads import (
    SimRequest,
    Workload,
    WorkloadSpec,
    _Source,
    bursty_starts,
    zipf_weights,
)

#: What a turn is assumed to take, for the fork rule's "has that turn happened yet":
#: a fork may only branch from a turn whose answer should exist at the fork's start.
NOMINAL_TURN_S = 2.0


@dataclass(slots=True)
class TenantChatSpec(WorkloadSpec):
    kind: ClassVar[str] = "tenants"
    help: ClassVar[str] = (
        "multi-tenant chat: Zipf tenants with long system prompts, per-user sessions, "
        "optional forks and id-less sessions"
    )
    tenants: int = 32
    zipf: float = 0.8
    system_tokens: int = 2000
    users: int = 300
    turns: int = 4
    user_tokens: int = 100
    output_tokens: int = 150
    think_s: float = 5.0
    sessions_per_s: float = 3.0
    burst: int = 1
    session_ids: bool = True
    fork_p: float = 0.0

    def build(self, seed: int, name: str | None = None) -> Workload:
        src = _Source(seed)
        systems = [src.tokens(self.system_tokens) for _ in range(self.tenants)]
        weights = zipf_weights(self.tenants, self.zipf)
        starts = bursty_starts(src, self.users, self.sessions_per_s, self.burst, 0.2)
        #: Per tenant: (start, [history after each turn]) of its conversations so far.
        earlier: list[list[tuple[float, list[list[int]]]]] = [[] for _ in range(self.tenants)]
        reqs: list[SimRequest] = []
        forks = 0
        for session, start in enumerate(starts):
            tenant = src.rng.choices(range(self.tenants), weights)[0]
            history = systems[tenant]
            parent = self._fork_point(src, earlier[tenant], start)
            if parent is not None:
                history, forks = parent, forks + 1
            turns: list[list[int]] = []
            prev: int | None = None
            for _ in range(self.turns):
                user = src.tokens(src.around(self.user_tokens))
                prompt = history + user
                rid = len(reqs)
                req = SimRequest(
                    rid=rid,
                    session=session if self.session_ids else -1 - rid,
                    group=f"t{tenant}",
                    prompt=prompt,
                    output=src.tokens(src.around(self.output_tokens)),
                    fresh_tokens=len(user),
                    start_s=start,
                    after=prev,
                    think_s=src.think(self.think_s) if prev is not None else 0.0,
                )
                reqs.append(req)
                prev, history = rid, prompt + req.output
                turns.append(history)
            earlier[tenant].append((start, turns))
        workload = Workload(name or self.kind, self.kind, self.params(), reqs, self.users)
        workload.stats = {"forks": forks}
        return workload

    def _fork_point(
        self, src: _Source, conversations: list[tuple[float, list[list[int]]]], start: float
    ) -> list[int] | None:
        """The history a forking conversation resends, or None (no fork)."""
        if self.fork_p <= 0 or not conversations or src.rng.random() >= self.fork_p:
            return None
        parent_start, turns = src.rng.choice(conversations)
        done = int((start - parent_start) // (self.think_s + NOMINAL_TURN_S))
        if done < 1:
            return None  # the parent has not answered a turn yet
        return turns[src.rng.randrange(min(done, len(turns)))]

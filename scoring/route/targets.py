"""Routing targets: one per engine a request can be sent to, with its cost inputs.

A pod running data-parallel ranks is one address for a gateway, but each rank is its
own engine with its own KV cache (index member ``<pod>/dp<rank>``) and its own queue, so
each rank is costed on its own and the answer names the best one. A ``pending`` pod
(first scrape not tried yet) is costed as one waiting request and an empty cache: no
better than a known idle pod, far from the busy an unknown pod is costed as, so the
first requests on a fresh cluster spread over the configured pods. Speculative blocks
extend a rank's confirmed prefix for the cost, valued as GPU blocks; the confirmed count
stays apart for the answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from kvindex.events.wire.identity import member_pod
from kvindex.scoring.load import PodLoad, Unknown
from kvindex.scoring.route.cost import PodInputs
from kvindex.scoring.route.inflight import InFlight
from kvindex.scoring.scorer import PodScore

_DP = "/dp"
PENDING_WAITING = 1  # a pending pod's assumed queue (see the module docstring)


class Target(msgspec.Struct, frozen=True, gc=False):
    """One engine of one candidate pod; ``inputs.pod`` is its index member id."""

    pod: str
    rank: int
    inputs: PodInputs
    kv_usage_max: float | None  # the fullest engine the target stands for (admission)
    confirmed_blocks: int
    speculative_blocks: int
    load: PodLoad | Unknown

    @property
    def member(self) -> str:
        return self.inputs.pod


def member_rank(member: str) -> int:
    """The data-parallel rank of an index member (0 for the pod itself)."""
    _, sep, rank = member.partition(_DP)
    return int(rank) if sep and rank.isdigit() else 0


def has_ranks(members: Iterable[str]) -> bool:
    """Whether any of these index members is a data-parallel rank other than 0."""
    return _DP in "\0".join(members)  # one C search (no member name holds a NUL)


def build_targets(
    pods: Iterable[str],
    matches: Mapping[str, PodScore],
    speculative: Mapping[str, int],
    loads: Mapping[str, PodLoad | Unknown],
    in_flight: Mapping[str, InFlight],
) -> list[Target]:
    """Every target of ``pods``: each pod's ranks, in pod then rank order. Runs for
    every candidate of every /route request: kept to plain lookups."""
    ranks: dict[str, set[int]] = {}
    for member in (*matches, *speculative):
        if _DP in member:
            ranks.setdefault(member_pod(member), set()).add(member_rank(member))
    out = []
    append = out.append
    for pod in pods:
        load = loads[pod]
        known = type(load) is PodLoad
        per_engine = known and len(load.engines) > 1
        if per_engine or pod in ranks:
            pod_ranks = {0, *ranks.get(pod, ())}
            if per_engine:
                pod_ranks.update(int(e) for e in load.engines if e.isdigit())
            rank_list = sorted(pod_ranks)
        else:
            rank_list = _RANK_0
        for rank in rank_list:
            member = pod if rank == 0 else f"{pod}{_DP}{rank}"
            if not known:
                kv_max = None
                if load.reason == "pending":
                    running, waiting, kv = 0, PENDING_WAITING, 0.0
                else:
                    running = waiting = kv = None
            elif per_engine and (engine := load.engines.get(str(rank))) is not None:
                running, waiting = engine.running, engine.waiting
                kv = kv_max = engine.kv_usage
            else:
                running, waiting = load.running, load.waiting
                kv, kv_max = load.kv_usage, load.kv_usage_max
            match = matches.get(member)
            extra = speculative.get(member, 0)
            flying = in_flight.get(member)
            if match is None:
                confirmed, weighted = 0, 0.0
            else:
                confirmed, weighted = match.matched_blocks, match.score
            if flying is None:
                flying = _IDLE
            inputs = PodInputs(
                member,
                confirmed + extra,
                weighted + extra,
                running,
                waiting,
                kv,
                flying.requests,
                flying.prefilling,
                flying.prefill_tokens,
                flying.sessions,
            )
            append(Target(pod, rank, inputs, kv_max, confirmed, extra, load))
    return out


_RANK_0 = (0,)
_IDLE = InFlight()

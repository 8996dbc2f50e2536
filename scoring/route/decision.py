"""The routing decision: admission, the cheapest pod, ties, and load-only fallbacks.
Pure apart from its tie-breaking state (a seeded RNG and a round-robin counter).

- Admission: a pod with more than ``max_waiting`` waiting is refused. KV usage is a cost
  term, not a refusal, unless ``max_kv_usage`` < 1, and then only while another
  candidate has room (:meth:`Admission.kv_limit`): refusing the pod holding a prompt's
  prefix sends its sessions where the prefix must be recomputed. No admitted pod: no
  decision (``no_capacity``), or with ``least_bad`` the cheapest of all.
- Ejected pods (:mod:`kvindex.scoring.route.outlier`) are chosen only when all admitted are.
- The lowest cost wins, equal costs broken at random; ``reason`` is ``prefix`` when the
  chosen pod has the longest reusable match, else ``load``. Fallbacks (the index cannot
  be asked) take the least loaded pod, equal ones in turn; but a request whose session's
  pod is known (``preferred``) goes there when that pod is admitted and some pod had KV
  room (``session``): with no prefix to compare, where the session last ran is the best
  guess of where its history is cached.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Collection, Iterable, Sequence
from enum import StrEnum

import msgspec

from kvindex.scoring.route.cost import CostTerms, CostWeights, PodInputs, pod_costs

_EPSILON = 1e-9


class Reason(StrEnum):
    PREFIX = "prefix"
    LOAD = "load"
    FALLBACK_BACKEND_DOWN = "fallback_backend_down"
    FALLBACK_UNKNOWN_MODEL = "fallback_unknown_model"
    FALLBACK_TOKENIZER_UNAVAILABLE = "fallback_tokenizer_unavailable"
    FALLBACK_MULTIMODAL = "fallback_multimodal"
    FALLBACK_UNTOKENIZABLE = "fallback_untokenizable"
    SESSION = "session"
    NO_CAPACITY = "no_capacity"
    LEAST_BAD = "least_bad"


#: The fallbacks where the prompt itself could not be read, so a request's session id may
#: say where it goes (:meth:`Router.choose`'s ``preferred``). Not the others: with the
#: backend down or the model unknown, the session's pod is no better known than the prefix.
SESSION_FALLBACKS = frozenset(
    {
        Reason.FALLBACK_MULTIMODAL,
        Reason.FALLBACK_UNTOKENIZABLE,
        Reason.FALLBACK_TOKENIZER_UNAVAILABLE,
    }
)


class Candidate(msgspec.Struct, frozen=True, gc=False):
    inputs: PodInputs
    terms: CostTerms
    refused: str | None  # why admission refused the pod; None when admitted


class Decision(msgspec.Struct, frozen=True):
    pod: str | None  # None with NO_CAPACITY
    reason: Reason
    candidates: list[Candidate]
    saturated: bool = False  # no candidate had KV room: the KV limit was lifted


class Admission(msgspec.Struct, frozen=True):
    max_kv_usage: float = 1.0  # 1: off, KV usage only costs
    max_waiting: int = 0  # 0: no limit

    def refusal(
        self, kv_usage_max: float | None, waiting: int | None, kv_limit: float | None = None
    ) -> str | None:
        """Why a pod is refused, or None; ``kv_limit`` is the decision's
        (:meth:`kv_limit`), ``max_kv_usage`` when not given."""
        limit = self.max_kv_usage if kv_limit is None else kv_limit
        if kv_usage_max is not None and kv_usage_max > limit:
            return f"kv_usage {kv_usage_max:.3f} above --max-kv-usage {self.max_kv_usage}"
        if self.max_waiting and waiting is not None and waiting > self.max_waiting:
            return f"{waiting} waiting, more than --max-waiting {self.max_waiting}"
        return None

    def saturated(self, kv_limit: float) -> bool:
        """Whether a decision's KV limit (:meth:`kv_limit`) was lifted for want of
        room, not switched off."""
        return kv_limit == math.inf and self.max_kv_usage < 1.0

    def kv_limit(self, known: Iterable[tuple[float | None, int]]) -> float:
        """The KV-usage limit of one decision, from its candidates whose load is known,
        each as (fullest engine's KV usage, waiting): ``max_kv_usage`` while one of them
        has room (usage at most the limit, waiting within ``max_waiting``); infinity when
        none has, so KV usage refuses nobody. Stops at the first pod with room, the
        usual case."""
        limit, max_waiting = self.max_kv_usage, self.max_waiting
        if limit >= 1.0:
            return math.inf
        for usage, waiting in known:
            if usage is not None and usage <= limit and not (max_waiting and waiting > max_waiting):
                return limit
        return math.inf


def prefer_included(
    pods: Sequence[str], admitted: list[int], excluded: Collection[str]
) -> list[int]:
    """The admitted candidates that are not ``excluded`` (ejected after failures), or
    all the admitted ones when every one is: a request still goes somewhere."""
    if not excluded:
        return admitted
    kept = [i for i in admitted if pods[i] not in excluded]
    return kept or admitted


class Router:
    """Chooses a pod per request; one per service, shared by all requests."""

    def __init__(
        self,
        weights: CostWeights | None = None,
        admission: Admission | None = None,
        seed: int | None = None,
        *,
        least_bad: bool = False,
    ) -> None:
        self.weights = weights or CostWeights()
        self.admission = admission or Admission()
        self.least_bad = least_bad
        self._rng = random.Random(seed)
        self._turn = itertools.count()

    def decide(
        self,
        pods: list[PodInputs],
        kv_usage_max: dict[str, float | None],
        prompt_tokens: int,
        block_size: int,
        fallback: Reason | None = None,
        future_tokens: float = 0.0,
        excluded: Collection[str] = (),
        preferred: str | None = None,
    ) -> Decision:
        """Choose among ``pods``; ``kv_usage_max`` is each pod's fullest engine (for
        admission); ``fallback`` set means load only, and is the decision's reason;
        ``future_tokens``: the prefill the request's session will bring in later turns
        (:func:`~kvindex.scoring.route.cost.pod_costs`'s ``F``); ``excluded``: the
        ejected pods (:func:`prefer_included`); ``preferred``: the session's pod
        (:meth:`choose`).
        (``/route`` without P/D or data-parallel ranks takes the same decision in one
        pass over its candidates: :mod:`kvindex.scoring.route.one_pass`.)"""
        admission = self.admission
        max_waiting = admission.max_waiting
        max_kv = admission.kv_limit(
            (kv_usage_max.get(p.pod), p.waiting) for p in pods if p.waiting is not None
        )
        costs = pod_costs(
            pods, prompt_tokens, block_size, self.weights, fallback is not None, future_tokens
        )
        candidates: list[Candidate] = []
        admitted: list[int] = []
        for i, (p, terms) in enumerate(zip(pods, costs, strict=True)):
            usage, waiting = kv_usage_max.get(p.pod), p.waiting
            if (usage is not None and usage > max_kv) or (
                max_waiting and waiting is not None and waiting > max_waiting
            ):  # the refusal text only when refused
                candidates.append(Candidate(p, terms, admission.refusal(usage, waiting, max_kv)))
                continue
            candidates.append(Candidate(p, terms, None))
            admitted.append(i)
        names = [p.pod for p in pods]
        admitted = prefer_included(names, admitted, excluded)
        saturated = admission.saturated(max_kv)
        chosen, reason = self.choose(
            names,
            [t.total for t in costs],
            [t.load for t in costs],
            [t.usable_blocks for t in costs],
            admitted,
            fallback,
            None if preferred is None or saturated else names.index(preferred),
        )
        pod = None if chosen is None else pods[chosen].pod
        return Decision(pod, reason, candidates, saturated)

    def choose(
        self,
        pods: list[str],
        totals: list[float],
        loads: list[float],
        usable: list[int],
        admitted: list[int],
        fallback: Reason | None,
        preferred: int | None = None,
    ) -> tuple[int | None, Reason]:
        """The chosen candidate's index and the reason, from each candidate's cost,
        load terms and reusable blocks, and the indices of the admitted ones (ascending):
        the rules of the module docstring. ``preferred``: the index of the request's
        session's pod, taken (reason ``session``) in a fallback in
        :data:`SESSION_FALLBACKS` when admitted; the caller leaves it out when no
        candidate had KV room. The one place ties are broken, so every path
        to a decision draws from the RNG and the round-robin counter alike."""
        if not admitted:
            if not self.least_bad or not pods:
                return None, Reason.NO_CAPACITY
            key = loads if fallback is not None else totals
            best = min(key)
            tied = [i for i, value in enumerate(key) if value <= best + _EPSILON]
            return (tied[0] if len(tied) == 1 else self._rng.choice(tied)), Reason.LEAST_BAD
        if fallback is not None:
            if preferred in admitted and fallback in SESSION_FALLBACKS:
                return preferred, Reason.SESSION
            best = min([loads[i] for i in admitted])
            tied = sorted(
                (i for i in admitted if loads[i] <= best + _EPSILON), key=pods.__getitem__
            )
            return tied[next(self._turn) % len(tied)], fallback
        if len(admitted) == len(totals):  # every pod admitted (the usual case): no indirection
            limit = min(totals) + _EPSILON
            tied = [i for i, total in enumerate(totals) if total <= limit]
            longest = max(usable)
        else:
            limit = min([totals[i] for i in admitted]) + _EPSILON
            tied = [i for i in admitted if totals[i] <= limit]
            longest = max([usable[i] for i in admitted])
        chosen = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        mine = usable[chosen]
        return chosen, Reason.PREFIX if mine > 0 and mine == longest else Reason.LOAD

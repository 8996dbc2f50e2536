"""Prefill/decode disaggregation: which pod prefills a prompt and which one decodes it.

Under P/D serving (vLLM with a KV connector such as NIXL) a prefill pod computes the
prompt's KV cache and ships it to a decode pod, which generates the output. Pods carry a
role: ``prefill``, ``decode`` or ``both`` (the default). As llm-d's prefix-based P/D
decider does, the decode pod is chosen first, by the usual cost (its own prefix, for
the decode-side cache, and its load) among pods that decode; then, if the part of the
prompt the decode pod does not hold is small (under ``threshold_tokens``), the decode
pod prefills it itself: shipping KV for a few hundred tokens costs more than computing
them. Otherwise the prefill pod is chosen by prefix and load among pods that prefill.
When no prefill pod is admissible, or the cheapest is the decode pod itself, the decode
pod prefills locally too: P/D is an optimisation, never a reason to fail a request.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvindex.scoring.route.decision import Decision, Reason, Router
from kvindex.scoring.route.targets import Target


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


_DECODES = (Role.DECODE, Role.BOTH)
_PREFILLS = (Role.PREFILL, Role.BOTH)


def parse_role(text: str) -> Role:
    """A role name; ValueError naming the choices otherwise."""
    try:
        return Role(text.strip().lower())
    except ValueError:
        raise ValueError(f"role {text!r}: use prefill, decode or both") from None


@dataclass(frozen=True, slots=True)
class PdDecision:
    decode: Decision
    prefill: Decision | None  # None: the decode pod prefills the prompt itself
    local_why: str | None  # why the decode pod prefills itself (None with a prefill pod)


def disaggregated(roles: Mapping[str, Role], pods: Sequence[str]) -> bool:
    """P/D applies when some candidate is not ``both``."""
    if not roles:
        return False
    return any(roles.get(pod, Role.BOTH) is not Role.BOTH for pod in pods)


def of_role(targets: Sequence[Target], roles: Mapping[str, Role], role: Role) -> list[Target]:
    """The targets that can serve ``role`` (``both`` serves either)."""
    allowed = _PREFILLS if role is Role.PREFILL else _DECODES
    return [t for t in targets if roles.get(t.pod, Role.BOTH) in allowed]


def decide_pd(
    router: Router,
    targets: Sequence[Target],
    roles: Mapping[str, Role],
    prompt_tokens: int,
    block_size: int,
    fallback: Reason | None,
    threshold_tokens: int,
    excluded: Collection[str] = (),
) -> PdDecision:
    """The decode target, then the prefill target unless the decode one should prefill
    (see the module docstring); ``excluded``: members ejected after failures, chosen only
    when every admitted one of a role is
    (:func:`~kvindex.scoring.route.decision.prefer_included`)."""
    decoders = of_role(targets, roles, Role.DECODE)
    decode = _decide(router, decoders, prompt_tokens, block_size, fallback, excluded)
    if decode.pod is None:
        return PdDecision(decode, None, None)
    chosen = next(c for c in decode.candidates if c.inputs.pod == decode.pod)
    cached = min(chosen.terms.usable_blocks * block_size, prompt_tokens)
    uncached = prompt_tokens - cached
    if uncached < threshold_tokens:
        why = f"{uncached} uncached tokens on the decode pod, under --pd-threshold"
        return PdDecision(decode, None, why)
    prefillers = of_role(targets, roles, Role.PREFILL)
    if not prefillers:
        return PdDecision(decode, None, "no candidate prefills")
    prefill = _decide(router, prefillers, prompt_tokens, block_size, fallback, excluded)
    if prefill.pod is None:
        return PdDecision(decode, None, "no prefill pod admissible")
    if prefill.pod == decode.pod:
        return PdDecision(decode, None, "the decode pod is also the cheapest prefill pod")
    return PdDecision(decode, prefill, None)


def _decide(
    router: Router,
    targets: Sequence[Target],
    prompt_tokens: int,
    block_size: int,
    fallback: Reason | None,
    excluded: Collection[str],
) -> Decision:
    kv_max = {t.member: t.kv_usage_max for t in targets}
    inputs = [t.inputs for t in targets]
    return router.decide(inputs, kv_max, prompt_tokens, block_size, fallback, excluded=excluded)

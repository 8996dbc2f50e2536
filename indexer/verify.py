"""Checking at ingest that kvindex computes the same block keys as the engines.

If kvindex hashes prompts with another algorithm, seed or block size than the pods,
every score is silently 0. Every BlockStored that carries its tokens lets us recompute
the engine's hashes and compare, so a misconfiguration is caught from the first events:
per-pod status, a counter, and one log line naming the setting that would match.

Only chains we can recompute are checked: the event must start a sequence (no parent)
or carry its parent as a full digest (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``),
because a published uint64 parent is a truncated digest that cannot be chained from.
Each member's first ``full_checks`` verifiable events are all checked, then one in
``sample_every``, and at most ``max_blocks`` blocks per event, so ingest stays fast.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvindex.events.wire.vllm import BlockStored, DecodeError, hash_to_int, tokens_of
from kvindex.indexer.event_extras import read_event_extras
from kvindex.indexer.keys import (
    BlockExtras,
    BlockHasher,
    ExtraKeyStyle,
    HashAlgo,
    HashConfig,
    KeyConfigError,
)
from kvindex.indexer.models import ModelKeying

log = logging.getLogger(__name__)


class CheckState(enum.StrEnum):
    UNVERIFIED = "unverified"  # no verifiable event seen yet
    OK = "ok"
    MISMATCH = "mismatch"


@dataclass(slots=True)
class HashCheck:
    """One member's hash-check status, as /index/pods shows it."""

    state: CheckState = CheckState.UNVERIFIED
    checked_events: int = 0
    failed_events: int = 0
    skipped_events: int = 0  # carried tokens but could not be recomputed (see reason)
    skip_reason: str | None = None
    diagnosis: str | None = None  # which configuration reproduces the engine's hashes
    action: str | None = None  # what to change
    recent: deque[bool] = field(default_factory=lambda: deque(maxlen=16))

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "checked_events": self.checked_events,
            "failed_events": self.failed_events,
            "skipped_events": self.skipped_events,
            "skip_reason": self.skip_reason,
            "diagnosis": self.diagnosis,
            "action": self.action,
        }


class HashVerifier:
    """Samples BlockStored events per member and compares recomputed keys."""

    def __init__(
        self,
        keying: Callable[[str], ModelKeying],
        hasher: Callable[[str], BlockHasher],
        *,
        full_checks: int = 32,
        sample_every: int = 64,
        max_blocks: int = 4,
        diagnose_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keying = keying
        self._hasher = hasher
        self._full_checks = full_checks
        self._sample_every = sample_every
        self._max_blocks = max_blocks
        self._diagnose_interval = diagnose_interval_s
        self._clock = clock
        self._checks: dict[str, HashCheck] = {}
        self._seen: dict[str, int] = {}
        self._last_diagnosis: dict[tuple[str, str], float] = {}
        self.mismatches_total = 0

    def status(self, member: str) -> HashCheck:
        return self._checks.get(member) or HashCheck()

    def reset(self, member: str) -> None:
        """Forget a member's history (its engine restarted, maybe with a new config)."""
        self._checks.pop(member, None)
        self._seen.pop(member, None)

    def observe(self, member: str, model: str, event: BlockStored) -> None:
        """Maybe check one event; cheap when this event is not sampled."""
        seen = self._seen.get(member, 0)
        self._seen[member] = seen + 1
        if seen >= self._full_checks and seen % self._sample_every:
            return
        self._consider(member, model, event)

    def observe_many(
        self, member: str, model: str, count: int, event_at: Callable[[int], BlockStored]
    ) -> None:
        """:meth:`observe` for ``count`` events in a row, where ``event_at(i)`` is the
        i-th; only the sampled ones are fetched (so a run of events that arrived
        undecoded is decoded one sampled event at a time)."""
        seen = self._seen.get(member, 0)
        self._seen[member] = seen + count
        full, every = self._full_checks, self._sample_every
        i = 0
        while i < count:
            n = seen + i
            if n >= full and n % every:
                i += every - n % every  # to the next sampled position
                continue
            self._consider(member, model, event_at(i))
            i += 1

    def _consider(self, member: str, model: str, event: BlockStored) -> None:
        """Check a sampled event when it can be recomputed."""
        if event.block_size <= 0:
            return  # placeholder (CPU offload) event: nothing to recompute
        parent = event.parent_block_hash
        if parent is not None and not isinstance(parent, bytes):
            return  # truncated uint64 parent: cannot chain from it
        try:
            tokens = tokens_of(event)
        except DecodeError:
            return  # malformed token ids: nothing to recompute from
        if tokens:
            self._check(member, model, event, tokens, parent)

    def _check(
        self,
        member: str,
        model: str,
        event: BlockStored,
        tokens: list[int],
        parent: bytes | None,
    ) -> None:
        check = self._checks.setdefault(member, HashCheck())
        keying = self._keying(model)
        config = keying.hash
        if config.lookahead_tokens:
            check.skipped_events += 1
            check.skip_reason = "lookahead hashing: events do not carry the lookahead tokens"
            return
        if event.block_size != config.block_size:
            self._record(
                member,
                model,
                check,
                ok=False,
                diagnosis=f"engine block size is {event.block_size}",
                action=f"set block_size: {event.block_size} for model {model!r} "
                f"(--block-size or the model config; kvindex uses {config.block_size})",
            )
            return
        count = min(len(event.block_hashes), self._max_blocks, len(tokens) // config.block_size)
        if count == 0:
            return
        try:
            extras = _event_extras(event, keying, config.extra_key_style)
            want = [hash_to_int(h) for h in event.block_hashes[:count]]
            got = self._hasher(model).keys(tokens[: count * config.block_size], extras, parent)
        except _Unverifiable as exc:
            check.skipped_events += 1
            check.skip_reason = str(exc)
            return
        except KeyConfigError as exc:
            check.skipped_events += 1
            check.skip_reason = str(exc)
            return
        if got == want:
            self._record(member, model, check, ok=True)
            return
        diagnosis, action = self._diagnose(
            member, model, event, tokens[: count * config.block_size], keying, parent, want
        )
        self._record(member, model, check, ok=False, diagnosis=diagnosis, action=action)

    def _record(
        self,
        member: str,
        model: str,
        check: HashCheck,
        *,
        ok: bool,
        diagnosis: str | None = None,
        action: str | None = None,
    ) -> None:
        check.checked_events += 1
        check.recent.append(ok)
        if ok:
            passes = sum(check.recent)
            if passes * 2 >= len(check.recent):
                check.state = CheckState.OK
            return
        check.failed_events += 1
        self.mismatches_total += 1
        if diagnosis is not None:
            check.diagnosis, check.action = diagnosis, action
        failures = len(check.recent) - sum(check.recent)
        # One odd event (a salted prompt on a release that does not publish the salt)
        # must not flip a healthy pod; a run of failures must.
        if failures * 2 > len(check.recent) and (failures >= 2 or len(check.recent) == 1):
            if check.state is not CheckState.MISMATCH:
                log.error(
                    "block hashes of pod %s for model %r do not match kvindex's: %s; %s",
                    member,
                    model,
                    check.diagnosis or "no candidate configuration reproduces them",
                    check.action or "",
                )
            check.state = CheckState.MISMATCH

    def _diagnose(
        self,
        member: str,
        model: str,
        event: BlockStored,
        tokens: list[int],
        keying: ModelKeying,
        parent: bytes | None,
        want: list[int],
    ) -> tuple[str, str]:
        now = self._clock()
        key = (member, model)
        last = self._last_diagnosis.get(key)
        check = self._checks[member]
        if last is not None and now - last < self._diagnose_interval and check.diagnosis:
            return check.diagnosis, check.action or ""
        self._last_diagnosis[key] = now
        current = keying.hash
        for candidate in _candidates(current):
            try:
                extras = _event_extras(event, keying, candidate.extra_key_style)
                keys = BlockHasher(candidate, memo_size=0).keys(tokens, extras, parent)
            except (_Unverifiable, KeyConfigError):
                continue
            if keys == want:
                return (
                    f"engine hashes match {candidate.describe()}, "
                    f"extra keys {candidate.extra_key_style.value}; kvindex uses "
                    f"{current.describe()}, extra keys {current.extra_key_style.value}",
                    _action_for(model, current, candidate),
                )
        return (
            "no supported algorithm/seed reproduces the engine's hashes (likely xxhash "
            "with PYTHONHASHSEED unset, i.e. a random seed per engine process, or a "
            f"seed other than {current.seed!r})",
            "set PYTHONHASHSEED to one value on every pod and --hash-seed to the same "
            f"value, or run model {model!r} with key_mode: tokens",
        )


def _candidates(current: HashConfig) -> list[HashConfig]:
    seeds: list[str | None] = [current.seed]
    if current.seed is not None:
        seeds.append(None)
    out = []
    for style in (
        current.extra_key_style,
        *(s for s in ExtraKeyStyle if s != current.extra_key_style),
    ):
        for algo in HashAlgo:
            for seed in seeds:
                candidate = replace(current, algo=algo, seed=seed, extra_key_style=style)
                if candidate != current and candidate.reproducible:
                    out.append(candidate)
    return out


def _action_for(model: str, current: HashConfig, candidate: HashConfig) -> str:
    changes = []
    if candidate.algo != current.algo:
        changes.append(f"hash_algo: {candidate.algo.value} (--hash-algo)")
    if candidate.seed != current.seed:
        seed = "unset" if candidate.seed is None else repr(candidate.seed)
        changes.append(f"hash_seed: {seed} (--hash-seed)")
    if candidate.extra_key_style != current.extra_key_style:
        changes.append(f"extra_key_style: {candidate.extra_key_style.value}")
    return f"set {', '.join(changes)} for model {model!r}"


class _Unverifiable(Exception):
    """This event's extra keys cannot be turned back into hash inputs."""


def _event_extras(event: BlockStored, keying: ModelKeying, style: ExtraKeyStyle) -> BlockExtras:
    """Rebuild the request extras (LoRA, salt, multimodal items) from an event
    (indexer/event_extras.py). Prompt-embedding digests cannot be recomputed from an
    event, so such events are skipped rather than misjudged."""
    lora = event.lora_name
    read = read_event_extras(event)
    if read.unread:
        raise _Unverifiable("prompt-embedding or unrecognised extra keys")
    if lora is None and event.lora_id is not None:
        raise _Unverifiable("LoRA id without a LoRA name (vLLM < 0.14)")
    path = keying.lora_path(lora) if lora is not None else None
    if lora is not None and style is ExtraKeyStyle.TAGGED and path is None:
        raise _Unverifiable(f"LoRA {lora!r} has no path in the model config")
    return BlockExtras(lora, path, read.salt, read.mm_features)

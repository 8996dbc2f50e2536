"""Applying event batches to the index: the BatchSink the subscriber delivers to.

Turns each delivered batch into backend Changes, all of one delivery chunk applied in
one ``backend.apply`` call (one round trip on Redis; coalesced vector operations in
memory). The rules, each one a pitfall other indexers hit, are in
:class:`Ingestor`'s docstring.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvindex.events.ingest.sink import Delivery
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.runs import CLEARED, STORED, event_at, runs_of
from kvindex.events.wire.sessions import stored_sessions
from kvindex.events.wire.vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    hash_to_int,
    hashes_to_ints,
    tokens_of,
)
from kvindex.indexer.backend import Change, IndexBackend, Op, Tier
from kvindex.indexer.event_extras import read_event_extras
from kvindex.indexer.keys import BlockExtras
from kvindex.indexer.kv_groups import FULL_ATTENTION_KINDS, KvLayouts, group_model
from kvindex.indexer.models import KeyMode, ModelCatalog, ReportMode
from kvindex.indexer.sessions import SessionPods
from kvindex.indexer.token_keys import ContentHasher, EngineKeyMap, TokenRangeError
from kvindex.indexer.verify import HashVerifier

log = logging.getLogger(__name__)

#: vLLM's ``Locality.REMOTE`` (``v1/kv_offload/base.py``, 0.26-0.33).
_REMOTE = "REMOTE"
#: vLLM's ``medium`` -> tier (None: GPU). The one mapping: an unknown medium is counted.
_TIERS = {None: Tier.GPU, "GPU": Tier.GPU, "CPU": Tier.CPU, "STORAGE": Tier.STORAGE}


class IngestCounts:
    """Plain counters the metrics layer reads at scrape time."""

    def __init__(self) -> None:
        self.events: Counter[str] = Counter()  # by event type
        self.skipped: Counter[str] = Counter()  # events (or blocks) not indexed, by reason
        self.blocks_stored = 0
        self.blocks_removed = 0
        self.resets: Counter[str] = Counter()  # by reason


class Ingestor:
    """Implements events.BatchSink over an IndexBackend. Called from one thread.

    Rules, each one a pitfall other indexers hit:

    * BlockStored goes to the tier named by ``medium`` (None = GPU); BlockRemoved removes
      for exactly that member and tier; AllBlocksCleared clears that member only, in every
      tier (the event has no medium, and over-reporting a pod's cache is worse than
      under-reporting it); an engine restart or a removed pod clears the member first.
    * Hybrid models publish one stream of stores and removals per KV-cache group, and the
      same hash can be evicted from a sliding-window group while the full-attention group
      still holds it. Once a member's stores name their group's kind
      (``kv_cache_spec_kind``, vLLM 0.22+), every group is indexed in its own namespace
      (:mod:`kvindex.indexer.kv_groups`) and the model's group layout is learned for
      scoring. Until then (older engines), and always in token-key mode, only the primary
      group is indexed: the lowest-numbered full-attention group, or group 0 when the
      engine does not say; other groups are counted and skipped.
    * Copies (vLLM 0.33): an engine may hold one hash in several physical blocks (a fully
      cached, block-aligned prompt recomputes its last block into a new one; n>1
      sampling, retries, many users sending one canned prompt) and publishes a
      ``BlockStored`` per copy and a ``BlockRemoved`` per copy evicted, so the index counts
      copies (``Op.STORE`` adds one, ``Op.REMOVE`` takes one away, never below zero) and
      a member holds a hash while it has one. Under vLLM's default report mode
      (``incremental``) that is exact. Requests sent with ``kv_cache_report_mode="full"``
      also re-announce the blocks their prompt hit as a ``BlockStored`` with no removal to
      match, built exactly like a real one (vLLM 0.33 ``BlockPool._build_block_stored_event``
      serves both); what marks it is only that it starts at the root of the chain
      (``parent_block_hash`` None). The wire cannot tell such an announcement from a real
      root copy, so the model's ``kv_cache_report_mode`` setting (``ReportMode``) decides:
      ``incremental`` (the default) counts every store; ``full`` takes a store from the
      root for an ``Op.ANNOUNCE`` (a block not held gets one copy, a held block nothing),
      which never over-counts but drops a real root copy's hash at its first eviction.
      docs/correctness.md ("Copies and report modes") has the cases.
    * Stores and removals marked ``locality="REMOTE"`` (vLLM >= 0.26) are not indexed
      (counted ``remote_locality``). In vLLM 0.33.0 only the offloading connector's
      secondary tiers set it (``v1/kv_offload/tiering/fs/manager.py`` and ``obj/manager.py``,
      ``get_finished_jobs``): network storage shared by every instance with the same
      ``root_dir``, whose lookup is a file-existence check across instances, which
      publishes stores but never a ``BlockRemoved``. A hit there is a promotion into the
      pod's CPU tier (``TieringOffloadingManager.lookup`` -> ``_initiate_promotion``), which
      is announced as its own CPU ``BlockStored`` once it happens. So a REMOTE entry says
      nothing that sets this pod apart from the others sharing the store, and could never be
      removed: indexing it would only over-report, permanently.
    * CPU-offload placeholder stores (no tokens, block size 0) carry the engine's own block
      hashes (one per offloaded chunk: its last GPU block's), so in engine-key mode they are
      indexed as is; in token-key mode they are resolved through the engine-hash map, and
      skipped (counted) when unknown.
    * ``medium`` is GPU, CPU or STORAGE: the only values vLLM 0.33 publishes (its
      filesystem and object-store offload tiers both publish STORAGE). Others are counted
      ``unknown_medium``, not guessed into a tier.
    * ``ownership`` (0.29) is not read: the offloading connector publishes one store and one
      removal per (medium, ownership) residency of a chunk, and copies are counted per
      (member, hash, tier), so a block two residencies hold stays while either does
      (tests/test_vllm_offload.py runs vLLM's own tracker). ``origin`` (proposed, NEW or
      REUSED) is not read either: a reused block is one the index already holds.
    * ``session_id`` (vLLM 0.30, SGLang 0.5.20) on GPU stores goes to ``sessions``
      (:class:`~kvindex.indexer.sessions.SessionPods`): the member is where those sessions
      were last computed. A reset or an ``AllBlocksCleared`` forgets the member's sessions
      (a batch's stores are learned after its clears).
    """

    def __init__(
        self,
        backend: IndexBackend,
        catalog: ModelCatalog,
        verifier: HashVerifier | None = None,
        layouts: KvLayouts | None = None,
        sessions: SessionPods | None = None,
    ) -> None:
        self._backend = backend
        self._catalog = catalog
        self._verifier = verifier
        self._engine_map = EngineKeyMap()
        self._content: dict[str, ContentHasher] = {}
        self._primary_group: dict[str, int] = {}
        self._grouped: set[str] = set()  # members whose stores name their KV group's kind
        self.layouts = layouts if layouts is not None else KvLayouts()
        self.sessions = sessions if sessions is not None else SessionPods()
        self.counts = IngestCounts()

    def deliver(self, deliveries: Sequence[Delivery]) -> None:
        changes = ChangeList()
        for delivery in deliveries:
            self._changes_for(delivery, changes)
            sessions = stored_sessions(delivery.batch)
            if sessions:
                self.sessions.stored(delivery.model, delivery.stream.member, sessions)
        if changes:
            self._backend.apply(changes.finish())

    def reset(self, stream: StreamId, reason: str) -> None:
        member = stream.member
        self.counts.resets[reason] += 1
        self._engine_map.clear(member)
        self.sessions.forget(member)
        self._primary_group.pop(member, None)
        self._grouped.discard(member)
        if self._verifier is not None:
            self._verifier.reset(member)
        dropped = self._backend.clear_member(member)
        log.info("cleared %d entries of %s (%s)", dropped, member, reason)

    def own_keys_of(self, published: Sequence[int]) -> list[int | None]:
        """Token-key mode: the own keys of block hashes pods published (None where no
        pod did); see :meth:`EngineKeyMap.resolve_any`."""
        return self._engine_map.resolve_any(published)

    def to_state(self) -> dict[str, Any]:
        """Per-member state that shapes how future events are indexed (token-key map,
        primary KV group), for a snapshot taken with the index's own state."""
        return {
            "engine_map": self._engine_map.to_state(),
            "primary_group": dict(self._primary_group),  # a copy: written after the cut
            "grouped": sorted(self._grouped),
            "layouts": [
                [model, idx, spec.kind, spec.sliding_window, spec.block_size]
                for model, groups in sorted(self.layouts.all().items())
                for idx, spec in sorted(groups.items())
            ],
        }

    def from_state(self, state: dict[str, Any]) -> None:
        self._engine_map.from_state(state["engine_map"])
        self._primary_group = {str(m): int(g) for m, g in state["primary_group"].items()}
        # KV groups (absent from snapshots written before hybrid indexing)
        self._grouped = {str(m) for m in state.get("grouped", ())}
        for model, idx, kind, window, block_size in state.get("layouts", ()):
            self.layouts.learn(str(model), int(idx), str(kind), window, int(block_size))

    def _changes_for(self, delivery: Delivery, changes: ChangeList) -> None:
        """The batch's changes, a run of like events at a time (:mod:`kvindex.events.wire.runs`):
        its hashes go to the backend as one ``uint64`` buffer, never as Python ints."""
        member = delivery.stream.member
        model = delivery.model
        keying = self._catalog.keying(model)
        if keying.key_mode is KeyMode.TOKENS:
            self._token_changes(delivery, changes)
            return
        # Under report mode "full" a store from the root may be an announcement (docstring)
        root_op = Op.ANNOUNCE if keying.report_mode is ReportMode.FULL else Op.STORE
        counts = self.counts
        batch = delivery.batch
        runs, hashes = runs_of(batch)
        for run in runs:
            tag, first, count, start, stop, parent_none = run[:6]
            if tag == CLEARED:
                counts.events["AllBlocksCleared"] += count
                self.sessions.forget(member)
                for _ in range(count):
                    self._engine_map.clear(member)
                    changes.clear(member, model)
                continue
            medium, group_idx, kind, locality = run[7], run[8], run[9], run[11]
            stored = tag == STORED
            counts.events["BlockStored" if stored else "BlockRemoved"] += count
            if locality == _REMOTE:
                counts.skipped["remote_locality"] += count
                continue
            if stored and group_idx is not None:
                self._learn_group(member, model, count, run)
            place = self._place(member, model, group_idx, kind, medium, count)
            if place is None:
                continue
            target, tier = place
            if stored:
                op = root_op if parent_none else Op.STORE
                if self._verifier is not None:
                    self._verifier.observe_many(
                        member, model, count, lambda i, b=batch, f=first: event_at(b, f + i)
                    )
                counts.blocks_stored += stop - start
            else:
                op = Op.REMOVE
                counts.blocks_removed += stop - start
            if stop > start:
                changes.add(op, member, target, tier, _span(hashes, start, stop))

    def _token_changes(self, delivery: Delivery, changes: ChangeList) -> None:
        """Token-key mode: every event's own keys come from its token ids, one event at
        a time (the content hash chain, the engine-hash map)."""
        member = delivery.stream.member
        model = delivery.model
        # Under report mode "full" a store from the root may be an announcement (docstring)
        report_full = self._catalog.keying(model).report_mode is ReportMode.FULL
        root_op = Op.ANNOUNCE if report_full else Op.STORE
        counts = self.counts
        for event in delivery.batch.events:
            if isinstance(event, BlockStored):
                counts.events["BlockStored"] += 1
                if event.locality == _REMOTE:
                    counts.skipped["remote_locality"] += 1
                    continue
                place = self._place(
                    member, model, event.group_idx, event.kv_cache_spec_kind, event.medium
                )
                if place is None:
                    continue
                target, tier = place
                op = root_op if event.parent_block_hash is None else Op.STORE
                keys = self._content_keys(member, model, tier, event, op)
                if keys:
                    counts.blocks_stored += len(keys)
                    changes.add(op, member, target, tier, _packed(keys))
            elif isinstance(event, BlockRemoved):
                counts.events["BlockRemoved"] += 1
                if event.locality == _REMOTE:
                    counts.skipped["remote_locality"] += 1
                    continue
                place = self._place(member, model, event.group_idx, None, event.medium)
                if place is None:
                    continue
                target, tier = place
                keys = self._engine_map.forget(member, tier, hashes_to_ints(event.block_hashes))
                if keys:
                    counts.blocks_removed += len(keys)
                    changes.add(Op.REMOVE, member, target, tier, _packed(keys))
            elif isinstance(event, AllBlocksCleared):
                counts.events["AllBlocksCleared"] += 1
                self.sessions.forget(member)
                self._engine_map.clear(member)
                changes.clear(member, model)

    def _learn_group(self, member: str, model: str, count: int, run: tuple) -> None:
        """Record the group layout a run of ``count`` stores announces (engine-key mode
        only: token-key mode indexes the primary group alone)."""
        block_size, medium, group_idx, kind, window = run[6:11]
        if kind is None:
            return
        self._grouped.add(member)
        if medium not in (None, "GPU"):
            return  # offload tiers have block sizes of their own
        layouts = self.layouts
        conflicts = layouts.conflicts
        layouts.learn(model, group_idx or 0, kind, window, block_size)
        if layouts.conflicts != conflicts:  # each store that disagrees is one conflict
            for _ in range(count - 1):
                layouts.learn(model, group_idx or 0, kind, window, block_size)

    def _place(
        self,
        member: str,
        model: str,
        group_idx: int | None,
        kind: str | None,
        medium: str | None,
        count: int = 1,
    ) -> tuple[str, Tier] | None:
        """The index namespace and tier ``count`` events of this KV-cache group and
        medium apply to; None (counted) when they are not indexed."""
        if group_idx is None:
            target: str | None = model
        elif member in self._grouped:
            target = group_model(model, group_idx)
        else:
            target = model if self._indexed_group(member, group_idx, kind) else None
        if target is None:
            self.counts.skipped["other_kv_group"] += count
            return None
        tier = _TIERS.get(medium)
        if tier is None:
            self.counts.skipped["unknown_medium"] += count
            return None
        return target, tier

    def _indexed_group(self, member: str, group_idx: int, kind: str | None) -> bool:
        """Without a learned layout: whether this is the member's primary group."""
        primary = self._primary_group.get(member)
        if kind is not None:
            if kind not in FULL_ATTENTION_KINDS:
                return False
            if primary is None or group_idx < primary:
                self._primary_group[member] = primary = group_idx
        return group_idx == (0 if primary is None else primary)

    def _content_keys(
        self, member: str, model: str, tier: Tier, event: BlockStored, op: Op
    ) -> list[int]:
        engine_keys = hashes_to_ints(event.block_hashes)
        add_copy = op is Op.STORE
        try:
            tokens = tokens_of(event)
        except DecodeError:
            self.counts.skipped["invalid_token_ids"] += 1
            return []
        if not tokens:
            own, unknown = self._engine_map.resolve_many(
                member, tier, engine_keys, add_copy=add_copy
            )
            if unknown:
                self.counts.skipped["unresolved_placeholder_block"] += unknown
            return own
        block_size = self._catalog.keying(model).hash.block_size
        if event.block_size != block_size:
            self.counts.skipped["block_size_mismatch"] += 1
            return []
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = self._engine_map.resolve(member, hash_to_int(event.parent_block_hash))
            if parent is None:
                self.counts.skipped["unknown_parent"] += 1
                return []
        hasher = self._content.get(model)
        if hasher is None:
            hasher = self._content[model] = ContentHasher(block_size)
        extras = _content_extras(event)
        try:
            own = hasher.keys(tokens, extras, parent, 0 if parent is None else 1)
        except TokenRangeError:
            self.counts.skipped["token_out_of_range"] += 1
            return []
        own = own[: len(engine_keys)]
        self._engine_map.learn(member, tier, engine_keys, own, add_copy=add_copy)
        return own


class ChangeList:
    """The changes of one ``deliver`` call, as they are built.

    Keys arrive as native ``uint64`` buffers (a run's slice of a batch's hashes). A
    run with the same op, member, model and tier as the change before it extends that
    change: applying the two in a row is the same as applying their keys as one, and an
    engine's batches are mostly such runs (fewer, longer changes are what the backends
    batch best). :meth:`finish` joins each change's buffers into one ``uint64`` array.
    """

    __slots__ = ("_changes", "_pieces")

    def __init__(self) -> None:
        self._changes: list[Change] = []
        self._pieces: list[list[bytes | memoryview] | None] = []  # per change; None: CLEAR

    def __bool__(self) -> bool:
        return bool(self._changes)

    def add(self, op: Op, member: str, model: str, tier: Tier, keys: bytes | memoryview) -> None:
        if self._changes:
            last = self._changes[-1]
            if (
                last.op is op
                and last.tier is tier
                and last.member == member
                and last.model == model
            ):
                self._pieces[-1].append(keys)  # type: ignore[union-attr]  # not a CLEAR
                return
        self._changes.append(Change(op, member, model, tier))
        self._pieces.append([keys])

    def clear(self, member: str, model: str) -> None:
        self._changes.append(Change(Op.CLEAR, member, model, None))
        self._pieces.append(None)

    def finish(self) -> list[Change]:
        for change, pieces in zip(self._changes, self._pieces, strict=True):
            if pieces is not None:
                joined = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                change.keys = np.frombuffer(joined, np.uint64)
        return self._changes


def _span(hashes: bytes | memoryview, start: int, stop: int) -> bytes | memoryview:
    """Hashes ``start:stop`` (in items) of a native ``uint64`` buffer, without a copy."""
    if start == 0 and 8 * stop == len(hashes):
        return hashes
    return memoryview(hashes)[8 * start : 8 * stop]


def _packed(keys: list[int]) -> bytes:
    """Keys (Python ints, in ``[0, 2**64)``) as a native ``uint64`` buffer."""
    try:
        return array("Q", keys).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"block keys must be integers in [0, 2**64): {exc}") from None


def _content_extras(event: BlockStored) -> BlockExtras:
    """LoRA name, cache salt and multimodal items as content keys use them."""
    read = read_event_extras(event)
    return BlockExtras(event.lora_name, None, read.salt, read.mm_features)

"""How each vLLM release encodes KV events, for the engine side of the wire.

The decoder in :mod:`kvindex.events.wire.vllm` accepts every layout at once; the publisher,
the simulator and the tests need the opposite: produce exactly the bytes one given
release would send. A :class:`WireFormat` holds one release's choices (which fields each
event carries and in which order, array or map events, whether a batch carries the
data-parallel rank, whether replay replies carry the topic) and the facts behind them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvindex.events.wire.vllm import AllBlocksCleared, BlockRemoved, BlockStored, Layout


class EngineBlockStored(BlockStored, tag="BlockStored"):
    """BlockStored with the fields only newer releases send (the decoder ignores them).

    Only the engine side needs these: tests and the simulator use them to produce the
    exact payloads of vLLM >= 0.26.
    """

    ownership: str | None = None  # 0.29 (locality, 0.26, is on BlockStored itself)
    session_id: str | None = None  # 0.30
    lookahead_token_ids: list[list[int]] | None = None  # 0.33


class EngineBlockRemoved(BlockRemoved, tag="BlockRemoved"):
    """BlockRemoved with the fields only newer releases send."""

    ownership: str | None = None  # 0.29 (locality, 0.26, is on BlockRemoved itself)


_STORED_BASE = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")

# Fields vLLM declares with a default of None: omitted when None (omit_defaults).
_DEFAULTED = frozenset(
    {
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    }
)


@dataclass(frozen=True, slots=True)
class WireFormat:
    """One vLLM release's encoding of events, batches and replay replies.

    Facts (vLLM source, releases 0.9-0.33):

    * up to 0.23 events are positional arrays, tag first; fields were appended:
      BlockStored ``[tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id]``
      (0.9), ``medium`` (0.10.2), ``lora_name`` (0.14), ``extra_keys`` (0.17),
      ``group_idx`` (0.20), ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``
      (0.22); BlockRemoved ``[tag, block_hashes]`` (0.9), ``medium`` (0.10.2),
      ``group_idx`` (0.20); AllBlocksCleared ``[tag]``;
    * from 0.24 events are maps ``{"type": tag, ...}``; later fields ``locality`` (0.26),
      ``ownership`` (0.29), ``session_id`` (0.30), ``lookahead_token_ids`` (0.33);
    * the structs are declared with ``omit_defaults``: fields declared with a default (every
      field from ``extra_keys`` on) are left out when at that default, which for arrays
      means trailing defaults are dropped; earlier fields have no default and are always
      sent, None included;
    * batches are ``[ts, events, data_parallel_rank]``; 0.9 sends ``[ts, events]``;
    * replay replies are ``[b"", seq, payload]`` up to 0.25 and ``[b"", topic, seq,
      payload]`` from 0.26.
    """

    release: str
    event_layout: Layout
    stored_fields: tuple[str, ...]
    removed_fields: tuple[str, ...]
    batch_has_rank: bool
    replay_has_topic: bool

    def event_to_wire(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> Any:
        """The msgpack-ready form (list or dict) of one event for this release."""
        if isinstance(event, BlockStored):
            tag, fields = "BlockStored", self.stored_fields
        elif isinstance(event, BlockRemoved):
            tag, fields = "BlockRemoved", self.removed_fields
        elif isinstance(event, AllBlocksCleared):
            tag, fields = "AllBlocksCleared", ()
        else:
            raise TypeError(f"not a KV-cache event: {event!r}")
        if self.event_layout is Layout.MAP:
            out: dict[str, Any] = {"type": tag}
            for name in fields:
                value = getattr(event, name, None)
                if value is None and name in _DEFAULTED:
                    continue
                out[name] = value
            return out
        items: list[Any] = [tag, *(getattr(event, name, None) for name in fields)]
        while len(items) > 1 and items[-1] is None and fields[len(items) - 2] in _DEFAULTED:
            items.pop()
        return items

    def batch_to_wire(
        self,
        events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared],
        ts: float,
        rank: int | None,
    ) -> list[Any]:
        """The msgpack-ready ``[ts, events(, rank)]`` of one batch for this release."""
        wire_events = [self.event_to_wire(e) for e in events]
        if self.batch_has_rank and rank is not None:
            return [float(ts), wire_events, rank]
        return [float(ts), wire_events]

    def encode_batch(
        self,
        events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared],
        ts: float,
        rank: int | None = 0,
    ) -> bytes:
        """The payload frame this release would publish for these events."""
        return _ENCODER.encode(self.batch_to_wire(events, ts, rank))


_ENCODER = msgspec.msgpack.Encoder()


def _release(
    name: str,
    stored_extra: Sequence[str],
    removed: Sequence[str],
    layout: Layout,
    *,
    rank: bool = True,
    replay_topic: bool = False,
) -> WireFormat:
    return WireFormat(
        release=name,
        event_layout=layout,
        stored_fields=_STORED_BASE + tuple(stored_extra),
        removed_fields=("block_hashes", *removed),
        batch_has_rank=rank,
        replay_has_topic=replay_topic,
    )


_A, _M = Layout.ARRAY, Layout.MAP
_S_0102 = ("medium",)
_S_014 = (*_S_0102, "lora_name")
_S_017 = (*_S_014, "extra_keys")
_S_020 = (*_S_017, "group_idx")
_S_022 = (*_S_020, "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_S_026 = (*_S_022, "locality")
_S_029 = (*_S_026, "ownership")
_S_030 = (*_S_029, "session_id")
_S_033 = (*_S_030, "lookahead_token_ids")
_R_0102 = ("medium",)
_R_020 = (*_R_0102, "group_idx")
_R_026 = (*_R_020, "locality")
_R_029 = (*_R_026, "ownership")

#: Every release whose wire format differs from the one before it, oldest first.
RELEASES: tuple[WireFormat, ...] = (
    _release("0.9", (), (), _A, rank=False),
    _release("0.10.2", _S_0102, _R_0102, _A),
    _release("0.14", _S_014, _R_0102, _A),
    _release("0.17", _S_017, _R_0102, _A),
    _release("0.20", _S_020, _R_020, _A),
    _release("0.22", _S_022, _R_020, _A),
    _release("0.24", _S_022, _R_020, _M),
    _release("0.26", _S_026, _R_026, _M, replay_topic=True),
    _release("0.29", _S_029, _R_029, _M, replay_topic=True),
    _release("0.30", _S_030, _R_029, _M, replay_topic=True),
    _release("0.33", _S_033, _R_029, _M, replay_topic=True),
)

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+\-]?[A-Za-z0-9.+\-]*)?$")


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.10.2"`` → ``(0, 10, 2)``; a missing patch is 0, a pre/local suffix is ignored."""
    match = _VERSION.match(version.strip())
    if match is None:
        raise ValueError(f"not a vLLM version: {version!r} (expected X.Y or X.Y.Z)")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def wire_format(version: str) -> WireFormat:
    """The wire format of vLLM ``version``: that of the newest listed release <= it."""
    wanted = parse_version(version)
    chosen = None
    for fmt in RELEASES:
        if parse_version(fmt.release) <= wanted:
            chosen = fmt
    if chosen is None:
        raise ValueError(f"vLLM {version} predates KV events over ZMQ (0.9 is the oldest)")
    return chosen

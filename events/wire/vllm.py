"""vLLM KV-cache event structs, as every vLLM release from 0.9 to 0.33 puts them on the wire.

The schema is the types: one decoder call turns a payload into typed structs, and the
decoder is the validator. Events come in two layouts (:class:`Layout`); msgspec cannot
put array-like and map-like structs in one union, so each has its own struct family, the
map structs subclassing the array ones, so ``isinstance(event, BlockStored)`` holds for
both and consumers never see the layout. A batch is ``[ts, events, data_parallel_rank]``,
a positional array in every release so far; a batch sent as a map with those keys
decodes too, so a future vLLM that drops ``array_like`` from its ``EventBatch`` keeps
working. Fields kvindex does not use are left out: msgspec ignores unknown map keys and
extra trailing array items, so newer vLLM fields never break decoding.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

#: A block hash as vLLM publishes it: a uint64 (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``,
#: the default) or the raw digest bytes (``=0``). Only the lower bound is checked: msgpack
#: has no integer above 2**64 - 1, and msgspec rejects an ``le`` bound beyond int64 at
#: decoder construction (msgspec 0.19-0.22).
BlockHash = Annotated[int, msgspec.Meta(ge=0)] | bytes

#: The most block hashes one event may carry. A scheduler step stores at most
#: max_num_batched_tokens / block_size blocks (a few thousand); anything near this bound
#: is corrupt or hostile, and applying it would stall every other pod.
MAX_HASHES_PER_EVENT = 65_536

_U64_MASK = 2**64 - 1


class Layout(enum.Enum):
    """How a vLLM release lays out events inside a batch.

    The two layouts:

    * up to vLLM 0.23 each event is a positional msgpack array with its tag first
      (``["BlockStored", hashes, parent, ...]``); fields were appended over releases
      (medium 0.10.2, lora_name 0.14, extra_keys 0.17, group_idx 0.20, spec kind/window
      0.22) and trailing fields at their default may be omitted;
    * from vLLM 0.24 each event is a msgpack map with a ``"type"`` key, fields at their
      default omitted, and new fields added since (locality 0.26, ownership 0.29,
      session_id 0.30, lookahead_token_ids 0.33).
    """

    ARRAY = "array"  # vLLM <= 0.23
    MAP = "map"  # vLLM >= 0.24


class KVCacheEvent(msgspec.Struct, tag=True, array_like=True, frozen=True, gc=False):
    """Base of the array-layout events (vLLM <= 0.23); the tag is the first item."""


class BlockStored(KVCacheEvent, tag="BlockStored"):
    """Blocks newly cached by an engine, in prefix order.

    ``token_ids`` covers exactly the new full blocks; ``parent_block_hash`` is the block
    before the first new one (None at the start of a sequence). CPU-offload events may be
    placeholders with ``token_ids=[]`` and ``block_size=0``.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None  # 0.10.2
    lora_name: str | None = None  # 0.14
    extra_keys: list[Any] | None = None  # 0.17: one entry (tuple or None) per block
    group_idx: int | None = None  # 0.20
    kv_cache_spec_kind: str | None = None  # 0.22
    kv_cache_spec_sliding_window: int | None = None  # 0.22
    #: "LOCAL" or "REMOTE" relative to the publisher (0.26, map layout only; set by KV
    #: offloading tiers). None: unspecified, i.e. the engine's own cache.
    locality: str | None = None


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    """Blocks an engine evicted from one medium (and, since 0.20, one KV-cache group)."""

    block_hashes: list[BlockHash]
    medium: str | None = None  # 0.10.2
    group_idx: int | None = None  # 0.20
    locality: str | None = None  # 0.26, as on BlockStored


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    """The engine dropped its whole prefix cache (reset_prefix_cache, sleep, ...)."""


class BlockStoredMap(BlockStored, array_like=False, tag_field="type", tag="BlockStored"):
    """BlockStored in the map layout of vLLM >= 0.24.

    ``session_id`` (0.30; only maps carry it, so an array event's extra trailing items
    stay ignored): the client session of the request that stored, or under report mode
    "full" reused, these blocks - vLLM's ``Request.session_id``, from the request's
    ``session_id``, header ``X-Session-ID`` or ``vllm_xargs.session_id``. Not ownership:
    other sessions may share the blocks."""

    session_id: str | None = None


class BlockRemovedMap(BlockRemoved, array_like=False, tag_field="type", tag="BlockRemoved"):
    """BlockRemoved in the map layout of vLLM >= 0.24."""


class AllBlocksClearedMap(
    AllBlocksCleared, array_like=False, tag_field="type", tag="AllBlocksCleared"
):
    """AllBlocksCleared in the map layout of vLLM >= 0.24."""


_EMPTY_ARRAY = msgspec.Raw(b"\x90")


class ReceivedBlockStored(BlockStored, tag="BlockStored"):
    """BlockStored as decoded off the wire: ``token_ids`` stays raw msgpack.

    Turning 512 token ids into Python ints is two thirds of the cost of decoding a
    32-block event, and only sampled hash checks and token-key mode read them, so they
    are decoded on demand by :func:`tokens_of` (and validated then).
    """

    token_ids: msgspec.Raw = _EMPTY_ARRAY  # type: ignore[assignment]


class ReceivedBlockStoredMap(BlockStoredMap, tag="BlockStored"):
    """BlockStoredMap as decoded off the wire (see :class:`ReceivedBlockStored`)."""

    token_ids: msgspec.Raw = _EMPTY_ARRAY  # type: ignore[assignment]


Event = BlockStored | BlockRemoved | AllBlocksCleared
_ArrayEvent = ReceivedBlockStored | BlockRemoved | AllBlocksCleared
_MapEvent = ReceivedBlockStoredMap | BlockRemovedMap | AllBlocksClearedMap


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One scheduler step's events: ``[ts, events, data_parallel_rank]``.

    ``ts`` is the engine's wall clock (seconds) when the batch was made; releases before
    data parallelism omit the rank.
    """

    ts: float
    events: list[Event]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0)] | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0)] | None = None


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0)] | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0)] | None = None


# The same three as msgpack maps (``{"ts": .., "events": [..], "data_parallel_rank": ..}``),
# should vLLM ever drop ``array_like`` from its EventBatch the way 0.24 did for events.
#: The typed decodes of a batch (array envelope) and of one event, per event layout: what
#: the compiled scanner's batches decode their events with (events/wire/scanned.py).
BATCH_TYPES = {Layout.ARRAY: _ArrayBatch, Layout.MAP: _MapBatch}
EVENT_TYPES = {Layout.ARRAY: _ArrayEvent, Layout.MAP: _MapEvent}


class _ArrayBatchAsMap(_ArrayBatch, array_like=False):
    pass


class _MapBatchAsMap(_MapBatch, array_like=False):
    pass


class _RawBatchAsMap(_RawBatch, array_like=False):
    pass


#: First bytes of a msgpack map (fixmap, map 16, map 32).
_MAP_MARKERS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])


def envelope_is_map(payload: bytes) -> bool:
    """True when a payload's batch envelope is a msgpack map rather than an array.

    vLLM 0.9-0.33 always sends ``EventBatch`` as a positional array (``array_like=True``);
    its event structs switched from arrays to maps in 0.24, so the envelope may follow.
    One byte says which, so both decode at full speed without trying one and then the
    other.
    """
    return payload[:1] != b"" and payload[0] in _MAP_MARKERS


#: Highest data-parallel rank accepted by :class:`BatchEnvelope`; a larger one is corrupt
#: input and would otherwise open a bogus stream.
MAX_DP_RANK = 4095


class BatchEnvelope(msgspec.Struct, array_like=True, gc=False):
    """``[ts, events, data_parallel_rank]`` with the events left undecoded.

    Cheap to decode (the event list is skipped over, not parsed): enough to route a
    payload to its stream - in bind mode the rank inside the payload is the only way to
    tell a pod's data-parallel ranks apart - before the full decode.
    """

    ts: float
    events: msgspec.Raw
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_DP_RANK)] | None = None


class _BatchEnvelopeAsMap(BatchEnvelope, array_like=False):
    """:class:`BatchEnvelope` sent as a map; unknown keys are ignored."""


class NestedTooDeep(msgspec.DecodeError):
    """A payload nested deeper than msgspec decodes (it raises RecursionError): a few
    hundred bytes of ``0x91`` do it, and no vLLM batch nests more than four deep."""

    reason = "too_deeply_nested"


def decode_bounded(decoder: msgspec.msgpack.Decoder, payload: bytes) -> Any:
    """``decoder.decode(payload)``, with a payload nested too deep for it a
    :class:`NestedTooDeep` (a ``msgspec.DecodeError``) like any other undecodable one."""
    try:
        return decoder.decode(payload)
    except RecursionError:
        raise NestedTooDeep("payload nested too deeply") from None


class EnvelopeDecoder:
    """Decodes a payload's :class:`BatchEnvelope`, whether the batch is an array or a map.

    Raises ``msgspec.DecodeError`` (``ValidationError`` for well-formed msgpack of the
    wrong shape, :class:`NestedTooDeep` for msgpack nested too deep) like a plain msgspec
    decoder.
    """

    def __init__(self) -> None:
        self._array = msgspec.msgpack.Decoder(BatchEnvelope)
        self._map = msgspec.msgpack.Decoder(_BatchEnvelopeAsMap)

    def decode(self, payload: bytes) -> BatchEnvelope:
        return decode_bounded(self._map if envelope_is_map(payload) else self._array, payload)


_KNOWN_TAGS = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class DecodeError(ValueError):
    """A payload that yields no usable batch; ``reason`` is a short metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class DecodedBatch(msgspec.Struct, gc=False):
    """A decoded batch plus what was skipped inside it (``reason -> count``).

    ``batch`` is an EventBatch, or a :class:`~kvindex.events.wire.scanned.ScannedBatch`
    standing in for one (read by the compiled scanner; nothing skipped).
    """

    batch: Any  # EventBatch | ScannedBatch (scanned.py imports this module)
    layout: Layout
    skipped: dict[str, int] = {}


class BatchDecoder:
    """Decodes payloads of either layout, fast path first.

    The fast path is one msgspec call for the layout the caller saw last from the same
    stream (a stream never switches layout unless its engine is upgraded). Only when
    both layouts fail does the slow path run: it decodes events one at a time so one
    unknown or malformed event costs that event, not the batch around it.
    """

    def __init__(self) -> None:
        # (event layout, envelope is a map) -> decoder
        self._decoders = {
            (Layout.ARRAY, False): msgspec.msgpack.Decoder(_ArrayBatch),
            (Layout.MAP, False): msgspec.msgpack.Decoder(_MapBatch),
            (Layout.ARRAY, True): msgspec.msgpack.Decoder(_ArrayBatchAsMap),
            (Layout.MAP, True): msgspec.msgpack.Decoder(_MapBatchAsMap),
        }
        self._raw = {
            False: msgspec.msgpack.Decoder(_RawBatch),
            True: msgspec.msgpack.Decoder(_RawBatchAsMap),
        }
        self._array_event = msgspec.msgpack.Decoder(_ArrayEvent)
        self._map_event = msgspec.msgpack.Decoder(_MapEvent)
        self._tag_probe = msgspec.msgpack.Decoder(Any)

    def decode(self, payload: bytes, prefer: Layout = Layout.ARRAY) -> DecodedBatch:
        """Decode one payload; raise DecodeError when nothing in it is usable."""
        as_map = envelope_is_map(payload)
        try:
            batch = decode_bounded(self._decoders[prefer, as_map], payload)
            layout = prefer
        except NestedTooDeep as exc:  # so is the event-by-event path: no point trying it
            raise DecodeError(exc.reason, str(exc)) from None
        except msgspec.DecodeError:
            layout = Layout.MAP if prefer is Layout.ARRAY else Layout.ARRAY
            try:
                batch = decode_bounded(self._decoders[layout, as_map], payload)
            except msgspec.DecodeError:
                return self._decode_event_by_event(payload, as_map)
        # Each hash takes at least one byte: a smaller payload cannot hold an oversized event
        oversized = len(payload) > MAX_HASHES_PER_EVENT and _count_oversized(batch.events)
        if oversized:
            batch.events = [e for e in batch.events if _size_ok(e)]
            return DecodedBatch(_as_batch(batch), layout, {"too_many_hashes": oversized})
        return DecodedBatch(_as_batch(batch), layout)

    def _decode_event_by_event(self, payload: bytes, as_map: bool) -> DecodedBatch:
        try:
            raw = decode_bounded(self._raw[as_map], payload)
        except NestedTooDeep as exc:
            raise DecodeError(exc.reason, str(exc)) from None
        except msgspec.ValidationError as exc:
            raise DecodeError("invalid_batch", str(exc)) from None
        except msgspec.DecodeError as exc:
            raise DecodeError("malformed_msgpack", str(exc)) from None
        skipped: dict[str, int] = {}
        events: list[Event] = []
        layout = Layout.ARRAY
        for item in raw.events:
            event, reason = self._decode_one(item)
            if event is None:
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            if not _size_ok(event):
                skipped["too_many_hashes"] = skipped.get("too_many_hashes", 0) + 1
                continue
            if isinstance(event, BlockStoredMap | BlockRemovedMap | AllBlocksClearedMap):
                layout = Layout.MAP
            events.append(event)
        batch = EventBatch(raw.ts, events, raw.data_parallel_rank)
        return DecodedBatch(batch, layout, skipped)

    def _decode_one(self, item: msgspec.Raw) -> tuple[Event | None, str]:
        for decoder in (self._array_event, self._map_event):
            try:
                return decode_bounded(decoder, item), ""
            except msgspec.DecodeError:
                continue
        try:
            value = decode_bounded(self._tag_probe, item)
        except NestedTooDeep as exc:
            return None, exc.reason
        except msgspec.DecodeError:
            return None, "invalid_event"
        tag = None
        if isinstance(value, list) and value:
            tag = value[0]
        elif isinstance(value, dict):
            tag = value.get("type")
        if isinstance(tag, str) and tag not in _KNOWN_TAGS:
            return None, "unknown_event_type"
        return None, "invalid_event"


def _size_ok(event: Event) -> bool:
    hashes = getattr(event, "block_hashes", None)
    return hashes is None or len(hashes) <= MAX_HASHES_PER_EVENT


def _count_oversized(events: list[Event]) -> int:
    return sum(1 for e in events if not _size_ok(e))


def _as_batch(batch: _ArrayBatch | _MapBatch) -> EventBatch:
    return EventBatch(batch.ts, batch.events, batch.data_parallel_rank)


_TOKENS = msgspec.msgpack.Decoder(list[int])


def tokens_of(event: BlockStored) -> list[int]:
    """An event's token ids, decoding them when they arrived raw off the wire.

    Raises DecodeError (reason ``invalid_token_ids``) when they are not a list of ints.
    """
    tokens = event.token_ids
    if type(tokens) is not msgspec.Raw:
        return tokens
    try:
        return _TOKENS.decode(tokens)
    except msgspec.DecodeError as exc:
        raise DecodeError("invalid_token_ids", str(exc)) from None


def hash_to_int(block_hash: int | bytes) -> int:
    """The uint64 vLLM publishes for a digest: its last 8 bytes, big-endian."""
    if type(block_hash) is int:
        return block_hash
    return int.from_bytes(block_hash, "big") & _U64_MASK


def hashes_to_ints(block_hashes: list[int | bytes]) -> list[int]:
    """Block hashes as uint64s; the common all-int list is returned as is."""
    for h in block_hashes:
        if type(h) is not int:
            return [hash_to_int(x) for x in block_hashes]
    return block_hashes  # type: ignore[return-value]

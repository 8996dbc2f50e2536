"""SGLang KV-cache events, decoded into the structs vLLM's decode gives.

SGLang publishes vLLM's framing but its own events (the facts, by release, are in
:class:`SglangBatchDecoder`): about half its hashes are negative, and position 7 of an
array event is a map where vLLM has ``lora_name``, so vLLM's decoder rejects or misreads
them. The structs here accept both engines' events and :func:`normalise` turns each into
the vLLM structs ingest knows: a hash becomes its uint64 bits, ``CPU_PINNED`` the ``CPU``
tier and ``DISK`` the ``STORAGE`` tier, an ``EXTERNAL`` store (a pool shared by every
instance) ``locality="REMOTE"``, and the salt of a chain's first store a bare
``extra_keys`` item on its first block, as vLLM <= 0.30 sends it. SGLang's hashes are
opaque ids, so a model with SGLang pods is keyed by token content (``key_mode: tokens``).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvindex.events.wire.vllm import (
    MAX_HASHES_PER_EVENT,
    AllBlocksCleared,
    AllBlocksClearedMap,
    BlockRemoved,
    DecodedBatch,
    DecodeError,
    EventBatch,
    Layout,
    ReceivedBlockStored,
    decode_bounded,
    envelope_is_map,
)

_U64_MASK = 2**64 - 1

#: A block hash of either engine: a signed int64 (SGLang), a uint64 (vLLM) or digest
#: bytes (vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
AnyHash = Annotated[int, msgspec.Meta(ge=-(2**63))] | bytes

#: SGLang's storage media, as the tiers kvindex indexes (None: not indexed here).
_MEDIA = {"CPU_PINNED": "CPU", "DISK": "STORAGE"}
_EXTERNAL = "EXTERNAL"


class SglangBlockStored(ReceivedBlockStored, tag="BlockStored"):
    """A store as ingest sees it, with the session that caused it (SGLang >= 0.5.20: the
    request's ``session_id``, a field of SGLang's OpenAI bodies; no header)."""

    session_id: str | None = None


class _Metadata(msgspec.Struct, gc=False):
    cache_salt: str | None = None


class _ArrayStored(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    """vLLM <= 0.23 and SGLang <= 0.5.19 array stores; position 7 tells them apart."""

    block_hashes: list[AnyHash]
    parent_block_hash: AnyHash | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name_or_metadata: str | _Metadata | None = None  # vLLM lora_name | SGLang metadata
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[AnyHash]
    medium: str | None = None
    group_idx: int | None = None


class _MapStored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    block_hashes: list[AnyHash]
    parent_block_hash: AnyHash | None = None
    token_ids: msgspec.Raw = msgspec.Raw(b"\x90")
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    cache_salt: str | None = None  # SGLang
    session_id: str | None = None  # SGLang 0.5.20, vLLM 0.30


class _MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    block_hashes: list[AnyHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


_ArrayEvent = _ArrayStored | _ArrayRemoved | AllBlocksCleared
_MapEvent = _MapStored | _MapRemoved | AllBlocksClearedMap


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


def _hashes(values: list[int | bytes]) -> list[int | bytes]:
    return [h & _U64_MASK if type(h) is int and h < 0 else h for h in values]


def _hash(value: int | bytes | None) -> int | bytes | None:
    return value & _U64_MASK if type(value) is int and value < 0 else value


def _stored(
    e: _ArrayStored | _MapStored, lora_name: str | None, salt: str | None, session: str | None
) -> SglangBlockStored:
    medium = e.medium
    locality = getattr(e, "locality", None)
    if medium == _EXTERNAL:
        medium, locality = None, "REMOTE"
    else:
        medium = _MEDIA.get(medium, medium)  # type: ignore[arg-type]
    extra_keys = e.extra_keys
    if extra_keys is None and salt is not None and e.parent_block_hash is None:
        # vLLM <= 0.30's form: the salt, bare, on the chain's first block only
        extra_keys = [[lora_name, salt] if lora_name else [salt]]
        extra_keys += [None] * (len(e.block_hashes) - 1)
    return SglangBlockStored(
        _hashes(e.block_hashes),
        _hash(e.parent_block_hash),
        e.token_ids,  # type: ignore[arg-type]  # raw: decoded on demand (tokens_of)
        e.block_size,
        e.lora_id,
        medium,
        lora_name,
        extra_keys,
        e.group_idx,
        e.kv_cache_spec_kind,
        e.kv_cache_spec_sliding_window,
        locality,
        session_id=session,
    )


def _removed(e: _ArrayRemoved | _MapRemoved) -> BlockRemoved:
    medium, locality = e.medium, getattr(e, "locality", None)
    if medium == _EXTERNAL:
        medium, locality = None, "REMOTE"
    else:
        medium = _MEDIA.get(medium, medium)  # type: ignore[arg-type]
    return BlockRemoved(_hashes(e.block_hashes), medium, e.group_idx, locality)


def normalise(event: Any) -> Any:
    """One decoded event of either engine as the vLLM structs ingest reads."""
    if isinstance(event, _MapStored):
        return _stored(event, event.lora_name, event.cache_salt, event.session_id)
    if isinstance(event, _ArrayStored):
        slot = event.lora_name_or_metadata
        if isinstance(slot, _Metadata):
            return _stored(event, None, slot.cache_salt, None)
        return _stored(event, slot, None, None)
    if isinstance(event, _ArrayRemoved | _MapRemoved):
        return _removed(event)
    return event  # AllBlocksCleared


#: The topic of SGLang's load socket (``LOAD_TOPIC``, 0.5.23), advertised with its port
#: base in ``/server_info`` (``kv_events.load_endpoint_port_base``; rank r on base + r).
LOAD_TOPIC = b"load"


class LoadStat(msgspec.Struct, tag="LoadStat", array_like=True, frozen=True, gc=False):
    """One scheduler's load gauge on SGLang's load topic (0.5.23 ``LoadStat``: a tagged
    positional array, fields appended over releases; the first six are the ones every
    release sends)."""

    num_running_reqs: Annotated[int, msgspec.Meta(ge=0)]
    num_waiting_reqs: Annotated[int, msgspec.Meta(ge=0)]
    num_tokens: Annotated[int, msgspec.Meta(ge=0)]  # KV tokens in use
    max_total_num_tokens: Annotated[int, msgspec.Meta(ge=0)]  # KV capacity; 0: unknown
    attn_dp_rank: int | None = None
    num_waiting_uncached_tokens: int = 0

    @property
    def kv_usage(self) -> float | None:
        """The fraction of KV capacity in use (None when the capacity is unknown)."""
        if not self.max_total_num_tokens:
            return None
        return min(1.0, self.num_tokens / self.max_total_num_tokens)


_LOAD = msgspec.msgpack.Decoder(LoadStat)


def decode_load(payload: bytes) -> LoadStat:
    """A load topic payload; raises DecodeError (``invalid_load``) when it is not one."""
    try:
        return decode_bounded(_LOAD, payload)
    except msgspec.DecodeError as exc:
        raise DecodeError("invalid_load", str(exc)) from None


#: The most load sockets one pod may advertise (its DP ranks): far above any deployment,
#: a bound on the sockets a broken descriptor can make kvindex open.
MAX_LOAD_RANKS = 1024


class _KvEventsDescriptor(msgspec.Struct, gc=False):
    """The ``kv_events`` block of SGLang's ``/server_info`` (0.5.23,
    ``runtime_context.describe_kv_events_publisher``), the keys read here: the load range
    is advertised only when the pod runs with ``--load-publish-endpoint``."""

    dp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_LOAD_RANKS)] = 1
    load_endpoint_port_base: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    load_topic: str | None = None


class _ServerInfo(msgspec.Struct, gc=False):
    kv_events: _KvEventsDescriptor | None = None


_SERVER_INFO = msgspec.json.Decoder(_ServerInfo)


def load_endpoints(server_info: bytes, host: str) -> list[str]:
    """The load sockets a pod's ``/server_info`` body advertises, rank r's at index r:
    ``tcp://<host>:<load_endpoint_port_base + r>`` for each of its ``dp_size`` ranks,
    ``host`` being the pod's own (SGLang advertises a bind wildcard there); empty when
    the pod publishes no load. Raises DecodeError (``invalid_server_info``) for a body
    that is not SGLang's descriptor."""
    try:
        info = _SERVER_INFO.decode(server_info)
    except msgspec.DecodeError as exc:
        raise DecodeError("invalid_server_info", str(exc)) from None
    except RecursionError:
        raise DecodeError("invalid_server_info", "nested too deeply") from None
    kv = info.kv_events
    if kv is None or kv.load_endpoint_port_base is None:
        return []
    if kv.load_topic is not None and kv.load_topic != LOAD_TOPIC.decode():
        raise DecodeError("invalid_server_info", f"load_topic {kv.load_topic!r} is not 'load'")
    base = kv.load_endpoint_port_base
    if base + kv.dp_size - 1 > 65535:
        raise DecodeError("invalid_server_info", f"load ports from {base} pass 65535")
    return [f"tcp://{host}:{base + rank}" for rank in range(kv.dp_size)]


class SglangBatchDecoder:
    """:class:`~kvindex.events.wire.vllm.BatchDecoder`'s contract for models served by SGLang
    pods (alone or beside vLLM ones): same skip reasons, events normalised.

    SGLang publishes vLLM's framing (three ZMQ frames, ``[ts, events, attn_dp_rank]``,
    replay replies ``[b"", topic, seq, payload]``), but its events differ. Facts, read in
    the released wheels (``sglang/srt/disaggregation/kv_events.py``):

    * 0.4.9-0.5.5: array events ``[tag, block_hashes, parent_block_hash, token_ids,
      block_size, lora_id]``, ``["BlockRemoved", block_hashes]``; a block's hash is Python's
      ``hash(tuple(page_tokens))`` (a signed int64 of that page alone, not chained);
    * 0.5.10-0.5.17: ``medium`` appended to both (``GPU``, ``CPU_PINNED``; 0.5.15 adds
      ``DISK`` and ``EXTERNAL``); hashes are the first 8 bytes of a SHA-256 page chain as a
      **signed** int64;
    * 0.5.18-0.5.19: a salted store appends ``metadata: {"cache_salt": str}`` at position 7;
    * 0.5.20 on: map events (``{"type": tag, ...}``, fields at their default left out) with
      ``cache_salt`` and ``session_id``; 0.5.23 adds ``lora_name``.
    """

    def __init__(self) -> None:
        self._batches = {
            Layout.ARRAY: msgspec.msgpack.Decoder(_ArrayBatch),
            Layout.MAP: msgspec.msgpack.Decoder(_MapBatch),
        }
        self._raw = msgspec.msgpack.Decoder(_RawBatch)
        self._events = (
            msgspec.msgpack.Decoder(_ArrayEvent),
            msgspec.msgpack.Decoder(_MapEvent),
        )
        self._probe = msgspec.msgpack.Decoder(Any)

    def decode(self, payload: bytes, prefer: Layout = Layout.MAP) -> DecodedBatch:
        """Decode one payload; raise DecodeError when nothing in it is usable."""
        if envelope_is_map(payload):  # no release of either engine sends one
            raise DecodeError("invalid_batch", "SGLang batches are arrays")
        other = Layout.ARRAY if prefer is Layout.MAP else Layout.MAP
        for layout in (prefer, other):
            try:
                batch = decode_bounded(self._batches[layout], payload)
            except msgspec.DecodeError:
                continue
            if all(_size_ok(e) for e in batch.events):
                events = [normalise(e) for e in batch.events]
                return DecodedBatch(EventBatch(batch.ts, events, batch.data_parallel_rank), layout)
            break
        return self._event_by_event(payload)

    def events(self, payload: bytes) -> list[Any]:
        """A payload's events, normalised (for a batch the scanner already read whole)."""
        return list(self.decode(payload).batch.events)

    def _event_by_event(self, payload: bytes) -> DecodedBatch:
        try:
            raw = decode_bounded(self._raw, payload)
        except msgspec.ValidationError as exc:
            raise DecodeError("invalid_batch", str(exc)) from None
        except msgspec.DecodeError as exc:
            reason = getattr(exc, "reason", "malformed_msgpack")
            raise DecodeError(reason, str(exc)) from None
        skipped: dict[str, int] = {}
        events = []
        layout = Layout.ARRAY
        for item in raw.events:
            event, reason = self._one(item)
            if event is not None and not _size_ok(event):
                event, reason = None, "too_many_hashes"
            if event is None:
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            if isinstance(event, _MapStored | _MapRemoved | AllBlocksClearedMap):
                layout = Layout.MAP
            events.append(normalise(event))
        batch = EventBatch(raw.ts, events, raw.data_parallel_rank)
        return DecodedBatch(batch, layout, skipped)

    def _one(self, item: msgspec.Raw) -> tuple[Any, str]:
        for decoder in self._events:
            try:
                return decode_bounded(decoder, item), ""
            except msgspec.DecodeError:
                continue
        try:
            value = decode_bounded(self._probe, item)
        except msgspec.DecodeError as exc:
            return None, getattr(exc, "reason", "invalid_event")
        tag = value[0] if isinstance(value, list) and value else None
        if isinstance(value, dict):
            tag = value.get("type")
        known = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
        if isinstance(tag, str) and tag not in known:
            return None, "unknown_event_type"
        return None, "invalid_event"


def _size_ok(event: Any) -> bool:
    hashes = getattr(event, "block_hashes", None)
    return hashes is None or len(hashes) <= MAX_HASHES_PER_EVENT

"""The client sessions a batch's GPU stores were made for.

vLLM (0.30+) and SGLang (0.5.20+) put the session of the request that caused a
``BlockStored`` on the event (``session_id``, map layout only, left out when the request
had none). Which pod computed a session's latest turn is then the pod whose stream last
carried a GPU store for it. Only GPU stores count: a CPU or storage copy is an offload,
not a turn computed there, and a ``REMOTE`` one (a pool every instance shares) says
nothing about one pod.

The compiled scanner does not read the field (its runs group events across sessions), so
a scanned payload is read again here with a decoder that keeps only the fields this
needs, and only when its bytes hold the key at all: engines whose clients send no
session pay a substring search per payload.
"""

from __future__ import annotations

import msgspec

from kvindex.events.wire.scanned import ScannedBatch
from kvindex.events.wire.vllm import BlockStored, EventBatch, decode_bounded

#: The longest session id kept (longer ones are ignored): ``/route`` refuses longer ones,
#: and the map of sessions stays bounded in bytes as well as in entries.
MAX_SESSION_ID_CHARS = 256

_KEY = b"session_id"
_GPU = (None, "GPU")  # vLLM's and SGLang's names for the device tier (None: vLLM's default)
_REMOTE = "REMOTE"


class _EventSession(msgspec.Struct, gc=False):
    """A map-layout event (either engine), reduced to what says where a session ran."""

    type: str = ""
    medium: str | None = None
    locality: str | None = None
    session_id: str | None = None


class _SessionBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_EventSession]


_DECODER = msgspec.msgpack.Decoder(_SessionBatch)


def stored_sessions(batch: EventBatch | ScannedBatch) -> set[str]:
    """The session ids of the batch's GPU ``BlockStored`` events (none for batches
    without any: array-layout releases carry no session)."""
    if type(batch) is ScannedBatch:
        found: set[str] = set()
        for payload in batch.payloads:
            if _KEY in payload:
                found |= _payload_sessions(payload)
        return found
    found = set()
    for event in batch.events:
        # vLLM's map structs and SGLang's stores have the field; array structs do not
        session = getattr(event, "session_id", None)
        if (
            session
            and isinstance(event, BlockStored)
            and event.medium in _GPU
            and event.locality != _REMOTE
            and len(session) <= MAX_SESSION_ID_CHARS
        ):
            found.add(session)
    return found


def _payload_sessions(payload: bytes) -> set[str]:
    """The sessions of one payload's GPU stores; none when it is not a map-layout batch
    of that shape (the scanner took it, so only the fields read here can be wrong)."""
    try:
        events = decode_bounded(_DECODER, payload).events
    except msgspec.DecodeError:  # array-layout events, or a session id that is no string
        return set()
    return {
        event.session_id
        for event in events
        if event.session_id
        and event.type == "BlockStored"
        and event.medium in _GPU
        and event.locality != _REMOTE
        and len(event.session_id) <= MAX_SESSION_ID_CHARS
    }

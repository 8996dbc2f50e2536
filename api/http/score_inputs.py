"""The forms a ``/score`` or ``/route`` prompt arrives in, read and checked in one place.

Besides JSON with ``token_ids``, ``prompt`` or ``messages`` (see ``api/http/app.py``):
``block_hashes`` in the JSON body, the engine's own hashes of the prompt's full blocks,
for a gateway that already has them (it skips tokenizing and hashing): an int is the
uint64 vLLM publishes, a hex string that uint64 or a longer digest, both read as the
number's low 64 bits (``events/wire/vllm.py`` ``hash_to_int``); and a binary body
(``application/octet-stream``): the token ids as little-endian uint32s, the other
fields as query parameters, read as one array instead of parsed one integer at a time.
A form-urlencoded body (curl's ``-d`` default) is read as JSON; anything else is a 415.
The size limits are the JSON body's: ``--max-body-bytes`` and ``--max-prompt-tokens``
(for hashes, blocks times the model's block size).
"""

from __future__ import annotations

import array
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl

import msgspec

from kvindex.api.http.errors import JSON
from kvindex.api.http.schemas import ScoreRequest
from kvindex.events.errors import ClientError, NotFound, UnsupportedMediaType
from kvindex.indexer.keys import MmFeature
from kvindex.indexer.models import Engine, KeyMode

if TYPE_CHECKING:
    from kvindex.api.serve.service import Service

OCTET = "application/octet-stream"
FORM = "application/x-www-form-urlencoded"
PROMPT_FORMS = ("token_ids", "prompt", "messages", "block_hashes")
U64_MAX = 2**64 - 1
# What a binary request takes from its query string (where the request type has it).
QUERY_FIELDS = ("model", "pods", "lora_name", "cache_salt", "request_id", "max_tokens", "role")

_HEX = re.compile(r"(?:0[xX])?[0-9a-fA-F]{1,64}")  # also msgspec's pattern in schemas.py
_INT_ONLY = {int}
UINT32 = next(code for code in "IL" if array.array(code).itemsize == 4)
UINT64 = "Q"  # always 8 bytes; what the memory index's keys go through (table_layout.py)
# unsigned long when it is 64 bits (Linux, macOS): array('Q') converts through a slower
# generic path in CPython 3.11
_UINT64 = "L" if array.array("L").itemsize == 8 else None

R = TypeVar("R", bound=ScoreRequest)


# ``curl -d '{...}'`` labels its body form-urlencoded unless told otherwise; a body
# whose type claims nothing more specific is read as the JSON the user typed.
READ_AS_JSON = frozenset({None, "", JSON, FORM})


def body_media(declared: str | None) -> str:
    """The media type of a ``/score`` or ``/route`` body from its Content-Type header:
    JSON (also when absent, form-urlencoded as curl's ``-d`` sends, or any
    ``application/*+json``) or OCTET; anything else is a 415 saying how to fix it,
    decided before the body is read."""
    media = None if declared is None else declared.partition(";")[0].strip().lower()
    if media == OCTET:
        return OCTET
    if media in READ_AS_JSON or (
        media is not None and media.startswith("application/") and media.endswith("+json")
    ):
        return JSON
    raise UnsupportedMediaType(
        f"Content-Type {media!r}: send JSON (curl: -H 'content-type: application/json'), "
        "or application/octet-stream (token ids as little-endian uint32, the other "
        "fields as query parameters)"
    )


def parse_request(
    kind: type[R], media: str, query_string: bytes, body: bytes, decode_json: Callable[[bytes], R]
) -> R:
    """The body of a ``/score`` or ``/route`` request as ``kind``: JSON through
    ``decode_json``; OCTET as binary tokens with the fields in the query string (read as
    Starlette reads it: latin-1, blank values kept)."""
    if media == OCTET:
        query = parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
        return binary_request(kind, query, body)
    return decode_json(body)


def binary_request(kind: type[R], query: list[tuple[str, str]], body: bytes) -> R:
    """A request of ``kind`` from a binary body and its query parameters.

    ``pods`` may repeat and may list pods separated by commas; every other parameter is
    given at most once. The token ids are the body, so no prompt form is a parameter."""
    allowed = [name for name in QUERY_FIELDS if name in kind.__struct_fields__]
    fields: dict[str, Any] = {}
    for name, value in query:
        if name not in allowed:
            raise ClientError(
                f"query parameter {name!r} is not one a binary body takes "
                f"({', '.join(allowed)}); the body is the token ids"
            )
        if name == "pods":
            fields.setdefault("pods", []).extend(p for p in value.split(",") if p)
        elif name in fields:
            raise ClientError(f"query parameter {name!r} is given more than once")
        else:
            fields[name] = value
    if "model" not in fields:
        raise ClientError("a binary body needs the query parameter model (?model=NAME)")
    try:
        req = msgspec.convert(fields, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise ClientError(f"query parameters: {exc}") from None
    req.token_ids = binary_tokens(body)
    return req


def binary_tokens(body: bytes) -> array.array[int]:
    """Little-endian uint32 token ids; a body that is not whole uint32s is a 400.

    Kept as the array: everything after takes a sequence of ints, and the compiled hash
    chain reads the array's buffer without a Python int per token."""
    if len(body) % 4:
        raise ClientError(
            f"binary body of {len(body)} bytes is not a whole number of token ids "
            "(little-endian uint32, 4 bytes each)"
        )
    tokens = array.array(UINT32, body)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens


def prompt_form(req: ScoreRequest) -> str:
    """The one prompt form ``req`` gives; a 400 naming what it gave otherwise."""
    given = [name for name in PROMPT_FORMS if getattr(req, name) is not None]
    if len(given) != 1:
        raise ClientError(
            f"give exactly one of {', '.join(PROMPT_FORMS)}"
            + (f" (got {', '.join(given)})" if given else "")
        )
    return given[0]


#: Known models an unknown-model error names, and the characters it shows of each: the
#: rest are counted, so the answer stays small however many models the index holds.
_MODELS_NAMED = 20
_NAME_CHARS = 64


def require_known_model(service: Service, model: str) -> None:
    if not service.knows_model(model):
        known = service.known_models()
        named = ", ".join(_shortened(m) for m in known[:_MODELS_NAMED]) or "none yet"
        if len(known) > _MODELS_NAMED:
            named += f" and {len(known) - _MODELS_NAMED} more"
        raise NotFound(
            f"model {_shortened(model)!r} is neither configured (--model-config) nor seen "
            f"in any pod's events; known: {named}",
            code="unknown_model",
        )


def _shortened(name: str) -> str:
    return name if len(name) <= _NAME_CHARS else name[: _NAME_CHARS - 3] + "..."


def hashed_keys(service: Service, req: ScoreRequest, max_tokens: int) -> list[int]:
    """``req.block_hashes`` as index keys, checked: the only prompt form, a known model
    keyed by engine hashes, no lora_name or cache_salt (a precomputed hash already holds
    them), at most ``max_tokens`` worth of blocks, each hash a uint64."""
    prompt_form(req)
    require_known_model(service, req.model)
    if req.lora_name is not None or req.cache_salt is not None or req.mm_features is not None:
        raise ClientError(
            "lora_name, cache_salt and mm_features do not apply to block_hashes: the "
            "engine's hashes already include them; leave them out"
        )
    keying = service.catalog.keying(req.model)
    # SGLang gives a block the same (opaque) id on every pod: its ids name blocks
    published = Engine.SGLANG in keying.engines
    if keying.key_mode is not KeyMode.ENGINE and not published:
        raise ClientError(
            f"model {req.model!r} is indexed by token content (key mode "
            f"{keying.key_mode.value}), not by the engine's hashes: send token_ids"
        )
    hashes = req.block_hashes or []
    if not hashes:
        raise ClientError("block_hashes is empty")
    block_size = keying.hash.block_size
    if len(hashes) * block_size > max_tokens:
        raise ClientError(
            f"block_hashes has {len(hashes)} blocks ({len(hashes) * block_size} tokens at "
            f"block size {block_size}), more than the limit of {max_tokens} tokens "
            "(--max-prompt-tokens)"
        )
    if keying.key_mode is KeyMode.ENGINE:
        return block_keys(hashes)
    # Token-key mode: each published id becomes the content key of the block it names;
    # an id no pod published names no cached block, and is kept (it matches nothing)
    ids = block_keys(signed_as_uint64(hashes))
    return [
        own if own is not None else id_
        for id_, own in zip(ids, service.own_keys_of(ids), strict=True)
    ]


def signed_as_uint64(hashes: list[int | str] | array.array[int]) -> list[int | str]:
    """SGLang's published ids are signed int64s: each negative one as its uint64 bits
    (how the index holds them); anything below -2**63 is left for the range check."""
    return [
        h + 2**64 if type(h) is int and -(2**63) <= h < 0 else h  # type: ignore[operator]
        for h in hashes
    ]


def mm_features_of(req: ScoreRequest, prompt_tokens: int) -> tuple[MmFeature, ...]:
    """``req.mm_features`` as hash inputs, sorted by offset as vLLM keeps them; a 400
    when they reach past the prompt's ``prompt_tokens`` or overlap (vLLM gives each placeholder
    token to one item, and its hashing assumes so)."""
    items = req.mm_features
    if not items:
        return ()
    order = sorted(range(len(items)), key=lambda i: items[i].offset)
    features: list[MmFeature] = []
    previous = -1
    for i in order:
        item = items[i]
        end = item.offset + item.length
        if end > prompt_tokens:
            raise ClientError(
                f"mm_features[{i}]: placeholder tokens {item.offset}..{end - 1} run past "
                f"the prompt's {prompt_tokens} tokens"
            )
        if previous >= 0 and item.offset < features[-1].offset + features[-1].length:
            raise ClientError(
                f"mm_features[{i}] (offset {item.offset}, length {item.length}) overlaps "
                f"mm_features[{previous}] (offset {features[-1].offset}, length "
                f"{features[-1].length}); each placeholder token belongs to one item"
            )
        features.append(MmFeature(item.identifier, item.offset, item.length))
        previous = i
    return tuple(features)


def block_keys(hashes: list[int | str] | array.array[int]) -> list[int]:
    """Block hashes as the uint64 keys the index holds: ints as they are (0..2**64-1),
    hex strings as their low 64 bits (``hash_to_int``'s rule for a digest's bytes). An
    ``array('Q')`` (what ``api/http/json_tokens.py`` reads from a JSON body) is them already."""
    if type(hashes) is array.array and hashes.typecode == UINT64:
        return hashes  # type: ignore[return-value]
    if _UINT64 is not None and _INT_ONLY.issuperset(map(type, hashes[:1])):
        # One C pass checks type and range (CPython reads an unsigned long's digits in
        # a loop): half the time of a type set plus min() and max() at 512 hashes.
        try:
            array.array(_UINT64, hashes)
        except OverflowError:
            _bad_int(hashes)
        except TypeError:  # a hex string among the ints: the loop below
            pass
        else:
            return hashes  # type: ignore[return-value]
    elif set(map(type, hashes)) == _INT_ONLY:  # a C loop: half the time of all(genexpr)
        if min(hashes) < 0 or max(hashes) > U64_MAX:  # type: ignore[type-var]
            _bad_int(hashes)
        return hashes  # type: ignore[return-value]
    keys = []
    for i, h in enumerate(hashes):
        if type(h) is int:
            if not 0 <= h <= U64_MAX:
                _bad_int(hashes)
            keys.append(h)
        elif _HEX.fullmatch(h):  # type: ignore[arg-type]
            keys.append(int(h, 16) & U64_MAX)  # type: ignore[arg-type]
        else:  # the JSON decoder checks the pattern; a Python caller may not have
            raise ClientError(
                f"block_hashes[{i}]: {h[:80]!r} is not hex of 1 to 64 digits (0x optional)"
            )
    return keys


def _bad_int(hashes: list[int | str]) -> None:
    for i, h in enumerate(hashes):
        if type(h) is int and not 0 <= h <= U64_MAX:
            raise ClientError(f"block_hashes[{i}]: {h} is not a uint64 (0 to 2**64-1)")


def request_body(json_schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of ``/score`` and ``/route``: JSON, or binary tokens."""
    return {
        "required": True,
        "content": {
            JSON: {"schema": json_schema},
            OCTET: {
                "schema": {
                    "type": "string",
                    "format": "binary",
                    "description": "The prompt's token ids as little-endian uint32s, 4 "
                    "bytes each; the other fields are query parameters (model required).",
                }
            },
        },
    }


def binary_parameters(kind: type[ScoreRequest]) -> list[dict[str, Any]]:
    """The query parameters a binary body of ``kind`` takes, for the OpenAPI document
    (a JSON body ignores them)."""
    notes = {
        "model": "Binary body only (required there): the model, as the JSON field.",
        "pods": "Binary body only: candidate pods, repeated or comma-separated.",
    }
    return [
        {
            "name": name,
            "in": "query",
            "required": False,
            "description": notes.get(name, f"Binary body only: the JSON field {name}."),
            "schema": {"type": "array", "items": {"type": "string"}}
            if name == "pods"
            else {"type": "integer" if name == "max_tokens" else "string"},
            **({"style": "form", "explode": True} if name == "pods" else {}),
        }
        for name in QUERY_FIELDS
        if name in kind.__struct_fields__
    ]

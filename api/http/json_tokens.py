"""A JSON ``/score`` or ``/route`` body decoded with its ``token_ids`` (or ``block_hashes``)
read as native integers.

Why: msgspec makes a Python int of every token id, most of a long prompt's CPU, and the
compiled hash chain then reads them back one by one. The compiled reader
(``api/http/_json_tokens.c``, optional) reads the top-level array's digits straight into an
``array('I')`` of token ids (the binary body's form) or an ``array('Q')`` of hashes, and
msgspec decodes the rest of the body (the array replaced by ``null``) into the request
type. msgspec stays the reference: the reader takes only an array msgspec would decode
to the same values, and when msgspec refuses the rest the whole body is decoded again by
msgspec, so every error is msgspec's own. Without the compiled reader msgspec decodes
every body whole: the same answers and errors (``tests/test_json_tokens.py`` runs both).
"""

from __future__ import annotations

from array import array
from types import ModuleType
from typing import TypeVar

import msgspec

from kvindex.api.http.errors import decode_json
from kvindex.api.http.schemas import ScoreRequest
from kvindex.api.http.score_inputs import UINT32, UINT64

try:
    from kvindex.api.http import _json_tokens as _compiled
except ImportError:  # built without a compiler: msgspec decodes every body whole
    _compiled = None

#: The compiled reader, or None when msgspec decodes every body whole. Tests swap it.
reader: ModuleType | None = _compiled

R = TypeVar("R", bound=ScoreRequest)

# The fields the reader takes, with how their items are kept. (Searched for in the body
# first: a memchr-fast scan, even over 60 KB.)
_TOKENS, _HASHES = b'"token_ids"', b'"block_hashes"'


def implementation() -> str:
    """``"compiled"`` or ``"msgspec"``: how this process reads a JSON body's token ids
    and block hashes."""
    return "compiled" if reader is not None else "msgspec"


def decode_prompt(decoder: msgspec.json.Decoder[R], body: bytes) -> R:
    """``body`` as ``decoder``'s request type, every failure a 400 as
    :func:`kvindex.api.http.errors.decode_json` gives it; ``token_ids`` an ``array('I')``, or
    ``block_hashes`` an ``array('Q')``, when the compiled reader took them.

    The reader takes only what msgspec would decode to the same values: one JSON object,
    plain top-level keys, the field once, an array of plain non-negative integers up to
    2**32 - 1 (token ids) or 2**64 - 1 (hashes); for hashes also hex strings the schema's
    pattern takes, without escapes, read as their low 64 bits, as
    ``score_inputs.block_keys`` reads msgspec's strings."""
    core = reader
    if core is None or type(body) is not bytes:
        return decode_json(decoder, body)
    if _TOKENS in body:
        field, typecode = "token_ids", UINT32
    elif _HASHES in body:
        field, typecode = "block_hashes", UINT64
    else:
        return decode_json(decoder, body)
    found = core.split(body, field)
    if found is None:
        return decode_json(decoder, body)
    rest, items = found
    try:
        req = decoder.decode(rest)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return decode_json(decoder, body)  # the error msgspec gives for the whole body
    setattr(req, field, array(typecode, items))
    return req

"""A JSON body's token ids and block hashes read by the compiled reader give exactly what
msgspec gives.

``api/http/_json_tokens.c`` reads a ``/score`` or ``/route`` body's top-level ``token_ids``
(or ``block_hashes``) array into uint32s (uint64s) and msgspec decodes the rest. Every
body must come out as the pure msgspec decode of the whole body makes it: the same
request (the array as an ``array('I')`` / ``array('Q')`` of the same integers), or the
same error (kind, code and text). Checked on hand-made odd bodies, on
hypothesis-generated ones (valid requests in many spellings, and those mutated byte by
byte), and over HTTP: /score and /route answer alike with the reader and without.

The hypothesis tests are derandomized so every run checks the same examples.
"""

from __future__ import annotations

import json
import random
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex.api.http import json_tokens
from kvindex.api.http.app import create_app
from kvindex.api.http.json_tokens import decode_prompt
from kvindex.api.http.schemas import RouteRequest, ScoreRequest
from kvindex.api.http.score_inputs import block_keys
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from kvindex.api.testing import free_port
from kvindex.events.errors import KvindexError
from kvindex.events.ingest.testing import wait_until
from kvindex.events.wire.endpoints import from_source
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig

COMPILED = json_tokens.reader is not None
needs_reader = pytest.mark.skipif(not COMPILED, reason="api/http/_json_tokens.c is not built")
DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (ScoreRequest, RouteRequest)}
U32, U64 = 2**32 - 1, 2**64 - 1
FIELDS_READ = ("token_ids", "block_hashes")
ITEM_SIZE = {"token_ids": 4, "block_hashes": 8}


def outcome(kind: type[ScoreRequest], body: bytes, monkeypatch, compiled: bool) -> Any:
    """What decoding ``body`` gives: the request as builtins (arrays as lists), or the
    error's kind, code and text; and whether the compiled reader took an array.

    Block hashes are compared as the index keys they become (``block_keys``, what every
    reader of the field calls): msgspec keeps a hex hash as its string, the compiled
    reader as its low 64 bits, and a hash ``block_keys`` refuses is that error."""
    monkeypatch.setattr(json_tokens, "reader", json_tokens._compiled if compiled else None)
    try:
        req = decode_prompt(DECODERS[kind], body)
    except KvindexError as exc:
        return ("error", type(exc).__name__, exc.code, exc.detail), False
    took = False
    for field in FIELDS_READ:
        items = getattr(req, field)
        if isinstance(items, array):
            assert items.itemsize == ITEM_SIZE[field] and not took
            setattr(req, field, items.tolist())
            took = True
    if req.block_hashes is not None:
        try:
            req.block_hashes = block_keys(req.block_hashes)
        except KvindexError as exc:
            return ("error", type(exc).__name__, exc.code, exc.detail), took
    return ("ok", type(req).__name__, msgspec.to_builtins(req)), took


def same(body: bytes, monkeypatch, kind: type[ScoreRequest] = ScoreRequest) -> bool:
    """Assert the reader and msgspec agree on ``body``; whether the reader took it."""
    if COMPILED:  # the SSE2 reader and the byte-by-byte one (what runs without SSE2)
        for field in FIELDS_READ:
            split = json_tokens._compiled.split
            assert split(body, field) == split(body, field, False)
    fast, took = outcome(kind, body, monkeypatch, compiled=True)
    pure, pure_took = outcome(kind, body, monkeypatch, compiled=False)
    assert not pure_took
    assert fast == pure, body[:300]
    return took


# -- hand-made bodies ----------------------------------------------------------------------

TAKEN = [
    b'{"model":"m","token_ids":[1,2,3]}',
    b'{"model": "m", "token_ids": [1, 2, 3]}',
    b' \r\n\t{ "token_ids" :\n[ 0 ,\t4294967295 , 12345678 ,123456789,1234567890 ] , '
    b'"model":"m" } \n',
    b'{"token_ids":[],"model":"m"}',
    b'{"model":"m","token_ids":[0]}',
    b'{"model":"m","token_ids":[7],"pods":["127.0.0.1:8000"],"lora_name":null}',
    b'{"model":"m","token_ids":[1],"unknown":{"token_ids":[1,2]}}',  # rejected by msgspec
    b'{"model":"m","token_ids":[1],"pods":"not a list"}',
    b'{"model":"","token_ids":[1]}',
    b'{"model":"m","token_ids":[1],"block_hashes":[1]}',
    b'{"model":"m","token_ids":[1],"prompt":"a \\" \\\\ \\u00e9 [ ] { }"}',
    b'{"model":"m","messages":[{"role":"user","content":"]}"}],"token_ids":[5]}',
    b'{"model":"m","token_ids":[1],"model":"n"}',
    b'{"model":"m","token_ids":[1], "tools": [[[{"a": [1, {"b": "]"}]}]]]}',
    b'{"model":"m","token_ids":[1], "add_generation_prompt": true, "max_tokens": -1e5}',
    b'{"model":"m","token_ids":[1], "add_generation_prompt": tru}',
]

DECLINED = [
    b'{"model":"m","token_ids":[1]',
    b'{"model":"m","token_ids":[1], "x": 1',
    b'{"model":"m","token_ids":[1],}',
    b'{"model":"m","token_ids":[1]} x',
    b'{"model":"m","token_ids":[01]}',
    b'{"model":"m","token_ids":[00]}',
    b'{"model":"m","token_ids":[-0]}',
    b'{"model":"m","token_ids":[-1]}',
    b'{"model":"m","token_ids":[1.0]}',
    b'{"model":"m","token_ids":[1e3]}',
    b'{"model":"m","token_ids":[1E3]}',
    b'{"model":"m","token_ids":[4294967296]}',
    b'{"model":"m","token_ids":[12345678901]}',
    b'{"model":"m","token_ids":[99999999999999999999999]}',
    b'{"model":"m","token_ids":[1,]}',
    b'{"model":"m","token_ids":[,1]}',
    b'{"model":"m","token_ids":[1 2]}',
    b'{"model":"m","token_ids":[1,,2]}',
    b'{"model":"m","token_ids":["1"]}',
    b'{"model":"m","token_ids":[null]}',
    b'{"model":"m","token_ids":[true]}',
    b'{"model":"m","token_ids":[[1]]}',
    b'{"model":"m","token_ids":[1}',
    b'{"model":"m","token_ids":[1',
    b'{"model":"m","token_ids":[123456789',
    b'{"model":"m","token_ids":null}',
    b'{"model":"m","token_ids":{"a":1}}',
    b'{"model":"m","token_ids":"1,2"}',
    b'{"model":"m","token_ids":[1],"token_ids":[2]}',
    b'{"model":"m","token\\u005fids":[1]}',
    b'{"model":"m","token_ids\\u0000":[1]}',
    b'{"mod\\u0065l":"m","token_ids":[1]}',
    b'{"model":"m","token_ids" [1]}',
    b'{"model":"m" "token_ids":[1]}',
    b'["model","token_ids",[1]]',
    b'{"model":"m","token_ids":[1]}{}',
    b'{"model":"m","token_ids":[1\x00]}',
    b'{"model":"m","token_ids":[\xc3\xa9]}',
    b'{"model":"m","token_ids":[\xef\xbb\xbf1]}',
    b'\xef\xbb\xbf{"model":"m","token_ids":[1]}',
    b'{"model":"m","token_ids":[1\xa0]}',
    b'{"model":"m","token_ids":[1\x0b]}',
    b'{"model":"m","prompt":"\\"token_ids\\":[1]"}',
    b'{"model":"m","prompt":"x\\", "token_ids": [1], "y": "z"}',
    b'{"model":"m","messages":[{"token_ids":[1]}]}',
    b'{"model":"m"',
    b"",
    b"null",
    b'"token_ids"',
]


HASHES_TAKEN = [
    b'{"model":"m","block_hashes":[1,18446744073709551615,0]}',
    b'{"model":"m","block_hashes":[12345678901234567890, 10000000000000000000 ,9]}',
    b'{"block_hashes":[ ],"model":"m"}',
    b'{"model":"m","block_hashes":[1],"token_ids":[1]}',  # token_ids read, hashes msgspec's
    b'{"model":"m","block_hashes":[1],"lora_name":"x"}',
    b'{"model":"m","block_hashes":[1],"pods":[]}',
    # hex, as the schema's pattern takes it: the low 64 bits of 1 to 64 digits
    b'{"model":"m","block_hashes":["ff"]}',
    b'{"model":"m","block_hashes":[1,"0xFF", 2 ,"0Xab"]}',
    b'{"model":"m","block_hashes":[ "0" , "0x0","ffffffffffffffff","FFFFFFFFFFFFFFFF" ]}',
    b'{"model":"m","block_hashes":["10000000000000000","123456789abcdef0123456789ABCDEF"]}',
    b'{"model":"m","block_hashes":["0x' + b"f" * 64 + b'","' + b"9" * 64 + b'"]}',
    b'{"model":"m","block_hashes":["00000000000000000000000000000000000000000000001"]}',
]
HASHES_DECLINED = [
    b'{"model":"m","block_hashes":[18446744073709551616]}',
    b'{"model":"m","block_hashes":[99999999999999999999]}',
    b'{"model":"m","block_hashes":[123456789012345678901]}',
    b'{"model":"m","block_hashes":[-1]}',
    b'{"model":"m","block_hashes":["nothex"]}',
    b'{"model":"m","block_hashes":["' + b"f" * 65 + b'"]}',
    b'{"model":"m","block_hashes":["0x' + b"f" * 65 + b'"]}',
    b'{"model":"m","block_hashes":["0x"]}',
    b'{"model":"m","block_hashes":["0X"]}',
    b'{"model":"m","block_hashes":[""]}',
    b'{"model":"m","block_hashes":["x1"]}',
    b'{"model":"m","block_hashes":["00x1"]}',
    b'{"model":"m","block_hashes":["0x0x1"]}',
    b'{"model":"m","block_hashes":["-1"]}',
    b'{"model":"m","block_hashes":[" ff"]}',
    b'{"model":"m","block_hashes":["ff "]}',
    b'{"model":"m","block_hashes":["f\\u0066"]}',
    b'{"model":"m","block_hashes":["ff\\n"]}',
    b'{"model":"m","block_hashes":["ff\n"]}',
    b'{"model":"m","block_hashes":["ff"',
    b'{"model":"m","block_hashes":["ff]}',
    b'{"model":"m","block_hashes":["ff",]}',
    b'{"model":"m","block_hashes":["ff" "ee"]}',
    b'{"model":"m","block_hashes":["\\u00660"]}',
    b'{"model":"m","block_hashes":[01]}',
    b'{"model":"m","block_hashes":[1.5]}',
    b'{"model":"m","block_hashes":[1],"block_hashes":[2]}',
    b'{"model":"m","block_hashes":null}',
]


@needs_reader
@pytest.mark.parametrize("body", TAKEN + HASHES_TAKEN)
def test_bodies_the_reader_takes_decode_as_msgspec_decodes_them(body, monkeypatch) -> None:
    for kind in DECODERS:
        same(body, monkeypatch, kind)
    field = "token_ids" if b'"token_ids"' in body else "block_hashes"
    assert json_tokens._compiled.split(body, field) is not None


@pytest.mark.parametrize("body", DECLINED + HASHES_DECLINED)
def test_bodies_left_to_msgspec_decode_as_before(body, monkeypatch) -> None:
    for kind in DECODERS:
        assert not same(body, monkeypatch, kind)
    if COMPILED:
        for field in FIELDS_READ:
            assert json_tokens._compiled.split(body, field) is None


RANGES = {"token_ids": U32, "block_hashes": U64}


def integers_of_every_length(rng: random.Random, top: int, count: int) -> list[int]:
    digits = len(str(top))
    edges = [0, 1, 9, 10, 99, 100, top - 1, top]
    edges += [10**n + d for n in range(1, digits) for d in (-1, 0, 1) if 10**n + d <= top]
    drawn = [rng.randrange(10 ** rng.randrange(1, digits + 1)) % (top + 1) for _ in range(count)]
    out = edges + drawn
    rng.shuffle(out)
    return out


@needs_reader
@pytest.mark.parametrize("field", FIELDS_READ)
def test_the_reader_takes_integers_across_the_range(field, monkeypatch) -> None:
    """Every digit count (the reader converts 8 digits per word: 1 to 3 words), the
    range's edges, and a prompt the size bench_score sends."""
    rng = random.Random(13)
    values = integers_of_every_length(rng, RANGES[field], 20_000)
    typecode = json_tokens.UINT32 if field == "token_ids" else json_tokens.UINT64
    for body in (
        json.dumps({"model": "m", field: values}).encode(),  # ", " separators
        msgspec.json.encode({field: values, "model": "m"}),  # "," separators
        json.dumps({"model": "m", field: values}, indent=3).encode(),
    ):
        assert same(body, monkeypatch)
        rest, raw = json_tokens._compiled.split(body, field)
        assert array(typecode, raw).tolist() == values
        assert b"null" in rest and len(rest) < 50
    # near the body's very end the reader goes digit by digit: no byte read past it
    for n in values[:200]:
        assert same(b'{"model":"m","%s":[%d]}' % (field.encode(), n), monkeypatch)
    for n in (RANGES[field] + 1, 10 ** len(str(RANGES[field])), 10**24):  # past the range
        assert not same(b'{"model":"m","%s":[%d]}' % (field.encode(), n), monkeypatch)
        padded = b'{"model":"m","%s":[%d,1,2,3,4,5,6,7,8,9]}' % (field.encode(), n)
        assert not same(padded, monkeypatch)


@needs_reader
@pytest.mark.parametrize("field", FIELDS_READ)
def test_every_byte_of_an_array_across_64_byte_blocks(field, monkeypatch) -> None:
    """The SSE2 reader takes 64 bytes at a time: an array starting at every offset, and
    one byte of it changed at every position (a digit, a comma, a space, ']', '-', '.'
    or dropped), agrees with msgspec and with the byte-by-byte reader."""
    rng = random.Random(3)
    array_bytes = json.dumps(integers_of_every_length(rng, RANGES[field], 10)[:30]).encode()
    name = field.encode()
    for pad in range(0, 70, 7):
        body = b'{"model":"%s","%s":%s}' % (b"m" * (pad + 1), name, array_bytes)
        assert same(body, monkeypatch)
    taken = 0
    for at in range(len(array_bytes)):
        for change in (b"0", b"7", b",", b" ", b"]", b"-", b".", b""):
            changed = array_bytes[:at] + change + array_bytes[at + 1 :]
            body = b'{"model":"%s","%s":%s}' % (b"m" * (at % 64 + 1), name, changed)
            taken += same(body, monkeypatch)
    assert taken > 100  # many changes still give an array of integers


# -- generated bodies ----------------------------------------------------------------------

token_id = st.one_of(
    st.integers(0, 200_000),
    st.integers(0, U32),
    st.sampled_from([0, 1, 10, 10**8 - 1, 10**8, U32, U32 + 1, 2**63, -1, 2**64]),
)
block_hash = st.one_of(
    st.integers(0, U64),
    st.integers(0, 10**12),
    st.sampled_from([0, 10**19 - 1, 10**19, U64, U64 + 1, 10**20, -1, 2**70]),
)
HEX_HASH = r"(0[xX])?[0-9a-fA-F]{1,64}"  # the schema's pattern for a hex block hash
json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
    st.text(max_size=8),
)  # fmt: skip
json_value = st.recursive(
    json_scalar,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = {
    "model": st.one_of(st.text(min_size=0, max_size=12), json_value),
    "token_ids": st.one_of(
        st.lists(token_id, max_size=40), st.lists(st.integers(0, U32), max_size=3), json_value
    ),
    "pods": st.one_of(st.lists(st.text(max_size=16), max_size=3), json_value),
    "lora_name": st.one_of(st.none(), st.text(max_size=8)),
    "cache_salt": st.one_of(st.none(), st.text(max_size=8)),
    "block_hashes": st.one_of(
        st.lists(block_hash, max_size=40),
        st.lists(st.integers(0, U64) | st.text("0123456789abcdefxX", max_size=18), max_size=3),
        st.lists(block_hash | st.from_regex(HEX_HASH, fullmatch=True), max_size=12),
        json_value,
    ),
    "prompt": st.text(max_size=20),
    "request_id": st.text(min_size=1, max_size=8),
    "max_tokens": st.integers(-3, 100),
    "role": st.sampled_from(["prefill", "decode", "both"]),
    "add_generation_prompt": st.one_of(st.booleans(), json_value),
    "unknown": json_value,
}


@st.composite
def request_bodies(draw) -> bytes:
    """A body a client might send: some fields (model and token_ids or block_hashes most
    often) in any order, serialised with the separators, indentation and escaping of
    common encoders."""
    more = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True))
    prompt = draw(st.sampled_from(FIELDS_READ))
    names = draw(st.permutations(list(dict.fromkeys(["model", prompt, *more]))))
    fields = {name: draw(FIELDS[name]) for name in names}
    style = draw(st.integers(0, 3))
    if style == 0:
        return msgspec.json.encode(fields)
    if style == 1:
        return json.dumps(fields).encode()
    if style == 2:
        return json.dumps(fields, indent=draw(st.sampled_from([0, 2, "\t"]))).encode()
    return json.dumps(fields, separators=(" ,\r\n", " : "), ensure_ascii=False).encode()


JSON_BYTES = b'[]{}",:\\ \t\n\r0123456789-+.eEnulltrue\x00\xa0\xc3'


@st.composite
def mutated(draw) -> bytes:
    """A valid body with a few bytes inserted, deleted or replaced, mostly by bytes that
    matter to JSON."""
    body = bytearray(draw(request_bodies()))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(body)))
        what = draw(st.integers(0, 2))
        byte = draw(st.sampled_from(JSON_BYTES) | st.integers(0, 255))
        if what == 0:
            body.insert(at, byte)
        elif at < len(body):
            if what == 1:
                del body[at]
            else:
                body[at] = byte
    return bytes(body)


KINDS = st.sampled_from([ScoreRequest, RouteRequest])
SLOW_EXAMPLES = settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@SLOW_EXAMPLES
@given(body=request_bodies(), kind=KINDS)
def test_generated_bodies_decode_as_msgspec_decodes_them(body, kind, monkeypatch) -> None:
    same(body, monkeypatch, kind)


@SLOW_EXAMPLES
@given(body=mutated(), kind=KINDS)
def test_mutated_bodies_decode_as_msgspec_decodes_them(body, kind, monkeypatch) -> None:
    same(body, monkeypatch, kind)


@needs_reader
def test_generated_bodies_are_mostly_taken(monkeypatch) -> None:
    """The comparisons above are not vacuous: plain bodies take the compiled path."""
    taken = 0
    rng = random.Random(7)
    for i in range(200):
        field = FIELDS_READ[i % 2]
        values = [rng.randrange(RANGES[field] + 1) for _ in range(rng.randrange(0, 50))]
        fields = {field: values, "model": "m", "pods": ["127.0.0.1:8000"]}
        body = json.dumps(fields, indent=i % 3 or None).encode()
        taken += same(body, monkeypatch)
    assert taken == 200


@needs_reader
def test_hex_block_hashes_are_taken_as_their_low_64_bits(monkeypatch) -> None:
    """Hex hashes (the other spelling engines' hashes travel in) take the compiled path
    too, and give what ``block_keys`` makes of msgspec's strings."""
    rng = random.Random(11)
    for i in range(100):
        hashes: list[int | str] = []
        for _ in range(rng.randrange(1, 40)):
            digits = "".join(
                rng.choice("0123456789abcdefABCDEF") for _ in range(rng.randrange(1, 65))
            )
            hashes.append(
                rng.choice(["", "0x", "0X"]) + digits
                if rng.random() < 0.8
                else rng.randrange(U64 + 1)
            )
        body = json.dumps({"model": "m", "block_hashes": hashes}, indent=i % 3 or None).encode()
        assert same(body, monkeypatch)
        _rest, items = json_tokens._compiled.split(body, "block_hashes")
        want = [h if type(h) is int else int(h, 16) & U64 for h in hashes]
        assert array(json_tokens.UINT64, items).tolist() == want


# -- over HTTP -----------------------------------------------------------------------------

TOKENS = list(range(1, 16 * 32 + 1))
KEYS = BlockHasher(HashConfig()).keys(TOKENS)
POD_A, POD_B = "127.0.0.1:8000", "127.0.0.2:8000"


@contextmanager
def filled_client() -> Iterator[TestClient]:
    """An app over a fresh service, two pods' blocks applied: /route remembers what it
    routed (speculative entries, pending loads), so each pass gets its own."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = Service(from_flags(zmq_bind=[endpoint], max_prompt_tokens=4096, max_pods=4))
    keys = KEYS
    with TestClient(create_app(service)) as test_client:
        for pod, blocks in ((POD_A, 32), (POD_B, 5)):
            with EnginePublisher(
                from_source(endpoint, pod.split(":")[0]), topic=f"kv@{pod}@m", bind=False
            ) as pub:
                assert pub.wait_for_subscribers(1, 5.0)
                pub.publish([BlockStored(keys[:blocks], None, TOKENS[: blocks * 16], 16)])
                assert wait_until(
                    lambda pod=pod: any(
                        s.pod == pod and s.delivered for s in service.subscriber.streams()
                    ),
                    5.0,
                )
        yield test_client


HTTP_BODIES = [
    {"model": "m", "token_ids": TOKENS},
    {"model": "m", "token_ids": TOKENS[:100], "pods": [POD_B, "127.0.0.9:8000"]},
    {"model": "m", "token_ids": TOKENS, "lora_name": "nope"},
    {"model": "m", "token_ids": []},
    {"model": "m", "token_ids": TOKENS * 9},  # past --max-prompt-tokens
    {"model": "m", "token_ids": TOKENS, "block_hashes": [1]},
    {"model": "other", "token_ids": TOKENS},
    {"model": "m", "token_ids": TOKENS, "pods": []},
    {"model": "m", "token_ids": TOKENS, "add_generation_prompt": False},
    {"model": "m", "token_ids": [*TOKENS[:20], -1]},
    {"model": "m", "token_ids": [*TOKENS[:20], U32 + 1]},
    {"model": "m", "token_ids": TOKENS, "extra": 1},
    {"model": "m", "token_ids": TOKENS, "role": "prefill", "max_tokens": 10},
    {"model": "m", "token_ids": TOKENS, "role": "chef"},
    {"model": "m", "block_hashes": KEYS},
    {"model": "m", "block_hashes": KEYS[:7], "pods": [POD_B, "127.0.0.9:8000"]},
    {"model": "m", "block_hashes": KEYS, "lora_name": "x"},
    {"model": "m", "block_hashes": []},
    {"model": "m", "block_hashes": KEYS * 9},  # past --max-prompt-tokens
    {"model": "m", "block_hashes": [*KEYS[:3], U64 + 1]},
    {"model": "m", "block_hashes": [*KEYS[:3], f"{KEYS[3]:x}", *KEYS[4:]]},
    {"model": "other", "block_hashes": KEYS},
]


def answer_all(client: TestClient, path: str) -> list[tuple[int, Any]]:
    answers = []
    bodies = [*(json.dumps(b).encode() for b in HTTP_BODIES), *DECLINED[:12], *TAKEN]
    for body in bodies + HASHES_TAKEN + HASHES_DECLINED:
        response = client.post(path, content=body, headers={"content-type": "application/json"})
        answer = response.json()
        if path == "/route" and response.status_code == 200:
            # what the request said; the choice also follows the live load and the
            # routes before it, which are timing's, not the body's
            client.post(f"/route/{answer['route_id']}/done")
            answer = {
                "prompt": (answer["model"], answer["prompt_tokens"], answer["prompt_blocks"]),
                "matched": [(c["pod"], c["matched_blocks"]) for c in answer["candidates"]],
                "warnings": answer["warnings"],
            }
        answers.append((response.status_code, answer))
    return answers


@needs_reader
@pytest.mark.parametrize("path", ["/score", "/route"])
def test_http_answers_alike_with_the_reader_and_without(path, monkeypatch) -> None:
    answers: dict[bool, list[tuple[int, Any]]] = {}
    for compiled in (True, False):
        monkeypatch.setattr(json_tokens, "reader", json_tokens._compiled if compiled else None)
        with filled_client() as client:
            answers[compiled] = answer_all(client, path)
    assert answers[True] == answers[False]
    statuses = {status for status, _ in answers[True]}
    assert 200 in statuses and 400 in statuses  # both kinds of answer were compared
    first = answers[True][0][1]
    if path == "/score":
        assert [(p["pod"], p["matched_blocks"]) for p in first["pods"]] == [(POD_A, 32), (POD_B, 5)]
    else:
        assert first["matched"] == [(POD_A, 32), (POD_B, 5)]

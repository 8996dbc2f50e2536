"""A JSON body's token ids read by the compiled reader give exactly what msgspec gives.

``api/_json_tokens.c`` reads a ``/score`` or ``/route`` body's top-level ``token_ids``
array into uint32s and msgspec decodes the rest. Every body must come out as the pure
msgspec decode of the whole body makes it: the same request (``token_ids`` as an
``array('I')`` of the same ids), or the same error (kind, code and text). Checked on
hand-made odd bodies, on hypothesis-generated ones (valid requests in many spellings,
and those mutated byte by byte), and over HTTP: /score and /route answer byte for byte
alike with the reader and without.

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

from kvindex.api import json_tokens
from kvindex.api.app import create_app
from kvindex.api.json_tokens import decode_prompt
from kvindex.api.schemas import RouteRequest, ScoreRequest
from kvindex.api.service import Service
from kvindex.api.settings_load import from_flags
from kvindex.api.testing import free_port
from kvindex.events import BlockStored
from kvindex.events.endpoints import from_source
from kvindex.events.errors import KvindexError
from kvindex.events.publisher import EnginePublisher
from kvindex.events.testing import wait_until
from kvindex.indexer.keys import BlockHasher, HashConfig

COMPILED = json_tokens.reader is not None
needs_reader = pytest.mark.skipif(not COMPILED, reason="api/_json_tokens.c is not built")
DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (ScoreRequest, RouteRequest)}
U32 = 2**32 - 1


def outcome(kind: type[ScoreRequest], body: bytes, monkeypatch, compiled: bool) -> Any:
    """What decoding ``body`` gives: the request as builtins (token_ids a list), or the
    error's kind, code and text; and whether the compiled reader took the ids."""
    monkeypatch.setattr(json_tokens, "reader", json_tokens._compiled if compiled else None)
    try:
        req = decode_prompt(DECODERS[kind], body)
    except KvindexError as exc:
        return ("error", type(exc).__name__, exc.code, exc.detail), False
    took = isinstance(req.token_ids, array)
    if took:
        assert req.token_ids.itemsize == 4
        req.token_ids = req.token_ids.tolist()
    return ("ok", type(req).__name__, msgspec.to_builtins(req)), took


def same(body: bytes, monkeypatch, kind: type[ScoreRequest] = ScoreRequest) -> bool:
    """Assert the reader and msgspec agree on ``body``; whether the reader took it."""
    if COMPILED:  # the SSE2 reader and the byte-by-byte one (what runs without SSE2)
        assert json_tokens._compiled.split(body) == json_tokens._compiled.split(body, False)
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


@needs_reader
@pytest.mark.parametrize("body", TAKEN)
def test_bodies_the_reader_takes_decode_as_msgspec_decodes_them(body, monkeypatch) -> None:
    for kind in DECODERS:
        same(body, monkeypatch, kind)
    assert json_tokens._compiled.split(body) is not None


@pytest.mark.parametrize("body", DECLINED)
def test_bodies_left_to_msgspec_decode_as_before(body, monkeypatch) -> None:
    for kind in DECODERS:
        assert not same(body, monkeypatch, kind)
    if COMPILED:
        assert json_tokens._compiled.split(body) is None


@needs_reader
def test_the_reader_takes_ids_across_the_uint32_range(monkeypatch) -> None:
    """Every digit count (the reader converts up to 8 digits per word, longer ones digit
    by digit), the range's edges, and a prompt the size bench_score sends."""
    rng = random.Random(13)
    edges = [0, 1, 9, 10, 99, 100, 10**7 - 1, 10**7, 10**8 - 1, 10**8, 10**9, U32 - 1, U32]
    ids = edges + [rng.randrange(10 ** rng.randrange(1, 10)) for _ in range(20_000)]
    rng.shuffle(ids)
    for body in (
        json.dumps({"model": "m", "token_ids": ids}).encode(),  # ", " separators
        msgspec.json.encode({"token_ids": ids, "model": "m"}),  # "," separators
        json.dumps({"model": "m", "token_ids": ids}, indent=3).encode(),
    ):
        assert same(body, monkeypatch)
        rest, raw = json_tokens._compiled.split(body)
        assert array(json_tokens.UINT32, raw).tolist() == ids
        assert b"null" in rest and len(rest) < 50
    # at the body's very end the reader goes digit by digit: no byte read past it
    for n in edges:
        assert same(b'{"model":"m","token_ids":[%d]}' % n, monkeypatch)


@needs_reader
def test_every_byte_of_an_array_across_64_byte_blocks(monkeypatch) -> None:
    """The SSE2 reader takes 64 bytes at a time: an array starting at every offset, and
    one byte of it changed at every position (a digit, a comma, a space, ']', '-', '.'
    or dropped), agrees with msgspec and with the byte-by-byte reader."""
    rng = random.Random(3)
    ids = [rng.randrange(10 ** rng.randrange(1, 11)) % (U32 + 1) for _ in range(30)]
    array_bytes = json.dumps(ids).encode()
    for pad in range(0, 70, 7):
        assert same(b'{"model":"%s","token_ids":%s}' % (b"m" * (pad + 1), array_bytes), monkeypatch)
    taken = 0
    for at in range(len(array_bytes)):
        for change in (b"0", b"7", b",", b" ", b"]", b"-", b".", b""):
            changed = array_bytes[:at] + change + array_bytes[at + 1 :]
            body = b'{"model":"%s","token_ids":%s}' % (b"m" * (at % 64 + 1), changed)
            taken += same(body, monkeypatch)
    assert taken > 100  # many changes still give an array of ids


# -- generated bodies ----------------------------------------------------------------------

token_id = st.one_of(
    st.integers(0, 200_000),
    st.integers(0, U32),
    st.sampled_from([0, 1, 10, 10**8 - 1, 10**8, U32, U32 + 1, 2**63, -1, 2**64]),
)
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
    "block_hashes": st.lists(st.integers(0, 2**64 - 1), max_size=3),
    "prompt": st.text(max_size=20),
    "request_id": st.text(min_size=1, max_size=8),
    "max_tokens": st.integers(-3, 100),
    "role": st.sampled_from(["prefill", "decode", "both"]),
    "add_generation_prompt": st.one_of(st.booleans(), json_value),
    "unknown": json_value,
}


@st.composite
def request_bodies(draw) -> bytes:
    """A body a client might send: some fields (token_ids and model most often) in any
    order, serialised with the separators, indentation and escaping of common encoders."""
    more = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True))
    names = draw(st.permutations(list(dict.fromkeys(["model", "token_ids", *more]))))
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
        ids = [rng.randrange(U32 + 1) for _ in range(rng.randrange(0, 50))]
        fields = {"token_ids": ids, "model": "m", "pods": ["127.0.0.1:8000"]}
        body = json.dumps(fields, indent=i % 3 or None).encode()
        taken += same(body, monkeypatch)
    assert taken == 200


# -- over HTTP -----------------------------------------------------------------------------

TOKENS = list(range(1, 16 * 32 + 1))
POD_A, POD_B = "127.0.0.1:8000", "127.0.0.2:8000"


@contextmanager
def filled_client() -> Iterator[TestClient]:
    """An app over a fresh service, two pods' blocks applied: /route remembers what it
    routed (speculative entries, pending loads), so each pass gets its own."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    service = Service(from_flags(zmq_bind=[endpoint], max_prompt_tokens=4096, max_pods=4))
    keys = BlockHasher(HashConfig()).keys(TOKENS)
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
]


def answer_all(client: TestClient, path: str) -> list[tuple[int, Any]]:
    answers = []
    for body in [*(json.dumps(b).encode() for b in HTTP_BODIES), *DECLINED[:12], *TAKEN]:
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

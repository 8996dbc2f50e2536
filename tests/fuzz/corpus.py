"""The fuzz harness's seed corpus: what every run feeds the parsers first, unmutated,
and what the mutators start from.

- KV-event payloads and messages: the real bytes of 11 vLLM releases
  (``tests/fixtures/vllm``) and vLLM 0.33's own envelopes in both forms;
- ``/score`` and ``/route`` bodies: token ids, block hashes (ints and hex), prompts,
  messages, odd spacing;
- Redis answers: the RESP replies a lookup reads, and a whole MULTI/EXEC lookup answer;
- the hostile inputs of issue 26 that are parser inputs (a 1,000-deep BlockStored, seq
  2**64 - 1, NaN / Infinity / 1e30 / 2**64 numbers in a body), so they run every time.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

FIXTURES = Path(__file__).parent.parent / "fixtures"
U64 = 2**64 - 1

#: Issue 26's 1 KB payload whose BlockStored nests 1,000 arrays deep: [ts, [[tag, [[[...1]]]]]].
NESTED_BLOCK_STORED = (
    b"\x92\xcb\x41\xd0" + bytes(6) + b"\x91\x92\xabBlockStored" + b"\x91" * 1000 + b"\x01"
)


def vllm_messages() -> list[list[bytes]]:
    """Every captured ``[topic, seq, payload]`` message of every release."""
    out: list[list[bytes]] = []
    for folder in sorted((FIXTURES / "vllm").iterdir()):
        path = folder / "messages.msgpack"
        if path.exists():
            out += msgspec.msgpack.decode(path.read_bytes())
    return out


def vllm_payloads() -> list[bytes]:
    """The KV-event payloads: every captured one, and vLLM 0.33's array and map
    envelopes."""
    payloads = [frames[-1] for frames in vllm_messages()]
    lines = (FIXTURES / "vllm_0_33_envelopes.txt").read_text().split()
    payloads += [bytes.fromhex(line) for line in lines]
    payloads += [NESTED_BLOCK_STORED]
    return list(dict.fromkeys(payloads))


def event_messages() -> list[list[list[bytes]]]:
    """Runs of whole messages for the receiver: each captured message alone, a release's
    messages in a row, and the ends of the seq range from one sender (2**64 - 1 then 0:
    the engine restarted, or a counter wrapped; 2**64 - 1 with the 1,000-deep payload)."""
    messages = vllm_messages()
    topic, _, payload = messages[0]

    def at(seq: int, body: bytes = payload) -> list[bytes]:
        return [topic, seq.to_bytes(8, "big"), body]

    runs = [[m] for m in messages] + [messages[:6]]
    runs += [[at(U64), at(0)], [at(U64 - 1), at(U64), at(0), at(1)], [at(2**63)]]
    runs += [[at(U64, NESTED_BLOCK_STORED)]]
    return runs


_TOKENS = list(range(1, 65))
_HASHES = [1403909460543360175, 1643945449041937783, 0, U64, 2**63]

#: Bodies of /score and /route requests (bytes: some are not JSON at all).
JSON_BODIES: list[bytes] = [
    json.dumps({"model": "m", "token_ids": _TOKENS}).encode(),
    msgspec.json.encode({"model": "m", "token_ids": _TOKENS, "pods": ["127.0.0.1:8000"]}),
    json.dumps({"token_ids": [0, 4294967295, 7], "model": "m"}, indent=2).encode(),
    json.dumps({"model": "m", "block_hashes": _HASHES}).encode(),
    json.dumps({"model": "m", "block_hashes": ["0xff", "FFFFFFFFFFFFFFFF", 5, "0"]}).encode(),
    json.dumps({"model": "m", "prompt": 'a "token_ids": [1]', "lora_name": "x"}).encode(),
    json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    json.dumps(
        {"model": "m", "token_ids": _TOKENS, "request_id": "r", "max_tokens": 16, "role": "decode"}
    ).encode(),
    b' {\r\n "model" : "m" ,\t"token_ids" :[ 1 ,2 , 3 ] , "cache_salt": "s\\u00e9" } ',
    # issue 26: numbers a route's cost must survive (2**63, 1e30) and ones JSON has not
    b'{"model":"m","token_ids":[1,2,3],"max_tokens":1e30}',
    b'{"model":"m","token_ids":[1,2,3],"max_tokens":9223372036854775808}',
    b'{"model":"m","token_ids":[1,2,3],"max_tokens":18446744073709551616}',
    b'{"model":"m","token_ids":[1,2,3],"max_tokens":NaN}',
    b'{"model":"m","token_ids":[1,2,3],"max_tokens":Infinity}',
    b'{"model":"m","token_ids":[1,2,3],"max_tokens":-Infinity}',
    b'{"model":"m","token_ids":[1,NaN,3]}',
    b'{"model":"m","token_ids":[1,1e30,3]}',
    b'{"model":"m","block_hashes":[1e30,18446744073709551616]}',
    b'{"model":"m","token_ids":' + b"[" * 5000 + b"]" * 5000 + b"}",
]

#: Replies a lookup's connection reads (RESP2 and RESP3), one per item.
RESP_REPLIES: list[bytes] = [
    b"+OK\r\n",
    b"+QUEUED\r\n",
    b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
    b":42\r\n",
    b":-7\r\n",
    b":9223372036854775807\r\n",
    b"$5\r\nhe\r\nx\r\n",
    b"$0\r\n\r\n",
    b"$-1\r\n",
    b"*-1\r\n",
    b"*0\r\n",
    b"_\r\n",
    b"#t\r\n",
    b"*3\r\n$1\r\n\x01\r\n$-1\r\n_\r\n",
    b"%2\r\n$1\r\n3\r\n$1\r\na\r\n$1\r\n7\r\n$1\r\nb\r\n",
    b"*2\r\n*2\r\n:1\r\n#t\r\n~1\r\n#f\r\n",
    b"*2\r\n-ERR inside\r\n+QUEUED\r\n",
    b"*1\r\n" * 8 + b":1\r\n",
]


def resp_bulk(value: bytes | None) -> bytes:
    return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)


def lookup_answer(heads: list[list[bytes | None]], hmgets: list[list[bytes | None]]) -> bytes:
    """MULTI/EXEC's answer to ``len(heads)`` small reads and ``len(hmgets)`` HMGETs, as
    Redis sends it over RESP2."""
    out = [b"+OK\r\n", b"+QUEUED\r\n" * (len(heads) + len(hmgets))]
    out.append(b"*%d\r\n" % (len(heads) + len(hmgets)))
    for reply in [*heads, *hmgets]:
        out.append(b"*%d\r\n" % len(reply) + b"".join(map(resp_bulk, reply)))
    return b"".join(out)

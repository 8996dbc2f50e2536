"""Each compiled parser fuzzed against its Python twin, for a bounded time.

Targets: the KV-event payload scanner (``events/wire/_wire_scan.c``'s ``scan``, against
msgspec), the receiver's compiled drain (the same file's ``drain``: framing, seq,
grouping, against pyzmq's receive and the door's checks), the ``/score`` body reader
(``api/http/_json_tokens.c``, against msgspec), the block-hash chain (``indexer/_chain.c``,
against pickle/cbor2 + hashlib), the memory table's probing kernels
(``indexer/memory/_probe.c``, against numpy) and the Redis reply reader
(``indexer/redis/_redis_lookup.c``, against hiredis and ``redis_read.rows_of``).

For every input, both sides either refuse it in their documented way or give equal
answers; a crash, a hang (the test's thread timeout) or a divergence fails. Each target
first runs its seed corpus (:mod:`tests.fuzz.corpus`, issue 26's hostile inputs among
it), then structure-aware mutations of it (:mod:`tests.fuzz.mutations`) until its time
is up. Case ``n`` of seed ``s`` is always the same input, so a failure names the two
numbers that replay it; tests/fuzz/README.md says how, how to run longer, and how to
run under ASAN/UBSan.

Environment: ``KVTEST_FUZZ_SECONDS`` (per target, default 1.5), ``KVTEST_FUZZ_SEED``
(default 0), ``KVTEST_FUZZ_CASE`` (run that case alone), ``KVTEST_FUZZ_TRACE`` (print
each case's number before it runs: a crash's last line names it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import hiredis
import msgspec
import pytest
import zmq

from kvindex.api.http import json_tokens
from kvindex.api.http.schemas import RouteRequest, ScoreRequest
from kvindex.events.ingest import drain as drain_module
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.door import Door, Source
from kvindex.events.ingest.ratelog import RateLimitedLog
from kvindex.events.ingest.receiver import Receiver
from kvindex.events.ingest.status import IngestHealth, ReasonCounts
from kvindex.events.wire import scanned as scanned_module
from kvindex.events.wire.vllm import (
    BatchDecoder,
    BlockStored,
    DecodeError,
    EnvelopeDecoder,
    hash_to_int,
    tokens_of,
)
from kvindex.indexer import compiled
from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.keys import BlockExtras, BlockHasher, ExtraKeyStyle, HashAlgo
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.redis.compiled import kernels
from kvindex.indexer.redis.read import rows_of
from tests.fuzz import corpus
from tests.fuzz.mutations import mutate_bytes, mutated_json, mutated_msgpack
from tests.test_events_scan import check_never_looser
from tests.test_json_tokens import same
from tests.test_keys_compiled import config, pure_hashing
from tests.test_memory_table_paths import SEED as TABLE_SEED
from tests.test_memory_table_paths import colliding, facts

SECONDS = float(os.environ.get("KVTEST_FUZZ_SECONDS", "1.5"))
FUZZ_SEED = int(os.environ.get("KVTEST_FUZZ_SEED", "0"))
ONLY_CASE = os.environ.get("KVTEST_FUZZ_CASE")
TRACE = bool(os.environ.get("KVTEST_FUZZ_TRACE"))

#: A hang fails the test: the thread method dumps every stack and ends the run, which
#: works while a C loop holds the GIL (the signal method would wait for it).
pytestmark = pytest.mark.timeout(max(60, int(SECONDS * 20)), method="thread")


def needs(module: object, what: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(module is None, reason=f"{what} is not built")


def fuzz(name: str, seeds: list, mutate: Callable[[random.Random], Any], check: Callable) -> None:
    """``check`` every seed, then mutated inputs until the time is up (at least one).
    A failure names the input and the command that replays it."""
    command = f"KVTEST_FUZZ_SEED={FUZZ_SEED} python -m pytest tests/fuzz -k {name}"

    def run(label: str, data: Any, replay: str) -> None:
        if TRACE:
            print(f"fuzz {name}: {label}", file=sys.__stderr__, flush=True)
        try:
            check(data)
        except Exception as exc:
            raise AssertionError(
                f"fuzz {name}, {label}: {type(exc).__name__}: {exc}\n"
                f"replay: {replay}\ninput: {data!r:.3000}"
            ) from exc

    def case_input(case: int) -> Any:
        return mutate(random.Random(f"{FUZZ_SEED}:{name}:{case}"))

    if ONLY_CASE is not None:
        run(f"case {ONLY_CASE}", case_input(int(ONLY_CASE)), command)
        return
    for i, data in enumerate(seeds):
        run(f"seed corpus item {i}", data, command)
    deadline = time.monotonic() + SECONDS
    case = 0
    while case == 0 or time.monotonic() < deadline:
        run(f"case {case}", case_input(case), f"KVTEST_FUZZ_CASE={case} {command}")
        case += 1
    print(f"fuzz {name}: seed {FUZZ_SEED}, {len(seeds)} seed inputs, {case} mutated cases")


# -- KV-event payloads: the scanner against msgspec -----------------------------------------

PAYLOADS = corpus.vllm_payloads()


def python_decode(payload: bytes) -> Any:
    """What the door's Python path makes of a payload: the batch, or None when the
    decoders refuse it in their documented way (anything else raises)."""
    with contextlib.suppress(msgspec.DecodeError):
        EnvelopeDecoder().decode(payload)
    try:
        return BatchDecoder().decode(payload)
    except DecodeError:
        return None


def check_payload(payload: bytes) -> None:
    python_decode(payload)
    check_never_looser(payload)  # the scanner takes it whole and agrees, or declines


@needs(scanned_module.scanner, "events/wire/_wire_scan.c")
def test_fuzz_wire_scan() -> None:
    fuzz("wire_scan", PAYLOADS, lambda rng: mutated_msgpack(PAYLOADS, rng), check_payload)


def test_the_decoders_refuse_a_deeply_nested_payload_as_a_decode_error() -> None:
    assert scanned_module.scan(corpus.NESTED_BLOCK_STORED) is None
    python_decode(corpus.NESTED_BLOCK_STORED)


# -- whole messages: the compiled drain against pyzmq and the door --------------------------

MESSAGE_RUNS = corpus.event_messages()
SEQ_EDGES = [0, 1, 2**32, 2**63 - 1, 2**63, corpus.U64 - 1, corpus.U64]


def mutated_messages(rng: random.Random) -> list[list[bytes]]:
    """A few messages in a row, mostly consecutive seqs of one sender (so the drain
    groups them), with payloads, seqs and framing changed."""
    picked = [list(m) for m in rng.choice(MESSAGE_RUNS)]
    if rng.random() < 0.5:
        picked += [list(m) for m in rng.choice(MESSAGE_RUNS)]
    seq = rng.choice(SEQ_EDGES) if rng.random() < 0.5 else rng.randrange(100)
    for message in picked:
        if len(message) == 3 and rng.random() < 0.8:
            message[1] = (seq % 2**64).to_bytes(8, "big")
        seq += 1 if rng.random() < 0.85 else rng.choice([0, 2, -1, 2**63])
        how = rng.randrange(8)
        if how == 0 and message:
            message[-1] = mutated_msgpack(PAYLOADS, rng)
        elif how == 1:
            message.insert(rng.randrange(len(message) + 1), rng.choice([b"", b"x" * 9]))
        elif how == 2 and message:
            del message[rng.randrange(len(message))]
        elif how == 3 and len(message) > 1:
            message[1] = message[1][: rng.randrange(8)] + rng.choice([b"", b"\x00" * 2])
        elif how == 4 and message:
            message[0] = mutate_bytes(message[0], rng, b"@:.0123456789kv\xff", [])
    return [m for m in picked if m] or MESSAGE_RUNS[0]


def _arrival_facts(arrival: Any) -> tuple:
    decoded = arrival.decoded
    events = None
    if decoded is not None:  # as msgpack: a NaN in extra_keys equals itself there
        batch = decoded.batch
        kinds = [type(event) for event in batch.events]
        events = (kinds, msgspec.msgpack.encode([batch.ts, batch.events, batch.data_parallel_rank]))
        events += (decoded.skipped,)
    return (
        arrival.stream, arrival.model, arrival.seq, arrival.payload, arrival.replay_endpoint,
        arrival.bad, arrival.topic, arrival.connected, arrival.batches, events,
    )  # fmt: skip


class ReceiverRig:
    """A bind-mode receiver socket fed over inproc, for every case of a test: ZMQ frees a
    closed socket's descriptor later, on its reaper thread, so sockets per case ran out
    of descriptors in long runs. Each run gets a fresh door (no state between cases)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.config = SubscriberConfig(max_payload_bytes=4096)
        self.log = RateLimitedLog(logging.getLogger(__name__), 3600.0)
        self.receiver = Receiver(
            ctx, self.config, lambda _: None, ReasonCounts(), self.log, lambda: 0.0,
            None, None, None, IngestHealth(),
        )  # fmt: skip
        self.endpoint = "inproc://fuzz-drain"
        self.push, self.pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        self.pull.bind(self.endpoint)
        self.push.connect(self.endpoint)

    def run(self, messages: list[list[bytes]]) -> tuple[list, dict]:
        """The messages through the receiver's drain (compiled or pyzmq, as the module
        state says): its Arrivals, one per message, and the skips it counted."""
        while self.pull.poll(0):  # what a run that raised left behind
            self.pull.recv_multipart()
        errors = ReasonCounts()
        self.receiver._door = Door(self.config, errors, self.log, lambda: 0.0)
        source = Source(self.endpoint, None)  # bind mode: the topic names the pod
        for message in messages:
            self.push.send_multipart(message)
        # inproc: a sent message is readable once send returns (the first poll may wait
        # for the pipe to be attached)
        arrivals: list = []
        ready = self.pull.poll(5000)
        while ready:
            self.receiver._drain(self.pull, source, arrivals)
            ready = self.pull.poll(0)
        parts = [part for arrival in arrivals for part in arrival.split()]
        return [_arrival_facts(a) for a in parts], errors.snapshot()

    def close(self) -> None:
        for sock in (self.push, self.pull, self.receiver._wake_rx, self.receiver._wake_tx):
            sock.close(linger=0)


@pytest.fixture
def rig(ctx: zmq.Context) -> Iterator[ReceiverRig]:
    made = ReceiverRig(ctx)
    yield made
    made.close()


def check_drain(rig: ReceiverRig, monkeypatch: pytest.MonkeyPatch, messages: list) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(scanned_module, "scanner", None)  # pyzmq's receive and msgspec
        pure = rig.run(messages)
    compiled_path = rig.run(messages)
    assert compiled_path == pure


@needs(drain_module.drain(), "events/wire/_wire_scan.c's drain")
def test_fuzz_drain(rig: ReceiverRig, monkeypatch: pytest.MonkeyPatch) -> None:
    fuzz("drain", MESSAGE_RUNS, mutated_messages, lambda m: check_drain(rig, monkeypatch, m))


@needs(drain_module.drain(), "events/wire/_wire_scan.c's drain")
def test_the_drain_does_not_group_seq_0_after_the_last_seq(rig: ReceiverRig) -> None:
    """Seq 2**64 - 1 then 0 from one sender are two deliveries, as pyzmq's path sees
    them (seq going back: a restart), not one group whose second batch is seq 2**64."""
    topic, _, payload = corpus.vllm_messages()[0]
    run = [[topic, seq.to_bytes(8, "big"), payload] for seq in (corpus.U64, 0, 1)]
    arrivals, _ = rig.run(run)
    assert [facts[2] for facts in arrivals] == [corpus.U64, 0, 1]  # arrivals' seqs


# -- /score and /route bodies: the token reader against msgspec ----------------------------


@needs(json_tokens.reader, "api/http/_json_tokens.c")
def test_fuzz_json_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    def check(body: bytes) -> None:
        for kind in (ScoreRequest, RouteRequest):
            same(body, monkeypatch, kind)

    seeds = corpus.JSON_BODIES
    fuzz("json_tokens", seeds, lambda rng: mutated_json(seeds, rng), check)


# -- the block-hash chain: compiled against pickle / cbor2 + hashlib ------------------------


def chain_inputs(rng: random.Random) -> list[tuple]:
    """What the hash check hashes: a (mutated) payload's BlockStored token ids and LoRA
    name, under a random hash configuration."""
    payload = mutated_msgpack(PAYLOADS, rng) if rng.random() < 0.8 else rng.choice(PAYLOADS)
    try:
        batch = BatchDecoder().decode(payload).batch
    except (DecodeError, RecursionError):
        return []
    out = []
    for event in batch.events:
        if not isinstance(event, BlockStored):
            continue
        try:
            tokens = tokens_of(event)
        except DecodeError:
            continue
        if tokens:
            size = event.block_size if 0 < event.block_size <= 64 else rng.choice([1, 3, 16])
            extras = BlockExtras(event.lora_name, None, rng.choice([None, "salt", ""]))
            parent = rng.choice([None, b"", bytes(32), bytes(range(40))])
            if rng.random() < 0.3:
                tokens = array("I", [t % 2**32 for t in tokens])
            out.append((rng.choice(list(HashAlgo)), size, rng.choice(list(ExtraKeyStyle)),
                        tokens, extras, parent))  # fmt: skip
    return out


def _outcome(run: Callable[[], Any]) -> Any:
    """What ``run`` returns, or the kind of error it raised."""
    try:
        return run()
    except (ValueError, TypeError, UnicodeEncodeError, OverflowError) as exc:
        return type(exc)


def check_chain(inputs: list[tuple]) -> None:
    for algo, size, style, tokens, extras, parent in inputs:
        hasher = BlockHasher(config(algo, block_size=size, extra_key_style=style), memo_size=0)

        def chain(hasher: BlockHasher = hasher, tokens: Any = tokens, extras=extras, parent=parent):
            return hasher.keys(tokens, extras, parent), hasher.digests(tokens, extras, parent)

        got = _outcome(chain)
        with pure_hashing():
            want = _outcome(chain)
        assert got == want, (algo, size, style)


@needs(compiled.chain, "indexer/_chain.c")
def test_fuzz_chain() -> None:
    seeds = [chain_inputs(random.Random(i)) for i in range(4)]
    fuzz("chain", seeds, chain_inputs, check_chain)


# -- the memory table: the compiled probing kernels against numpy ---------------------------

MEMBERS = [f"127.0.0.{i}:8000" for i in range(1, 6)]


def table_workload(rng: random.Random) -> tuple[list[list[Change]], list[list[int]]]:
    """Steps of changes and the lookups after them, their keys the block hashes of
    (mutated) payloads, colliding keys and key 0."""
    pool = [0, 1, corpus.U64]
    for _ in range(3):
        try:
            batch = BatchDecoder().decode(mutated_msgpack(PAYLOADS, rng)).batch
        except (DecodeError, RecursionError):
            continue
        for event in batch.events:
            pool += [hash_to_int(h) for h in getattr(event, "block_hashes", ())]
    pool += colliding(rng.choice([0, 50, 400]), rng)
    pool += [rng.getrandbits(64) for _ in range(200)]
    steps = []
    for _ in range(rng.randint(1, 6)):
        changes = []
        for _ in range(rng.randint(1, 5)):
            member = rng.choice(MEMBERS)
            op = rng.choice([Op.STORE, Op.STORE, Op.REMOVE, Op.ANNOUNCE, Op.CLEAR])
            keys = [] if op is Op.CLEAR else rng.choices(pool, k=rng.randint(1, 300))
            changes.append(Change(op, member, "m", rng.choice(list(Tier)), keys))
        steps.append(changes)
    probes = [rng.choices(pool, k=rng.randint(1, 40)) for _ in range(4)]
    return steps, probes


@needs(compiled.probe, "indexer/memory/_probe.c")
def test_fuzz_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    def check(workload: tuple) -> None:
        steps, probes = workload
        fast = MemoryBackend(hash_seed=TABLE_SEED)
        with monkeypatch.context() as numpy_only:
            numpy_only.setattr(compiled, "probe", None)
            slow = MemoryBackend(hash_seed=TABLE_SEED)
        for changes in steps:
            fast.apply(changes)
            with monkeypatch.context() as numpy_only:
                numpy_only.setattr(compiled, "probe", None)
                slow.apply(changes)
                want = [slow.lookup("m", keys) for keys in probes]
                want_keys = {m: sorted(slow.member_keys(m, "m")) for m in MEMBERS}
                want_facts = facts(slow)
            assert [fast.lookup("m", keys) for keys in probes] == want
            assert {m: sorted(fast.member_keys(m, "m")) for m in MEMBERS} == want_keys
            assert facts(fast) == want_facts

    seeds = [table_workload(random.Random(i)) for i in range(2)]
    fuzz("probe", seeds, table_workload, check)


# -- Redis answers: the compiled reader against hiredis ------------------------------------

RESP_BYTES = b"+-:$*%~_#\r\n0123456789tf"


def lookup_case(rng: random.Random) -> tuple[bytes, int, int, bytes, int]:
    """A lookup's MULTI/EXEC answer: (bytes, heads, commands, order, per_key)."""
    per_key = rng.choice([1, 3])
    n = rng.randint(0, 12)
    order = list(range(n))
    rng.shuffle(order)
    values: list[bytes | None] = [
        None if rng.random() < 0.3 else rng.randbytes(rng.randint(0, 4)) for _ in range(n * per_key)
    ]
    commands = rng.randint(1, 3) if values else 0
    cuts = sorted(rng.randint(0, len(values)) for _ in range(max(commands - 1, 0)))
    hmgets = [values[a:b] for a, b in zip([0, *cuts], [*cuts, len(values)], strict=True)]
    heads = [[b"16", b"1", None], [b"0", None], [b"0", b"127.0.0.1:8000"]]
    answer = corpus.lookup_answer(heads, hmgets)
    return answer, len(heads), len(hmgets), array("i", order).tobytes(), per_key


def mutated_resp(rng: random.Random) -> tuple[bytes, int, int, bytes, int]:
    if rng.random() < 0.5:
        answer, heads, commands, order, per_key = lookup_case(rng)
    else:
        parts = rng.choices(corpus.RESP_REPLIES, k=rng.randint(1, 3))
        answer, heads, commands, order, per_key = b"".join(parts), len(parts), 0, b"", 1
    if rng.random() < 0.8:
        answer = mutate_bytes(answer, rng, RESP_BYTES, corpus.RESP_REPLIES)
    return answer, heads, commands, order, per_key


def _hiredis_replies(data: bytes, count: int) -> list | str:
    more = object()  # not False: that is also a RESP3 boolean's value
    reader = hiredis.Reader(replyError=lambda message: ("error", message), notEnoughData=more)
    reader.feed(data)
    out = []
    try:
        for _ in range(count):
            reply = reader.gets()
            if reply is more:
                return "incomplete"
            out.append(reply)
    except (hiredis.ProtocolError, MemoryError):  # hiredis makes a list of n up front
        return "bad"
    except TypeError:  # a map whose key is a list: no dict holds it
        return TypeError
    return out


def check_resp(case: tuple[bytes, int, int, bytes, int]) -> None:
    data, heads, commands, order, per_key = case
    count = heads + commands + 2 if commands else heads
    buffer = bytearray(data)
    try:
        end = kernels.frame(buffer, len(data), count)
    except ValueError:
        return  # not RESP kvindex reads: the connection is dropped (hiredis may read more)
    if end < 0:  # incomplete: hiredis must not find the replies whole either
        assert not isinstance(_hiredis_replies(data, count), list)
        return
    try:
        got = kernels.decode(buffer, end, count, lambda message: ("error", message))
    except TypeError:
        got = TypeError
    assert got == _hiredis_replies(data[:end], count)
    if got is TypeError:
        return
    if not commands:
        return
    parsed = kernels.parse_lookup(buffer, end, heads, commands, order, per_key)
    if parsed is None:  # not a clean lookup: the caller reads it with decode()
        return
    replies = got[-1]
    flat = [[x for item in r.items() for x in item] if isinstance(r, dict) else r for r in replies]
    assert parsed[0] == flat[:heads]
    values = [v for reply in replies[heads:] for v in reply]
    assert (parsed[1], parsed[2]) == rows_of(values, order, per_key)


@needs(kernels, "indexer/redis/_redis_lookup.c")
def test_fuzz_redis_replies() -> None:
    seeds = [(r, 1, 0, b"", 1) for r in corpus.RESP_REPLIES]
    seeds += [lookup_case(random.Random(i)) for i in range(4)]
    fuzz("redis_replies", seeds, mutated_resp, check_resp)


#: Replies the compiled reader once took and hiredis refuses: each read as a value
#: (a nil, a boolean, an integer, a status) that Redis never sent.
NOT_RESP = [
    b"_WRONGTYPE\r\n",  # RESP3's null is the type byte alone
    b"#true\r\n",
    b"+QUEUED\nQUEUED\r\n",  # a lone \n inside a status line
    b"-ERR a\rb\r\n",
    b"$01\r\nx\r\n",  # lengths and integers: no leading zero, '+' or "-0"
    b"*+1\r\n:1\r\n",
    b":-0\r\n",
    b"%9223372036854775807\r\n:42\r\n",  # twice that many items overflowed
]


@needs(kernels, "indexer/redis/_redis_lookup.c")
@pytest.mark.parametrize("reply", NOT_RESP)
def test_the_reply_reader_refuses_what_hiredis_refuses(reply: bytes) -> None:
    assert _hiredis_replies(reply, 2) == "bad"
    with pytest.raises(ValueError):
        kernels.frame(bytearray(reply), len(reply), 2)

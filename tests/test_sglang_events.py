"""SGLang's KV events: every layout its releases emitted decodes, and what SGLang 0.5.23's
own publisher sent indexes exactly by token content.

``tests/fixtures/sglang/sglang_0_5_23_payloads.txt`` holds the payload frames SGLang
0.5.23's own classes encode (``tests/conformance/sglang_driver.py --capture``, run under
the venv of ``sglang_env.sh``); ``..._truth.json`` what each pod then holds. The older
layouts are built here from the field lists of each release's ``kv_events.py``
(events/wire/sglang.py lists them).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvindex.api.serve.settings_derived import ConfigError, build_catalog
from kvindex.api.serve.settings_sources import from_flags
from kvindex.events.ingest.sink import Delivery
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.sglang import (
    LOAD_TOPIC,
    SglangBatchDecoder,
    SglangBlockStored,
    decode_load,
)
from kvindex.events.wire.vllm import (
    AllBlocksCleared,
    BatchDecoder,
    BlockRemoved,
    DecodeError,
    tokens_of,
)
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.keys import HashConfig
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import Engine, KeyMode, ModelCatalog, ModelKeying
from kvindex.indexer.token_keys import ContentHasher
from kvindex.scoring.scorer import Scorer

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
MODEL = "sglang-model"
U64 = 2**64


def payloads() -> list[tuple[str, bytes]]:
    lines = (FIXTURES / "sglang_0_5_23_payloads.txt").read_text().split()
    pairs = [(lines[i], bytes.fromhex(lines[i + 1])) for i in range(0, len(lines), 2)]
    return [(pod, payload) for pod, payload in pairs if pod != LOAD_TOPIC.decode()]


def load_payload() -> bytes:
    lines = (FIXTURES / "sglang_0_5_23_payloads.txt").read_text().split()
    return bytes.fromhex(lines[lines.index(LOAD_TOPIC.decode()) + 1])


def truth() -> dict:
    return json.loads((FIXTURES / "sglang_0_5_23_truth.json").read_text())


def sglang_keying(**kw: object) -> ModelKeying:
    return ModelKeying(
        hash=HashConfig(block_size=4),
        key_mode=KeyMode.TOKENS,
        engines=frozenset({Engine.SGLANG}),
        **kw,  # type: ignore[arg-type]
    )


class Index:
    def __init__(self) -> None:
        self.catalog = ModelCatalog(models={MODEL: sglang_keying()})
        self.backend = MemoryBackend()
        self.ingestor = Ingestor(self.backend, self.catalog)
        self.scorer = Scorer(self.backend, self.catalog, layouts=self.ingestor.layouts)
        self.decoder = SglangBatchDecoder()
        self.seq = 0

    def deliver(self, pod: str, payload: bytes) -> None:
        decoded = self.decoder.decode(payload)
        assert decoded.skipped == {}
        delivery = Delivery(StreamId(pod), MODEL, self.seq, decoded.batch, 0.0)
        self.ingestor.deliver([delivery])
        self.seq += 1

    def matched(self, tokens: list[int], salt: str | None = None) -> dict[str, tuple]:
        result = self.scorer.score(MODEL, tokens, cache_salt=salt)
        return {p.pod: (p.matched_blocks, p.gpu_blocks, p.cpu_blocks) for p in result.pods}


def test_sglang_0_5_23_payloads_decode_whole_with_signed_hashes_made_uint64() -> None:
    raw_hashes = []
    for _, payload in payloads():
        raw = msgspec.msgpack.decode(payload)
        raw_hashes += [h for e in raw[1] if isinstance(e, dict) for h in e.get("block_hashes", [])]
        events = SglangBatchDecoder().decode(payload).batch.events
        for event in events:
            for h in getattr(event, "block_hashes", []):
                assert 0 <= h < U64
    assert any(h < 0 for h in raw_hashes), "the fixture should hold negative (signed) ids"
    # vLLM's decoder refuses them: why a model with SGLang pods must say so
    negative = next(p for _, p in payloads() if b"\xd3" in p)
    assert BatchDecoder().decode(negative).skipped


def test_sglang_fields_become_what_ingest_reads() -> None:
    events = [e for _, p in payloads() for e in SglangBatchDecoder().decode(p).batch.events]
    stores = [e for e in events if isinstance(e, SglangBlockStored)]
    assert {e.session_id for e in stores} == {"s1", "s2", "s3", "s4", None}
    assert {e.medium for e in stores} == {"GPU", "CPU"}  # CPU_PINNED is the host tier
    salted = next(e for e in stores if e.session_id == "s2")
    assert salted.extra_keys == [["tenant-a"], None]  # vLLM <= 0.30's bare salt, block 0
    assert tokens_of(salted) == list(range(3000, 3008))
    assert any(isinstance(e, AllBlocksCleared) for e in events)
    assert any(isinstance(e, BlockRemoved) for e in events)


def test_published_ids_resolve_to_the_content_keys_of_their_blocks() -> None:
    index = Index()
    for pod, payload in payloads():
        index.deliver(pod, payload)
    chat = truth()["prompts"]["chat"]
    published = msgspec.msgpack.decode(payloads()[0][1])[1][0]["block_hashes"]
    ids = [h + U64 if h < 0 else h for h in published] + [12345]
    content = ContentHasher(4).keys(chat[:16])
    assert index.ingestor.own_keys_of(ids) == [*content, None]


def test_sglang_0_5_23_payloads_score_exactly_by_token_ids() -> None:
    index = Index()
    for pod, payload in payloads():
        index.deliver(pod, payload)
    expected = truth()
    prompts = expected["prompts"]
    a, b = "127.0.0.41:8000", "127.0.0.42:8000"
    assert index.matched(prompts["chat"]) == {a: (5, 5, 0)}  # each block at its best tier
    assert index.matched(prompts["other"]) == {b: (3, 3, 0)}
    assert index.matched(prompts["salted"], salt=expected["salt"]) == {a: (2, 2, 0)}
    assert index.matched(prompts["salted"]) == {}  # unsalted: another cache namespace
    assert len(expected[a]["gpu"]) == 5 and len(expected[b]["gpu"]) == 3


def array(*events: object) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), 0])


#: Releases whose own classes wrote ``sglang_<release>_payloads.txt``
#: (``fixtures/sglang/capture_releases.py``), one per layout: arrays ending at lora_id,
#: + medium, + DISK/EXTERNAL media, + a {cache_salt} map at position 7, map events.
OLDER = {"0.4.9": False, "0.5.10": False, "0.5.15": False, "0.5.18": True, "0.5.20": True}


@pytest.mark.parametrize(("release", "salted"), OLDER.items())
def test_every_older_sglang_layout_decodes_whole_and_scores_exactly(
    release: str, salted: bool
) -> None:
    index = Index()
    text = (FIXTURES / f"sglang_{release.replace('.', '_')}_payloads.txt").read_text()
    for line in text.split():
        index.deliver("127.0.0.43:8000", bytes.fromhex(line))  # asserts nothing skipped
    pod = "127.0.0.43:8000"
    # stored 1..12, evicted 9..12, cleared, stored 1..8 again (and a host copy)
    assert index.matched(list(range(1, 13))) == {pod: (2, 2, 0)}
    expected = {pod: (2, 2, 0)} if salted else {}
    assert index.matched(list(range(21, 29)), salt="tenant") == expected
    assert index.matched(list(range(21, 29))) == {}


def test_external_pool_is_not_indexed_and_disk_is_storage() -> None:
    index = Index()
    tokens = list(range(1, 9))
    event = {
        "type": "BlockStored", "block_hashes": [-1, -2], "parent_block_hash": None,
        "token_ids": tokens, "block_size": 4, "lora_id": None,
    }  # fmt: skip
    index.deliver("127.0.0.44:8000", array({**event, "medium": "EXTERNAL"}))
    assert index.matched(tokens) == {}
    assert index.ingestor.counts.skipped["remote_locality"] == 1
    index.deliver("127.0.0.44:8000", array({**event, "medium": "DISK"}))
    result = index.scorer.score(MODEL, tokens).pods[0]
    assert (result.matched_blocks, result.storage_blocks) == (2, 2)


def test_engines_setting_keys_sglang_models_by_tokens_and_refuses_engine_keys(
    tmp_path: Path,
) -> None:
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": {MODEL: {"engines": ["vllm", "sglang"]}}}))
    catalog = build_catalog(from_flags(model_config=str(config)))
    assert catalog.keying(MODEL).key_mode is KeyMode.TOKENS
    assert catalog.models_with(Engine.SGLANG) == [MODEL]
    config.write_text(
        json.dumps({"models": {MODEL: {"engines": ["vllm", "sglang"], "key_mode": "engine"}}})
    )
    with pytest.raises(ConfigError, match="sglang pods publish block hashes kvindex cannot"):
        build_catalog(from_flags(model_config=str(config)))


def test_sglang_load_topic_payload_decodes() -> None:
    stat = decode_load(load_payload())  # what SGLang 0.5.23's own LoadStat encodes
    assert (stat.num_running_reqs, stat.num_waiting_reqs, stat.attn_dp_rank) == (3, 2, 1)
    assert stat.kv_usage == 0.25
    assert stat.num_waiting_uncached_tokens == 700
    with pytest.raises(DecodeError, match="invalid_load"):
        decode_load(msgspec.msgpack.encode(["LoadStat", -1, 0, 0, 0]))


def test_bad_sglang_input_costs_only_itself_with_vllms_reasons() -> None:
    decoder = SglangBatchDecoder()
    good = {"type": "BlockRemoved", "block_hashes": [-1]}
    decoded = decoder.decode(
        array(good, {"type": "Evicted"}, {"type": "BlockStored", "block_hashes": "x"}, good)
    )
    assert decoded.skipped == {"unknown_event_type": 1, "invalid_event": 1}
    assert [e.block_hashes for e in decoded.batch.events] == [[U64 - 1], [U64 - 1]]
    fractional = array({"type": "BlockRemoved", "block_hashes": [1.5]})
    assert decoder.decode(fractional).skipped == {"invalid_event": 1}
    for payload, reason in [
        (b"\xc1", "malformed_msgpack"),
        (msgspec.msgpack.encode({"ts": 1.0}), "invalid_batch"),
        (msgspec.msgpack.encode([1.0, 5, 0]), "invalid_batch"),
    ]:
        with pytest.raises(DecodeError) as caught:
            decoder.decode(payload)
        assert caught.value.reason == reason

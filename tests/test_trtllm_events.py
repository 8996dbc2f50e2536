"""TensorRT-LLM's streaming KV events (vLLM's wire format, its own block hashes) decode
with vLLM's decoder and index by token content.

The payloads (``fixtures/trtllm/trtllm_streaming_payloads.txt``) are built from the
documented format by ``fixtures/trtllm/make_trtllm_payloads.py``, not captured from the
engine (its wheel needs CUDA).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvindex.events.ingest.sink import Delivery
from kvindex.events.wire.identity import StreamId
from kvindex.events.wire.scanned import scan, scanner
from kvindex.events.wire.vllm import BatchDecoder, Layout
from kvindex.indexer.ingest import Ingestor
from kvindex.indexer.keys import HashConfig
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.models import Engine, KeyMode, ModelCatalog, ModelKeying
from kvindex.scoring.scorer import Scorer

PAYLOADS = [
    bytes.fromhex(line)
    for line in (Path(__file__).parent / "fixtures" / "trtllm" / "trtllm_streaming_payloads.txt")
    .read_text()
    .split()
]
MODEL = "trtllm-model"
POD = StreamId("127.0.0.51:8000")


def test_trtllm_payloads_decode_whole_as_vllm_map_events() -> None:
    decoder = BatchDecoder()
    for payload in PAYLOADS:
        decoded = decoder.decode(payload, Layout.MAP)
        assert decoded.layout is Layout.MAP and decoded.skipped == {}
        assert decoded.batch.data_parallel_rank == 0
    if scanner is not None:  # the compiled fast path takes the text-only ones too (the
        # multimodal one's mm_keys maps it leaves to msgspec, as it does any nested map)
        assert [scan(p) is not None for p in PAYLOADS] == [True, True, True, False]


def test_trtllm_events_index_by_token_content() -> None:
    catalog = ModelCatalog(
        models={
            MODEL: ModelKeying(
                hash=HashConfig(block_size=4),
                key_mode=KeyMode.TOKENS,
                engines=frozenset({Engine.TRTLLM}),
            )
        }
    )
    backend = MemoryBackend()
    ingestor = Ingestor(backend, catalog)
    decoder = BatchDecoder()
    for seq, payload in enumerate(PAYLOADS):
        batch = decoder.decode(payload, Layout.MAP).batch
        ingestor.deliver([Delivery(POD, MODEL, seq, batch, 0.0)])
    scorer = Scorer(backend, catalog, layouts=ingestor.layouts)
    prompt = list(range(100, 112)) + list(range(200, 204))
    (pod,) = scorer.score(MODEL, prompt).pods
    assert (pod.pod, pod.matched_blocks) == (POD.member, 3)  # the child was evicted
    # A multimodal block's placeholder tokens are strings: not a token-content key
    assert ingestor.counts.skipped["invalid_token_ids"] == 1


def test_trtllm_models_must_be_keyed_by_tokens() -> None:
    from kvindex.indexer.keys import KeyConfigError

    keying = ModelKeying(engines=frozenset({Engine.TRTLLM}))
    with pytest.raises(KeyConfigError, match="trtllm pods publish block hashes"):
        ModelCatalog(models={MODEL: keying})

"""Runs vLLM 0.33's offloading-connector event translation and prints its KV events with
the truth after each step.

Run by the interpreter of a venv holding vLLM (``KVTEST_VLLM_PYTHON``, else the
checkout's ``.venv-vllm``), never imported by kvindex: ``tests/test_vllm_offload.py``
starts it and replays its output into the index. No model and no GPU: real ``Request``s
hashed by ``get_request_block_hasher``, and the connector's own
``OffloadingEventsTracker`` (``distributed/kv_transfer/kv_connector/v1/offloading/
events.py``), which turns the tiers' ``OffloadingEvent``s into the ``BlockStored`` and
``BlockRemoved`` a pod publishes. The tiers' events are made here as vLLM's tier
managers make them (``kv_offload/tiering``): the primary CPU tier (no ownership), the
KVCR tier's CPU and G3 inventories (ownership ``"kvcr"``, ``removal_expected``), a
LOCAL filesystem tier (medium STORAGE, stores only) and a REMOTE one.

Phases: ``placeholder`` (the default: ``self_describing_kv_events`` off, a store names
only its chunk's OffloadKey hash, ``block_size`` 0, no tokens) with one block per
chunk, and ``self-describing`` with two blocks per chunk.

Output, one JSON object per line: ``{"phase", "payload", "cpu", "storage", "cpu_shared"}``;
``payload`` is the step's ``KVEventBatch`` msgpack-encoded as vLLM's
``ZmqEventPublisher`` does (base64); ``cpu`` and ``storage`` the uint64 block hashes some
LOCAL residency of that medium holds after the step (what a request could load from
the pod itself); ``cpu_shared`` how many chunks two CPU residencies hold at once.
"""

from __future__ import annotations

import base64
import json
import random
import time

import msgspec
from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec,
    OffloadingEventsTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.kv_offload.base import (
    Locality,
    Medium,
    OffloadingEvent,
    OffloadingKVEventsConfig,
    make_offload_key,
)
from vllm.v1.request import Request

BLOCK = 16
MASK = 2**64 - 1
# (medium, ownership, locality, publishes removals): the residencies a chunk can have.
RESIDENCIES = [
    (Medium.CPU, None, None, True),  # the primary CPU tier
    (Medium.CPU, "kvcr", None, True),  # KVCR's local DRAM inventory
    (Medium.STORAGE, "kvcr", None, True),  # KVCR's G3 inventory
    (Medium.STORAGE, None, Locality.LOCAL, False),  # a local filesystem tier
    (Medium.STORAGE, None, Locality.REMOTE, False),  # shared network storage
]


def u64(block_hash: bytes | int) -> int:
    value = maybe_convert_block_hash(block_hash)
    return value & MASK if isinstance(value, int) else int.from_bytes(value, "big") & MASK


def run(phase: str, self_describing: bool, blocks_per_chunk: int, rng: random.Random) -> None:
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    tracker = OffloadingEventsTracker(
        OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=True)
        if self_describing
        else OffloadingKVEventsConfig(True, False)
    )
    group = GroupOffloadConfig(
        group_idx=0,
        tokens_per_block=BLOCK,
        tokens_per_chunk=BLOCK * blocks_per_chunk,
        hashes_per_chunk=blocks_per_chunk,
        kv_event_group_spec=OffloadingEventGroupSpec("full_attention", None),
        sliding_window_size_in_chunks=None,
        kv_cache_spec=None,  # type: ignore[arg-type]  # read by the scheduler, not here
        manager_cls=None,  # type: ignore[arg-type]
    )
    encoder = msgspec.msgpack.Encoder()
    # chunk key -> (request, chunk index, the chunk's GPU block hashes)
    chunks: dict[bytes, tuple[Request, int, list[int]]] = {}
    held: dict[int, set[bytes]] = {i: set() for i in range(len(RESIDENCIES))}
    prefix = [rng.randrange(30_000) for _ in range(3 * BLOCK)]
    for number in range(40):
        tokens = prefix[: rng.choice([0, BLOCK, 3 * BLOCK])]
        tokens += [rng.randrange(30_000) for _ in range(rng.randint(1, 6) * BLOCK + 3)]
        request = Request(f"r{number}", tokens, SamplingParams(max_tokens=1), None)
        request.block_hasher = hasher
        request.block_hashes = hasher(request)
        for chunk in range(len(request.block_hashes) // blocks_per_chunk):
            last = request.block_hashes[(chunk + 1) * blocks_per_chunk - 1]
            key = make_offload_key(last, 0)
            first = chunk * blocks_per_chunk
            span = request.block_hashes[first : first + blocks_per_chunk]
            chunks.setdefault(key, (request, chunk, [u64(h) for h in span]))
        events: list[OffloadingEvent] = []
        for _ in range(rng.randint(3, 12)):
            where = rng.randrange(len(RESIDENCIES))
            medium, ownership, locality, removes = RESIDENCIES[where]
            key = rng.choice(list(chunks))
            if key in held[where]:
                if not removes:
                    continue
                held[where].discard(key)
                events.append(
                    OffloadingEvent([key], medium, True, locality=locality, ownership=ownership)
                )
                continue
            owner, chunk, _ = chunks[key]
            # The scheduler snapshots the payload when it builds the store job.
            tracker.record_store(owner, group, chunk, key)
            held[where].add(key)
            events.append(
                OffloadingEvent(
                    [key],
                    medium,
                    False,
                    locality=locality,
                    ownership=ownership,
                    removal_expected=ownership is not None,
                )
            )
        batch = KVEventBatch(ts=time.time(), events=list(tracker.take_events(events)))
        truth: dict[str, set[int]] = {"CPU": set(), "STORAGE": set()}
        for where, keys in held.items():
            medium, _, locality, _ = RESIDENCIES[where]
            if locality is Locality.REMOTE:
                continue
            for key in keys:
                truth[medium.value].update(chunks[key][2])
        line = {
            "phase": phase,
            "payload": base64.b64encode(encoder.encode(batch)).decode(),
            "cpu": sorted(truth["CPU"]),
            "storage": sorted(truth["STORAGE"]),
            # chunks the primary CPU tier and KVCR's CPU inventory both hold
            "cpu_shared": len(held[0] & held[1]),
        }
        print(json.dumps(line), flush=True)


def main() -> None:
    run("placeholder", False, 1, random.Random(1))
    run("self-describing", True, 2, random.Random(2))


if __name__ == "__main__":
    main()

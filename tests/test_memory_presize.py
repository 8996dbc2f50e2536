"""A memory index sized up front (``expected_keys``) answers as one grown from empty,
without rebuilding on the way there."""

from __future__ import annotations

import numpy as np
import pytest

from kvindex.indexer.backend import Change, Op, Tier
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.memory.table import MIN_CAP, BlockTable


def _fill(backend: MemoryBackend, keys: np.ndarray) -> None:
    for i in range(0, keys.size, 4096):
        backend.apply([Change(Op.STORE, "p", "m", Tier.GPU, keys[i : i + 4096])])
    backend.apply([Change(Op.REMOVE, "p", "m", Tier.GPU, keys[:100])])
    backend.apply([Change(Op.STORE, "q", "m", Tier.CPU, keys[50:300])])


def test_a_presized_index_needs_no_growth_and_answers_the_same() -> None:
    keys = np.random.default_rng(5).integers(1, 2**64 - 1, 60_000, dtype=np.uint64)
    grown, presized = MemoryBackend(hash_seed=9), MemoryBackend(hash_seed=9, expected_keys=60_000)
    _fill(grown, keys)
    _fill(presized, keys)
    assert grown.stats().extra["rebuilds"] >= 5
    assert presized.stats().extra["rebuilds"] == 0
    assert presized.stats().extra["table_slots"] >= 2 * 60_000
    for member in ("p", "q"):
        for tier in Tier:
            assert presized.member_keys(member, "m", tier) == grown.member_keys(member, "m", tier)
    chain = keys[40:400].tolist()
    assert presized.lookup("m", chain) == grown.lookup("m", chain)
    assert presized.stats().keys == grown.stats().keys


def test_the_hint_is_checked() -> None:
    with pytest.raises(ValueError):
        MemoryBackend(expected_keys=-1)
    with pytest.raises(ValueError):
        BlockTable(1, seed=0, stamped=False, cap=MIN_CAP + 1)
    assert MemoryBackend(expected_keys=0).stats().extra["table_slots"] == 0  # no table yet


def test_the_expected_blocks_flag_sizes_the_memory_index() -> None:
    from kvindex.api.serve import cli
    from kvindex.api.serve.service_parts import make_backend

    def backend_for(argv: list[str]) -> MemoryBackend:
        args = cli.build_parser().parse_args(["serve", *argv])
        backend = make_backend(cli._settings_from(args, {}))
        assert isinstance(backend, MemoryBackend)
        backend.apply([Change(Op.STORE, "p", "m", Tier.GPU, [1, 2, 3])])
        return backend

    sized = backend_for(["--expected-blocks", "60000"])
    assert sized.stats().extra["table_slots"] >= 2 * 60_000
    assert backend_for([]).stats().extra["table_slots"] < 2 * MIN_CAP
    args = cli.build_parser().parse_args(["serve"])
    environ = {"KVINDEX_EXPECTED_BLOCKS": "5000"}
    assert cli._settings_from(args, environ).index.expected_blocks == 5000

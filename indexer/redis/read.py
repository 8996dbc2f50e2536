"""Reading block bitmaps from Redis for a lookup: one MULTI/EXEC of plain HMGETs.

Why not a Lua script: Redis runs one script at a time, so a replica's lookups per
second would be capped by the script's own time; plain reads cost Redis a fraction of a
walk in Lua (``bench/bench_redis.py``), and the walk moves into the client
(:mod:`kvindex.indexer.redis.walk`), which scales with replicas. The reads are one
transaction, so a lookup still sees every apply whole or not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import chain
from typing import Any

import numpy as np

from kvindex.indexer.backend import BackendError, BackendUnavailable
from kvindex.indexer.redis.compiled import kernels
from kvindex.indexer.redis.connection import RedisConnection
from kvindex.indexer.redis.keys import LAYOUT, KeySpace, ModelKeys, RedisLayoutError
from kvindex.indexer.redis.wire import EXEC, MULTI, command, key_array, pack_reads

#: Reads of one lookup at most: a stale name map, then a model that just gained tiers.
_ATTEMPTS = 3
_LAYOUT = str(LAYOUT).encode()


class IndexLost(BackendUnavailable):
    """A model this reader has read is gone from Redis: its ``meta`` key is never
    deleted, so Redis lost the index (restarted empty, flushed). Raised until the loss
    is taken in (:meth:`BlockReader.forget_all`: every replica then says which streams
    are being rebuilt) or the model is written again, instead of answering that nobody
    holds anything."""

    code = "redis_index_lost"


@dataclass(frozen=True, slots=True)
class ModelView:
    """What a reader knows of one model, checked against ``meta`` by every read."""

    buckets: int
    epoch: bytes | None
    names: dict[int, str]  # member id -> member
    ids: dict[str, int]
    rank: np.ndarray  # member id -> its place in name order (-1: no such id)
    by_id: list[str | None]  # member id -> member, for the compiled walk
    tiers: bool  # the model holds CPU or STORAGE entries

    @classmethod
    def of(cls, buckets: int, epoch: bytes | None, names: dict[int, str], tiers: bool) -> ModelView:
        size = max(names, default=-1) + 1
        rank = np.full(size, -1, np.int64)
        for place, mid in enumerate(sorted(names, key=names.__getitem__)):
            rank[mid] = place
        by_id = [names.get(mid) for mid in range(size)]
        ids = {n: mid for mid, n in names.items()}
        return cls(buckets, epoch, names, ids, rank, by_id, tiers)

    def with_state(self, buckets: int, tiers: bool) -> ModelView:
        """The same names (and epoch) with a newer bucket count and tier flag."""
        return ModelView(buckets, self.epoch, self.names, self.ids, self.rank, self.by_id, tiers)


@dataclass(slots=True)
class Blocks:
    """The looked-up keys' bitmaps as one matrix: a row per key, in key order, of
    ``per_key`` slots (GPU; or GPU, CPU, STORAGE when the model holds other tiers) of
    ``width`` bytes, each a member bitmap (bit ``id % 8`` of byte ``id // 8``) padded
    with zeros; a field nobody holds is all zeros. ``view`` names the member ids, from
    the same snapshot."""

    rows: bytes
    per_key: int
    width: int
    view: ModelView

    def slots(self) -> np.ndarray:
        """The matrix as a (keys, per_key, width) uint8 array."""
        if not self.width:
            return np.zeros((0, self.per_key, 0), np.uint8)
        return np.frombuffer(self.rows, np.uint8).reshape(-1, self.per_key, self.width)


class BlockReader:
    """Reads blocks of one model at a time; thread-safe (views are replaced whole).

    The answer is handed on as one matrix of bitmaps (:class:`Blocks`): the compiled
    kernels (indexer/redis/_redis_lookup.c) copy each bitmap into it straight from the socket's
    bytes; without them the replies are parsed (hiredis, or redis-py's reader) and the
    matrix built from them here (:func:`rows_of`). The same bytes either way.

    What a read needs besides the bitmaps comes in the same transaction: the model's
    ``meta`` (bucket count, layout, epoch) and whether it holds CPU or STORAGE entries at
    all (``stats``). The member id -> name map is cached per model (:class:`ModelView`)
    and read again only when ``meta``'s epoch moved (a member was given or lost its id);
    then, as when a model first gained CPU entries, the read is repeated once with the
    missing part, so the answer always comes from one snapshot.
    """

    def __init__(self, connection: RedisConnection, keyspace: KeySpace) -> None:
        self._connection = connection
        self._keyspace = keyspace
        self._views: dict[str, ModelView] = {}
        self._vanished: set[str] = set()  # models read before that Redis no longer has
        self._packed_heads: dict[str, tuple[bytes, bytes, bytes]] = {}
        self._bucket_prefixes: dict[str, bytes] = {}

    def read(self, model: str, keys: Sequence[int] | np.ndarray) -> Blocks | None:
        """The bitmaps of ``keys`` (uint64 values: a list of ints or an array) in
        ``model``, or None when the index holds nothing of the model; ValueError unless
        every key is in [0, 2**64)."""
        compiled = self._connection.compiled
        if not compiled or not isinstance(keys, list | tuple):  # C reads lists of ints
            keys = key_array(keys)
        names = self._keyspace.model(model)
        view = self._views.get(model)
        if view is None:
            if compiled:
                kernels.pack_reads(keys, 1, b"", False)  # type: ignore[union-attr]  # checks the keys
            view = self._header(model, names)
            if view is None:
                if model in self._vanished:
                    raise self._lost(model)
                return None
            self._vanished.discard(model)
        tiers, fresh_names = view.tiers, False
        for attempt in range(_ATTEMPTS):
            last = attempt == _ATTEMPTS - 1
            tiers, fresh_names = tiers or last, fresh_names or last
            got = self._transaction(model, names, view, keys, tiers, fresh_names)
            if got is None:
                self._views.pop(model, None)
                self._vanished.add(model)
                raise self._lost(model)
            now, blocks, stale_names = got
            self._views[model] = now
            if now.buckets == view.buckets and not stale_names and (tiers or not now.tiers):
                return blocks
            fresh_names = fresh_names or stale_names
            tiers = tiers or now.tiers
            view = now
        raise BackendError(f"Redis: the reads of model {model!r} did not settle")

    def forget(self, model: str) -> None:
        self._views.pop(model, None)

    def forget_all(self) -> None:
        """Redis lost the index, and the replica knows: no cached view describes what
        it holds now, and reads answer what is there again."""
        self._views.clear()
        self._vanished.clear()

    def _lost(self, model: str) -> IndexLost:
        return IndexLost(
            f"Redis {self._connection.options.url.rpartition('@')[2]} no longer holds "
            f"model {model!r}: it lost the index (restarted without persistence, or "
            "flushed); the streams are being rebuilt"
        )

    # -- one transaction --------------------------------------------------------------------

    def _header(self, model: str, names: ModelKeys) -> ModelView | None:
        """The first read of a model: what it is, before any block of it is read."""
        heads = list(self._heads(model, names))
        replies = self._exec(names, b"".join(heads), len(heads))
        state = _model_state(model, self._keyspace.prefix, replies[0], replies[1])
        if state is None:
            return None
        return ModelView.of(state[0], state[1], _parse_names(replies[2]), state[2])

    def _transaction(
        self,
        model: str,
        names: ModelKeys,
        view: ModelView,
        keys: Sequence[int] | np.ndarray,
        tiers: bool,
        fresh_names: bool,
    ) -> tuple[ModelView, Blocks, bool] | None:
        """One read with ``view``'s bucket count: the view the snapshot describes, the
        blocks read and whether ``view``'s names were stale in that snapshot (None: the
        model is gone)."""
        heads = self._heads(model, names)[: 3 if fresh_names else 2]
        prefix = self._bucket_prefixes.get(model)
        if prefix is None:
            prefix = self._bucket_prefixes[model] = names.bucket_prefix().encode()
        pack = kernels.pack_reads if self._connection.compiled else pack_reads  # type: ignore[union-attr]
        body, commands, order = pack(keys, view.buckets, prefix, tiers)
        per_key = 3 if tiers else 1
        payload = b"".join([*heads, body])
        parse = partial(_parse_answer, len(heads), commands, order, per_key)
        got = self._exec(names, payload, len(heads) + commands, parse)
        if isinstance(got, tuple):  # the compiled reader took the answer whole
            replies, rows, width = got
        else:
            replies = got
            values = list(chain.from_iterable(replies[len(heads) :]))
            if len(values) != len(order) // 4 * per_key:
                raise BackendError(f"Redis answered {len(values)} fields of a lookup, not all")
            rows, width = rows_of(values, order, per_key)
        state = _model_state(model, self._keyspace.prefix, replies[0], replies[1])
        if state is None:
            return None
        buckets, epoch, has_tiers = state
        stale = False
        if fresh_names:
            now = ModelView.of(buckets, epoch, _parse_names(replies[2]), has_tiers)
        else:
            stale = epoch != view.epoch  # then keep the epoch the names belong to
            now = view.with_state(buckets, has_tiers)
        return now, Blocks(rows, per_key, width, now), stale

    def _heads(self, model: str, names: ModelKeys) -> tuple[bytes, bytes, bytes]:
        """The reads of ``meta``, ``stats`` and the member names, packed once per model."""
        heads = self._packed_heads.get(model)
        if heads is None:
            heads = self._packed_heads[model] = (
                command(b"HMGET", names.meta.encode(), b"buckets", b"layout", b"epoch"),
                command(b"HMGET", names.stats.encode(), b"t1", b"t2"),
                command(b"HGETALL", names.names.encode()),
            )
        return heads

    def _exec(
        self,
        names: ModelKeys,
        commands: bytes,
        count: int,
        parse: Callable[[bytearray, int], Any] | None = None,
    ) -> Any:
        """``commands`` (``count`` of them) in one MULTI/EXEC: EXEC's replies, or what
        ``parse`` made of the answer's bytes (the compiled path)."""
        payload = b"".join([MULTI, commands, EXEC])
        got = self._connection.exchange("lookup", names.meta, payload, count + 2, parse)
        if isinstance(got, tuple):
            return got
        answer = got[-1]
        for reply in chain(got, answer if isinstance(answer, list) else ()):
            if isinstance(reply, Exception):  # EXEC's answer holds a failed command's error
                with self._connection.guard("lookup"):
                    raise reply
        if not isinstance(answer, list):  # EXEC answered nil: the transaction did not run
            raise BackendError(f"Redis did not run a lookup's transaction: {answer!r}")
        return answer


def _parse_answer(
    heads: int, commands: int, order: bytes, per_key: int, buffer: bytearray, end: int
) -> tuple[list, bytes, int] | None:
    assert kernels is not None
    return kernels.parse_lookup(buffer, end, heads, commands, order, per_key)


def rows_of(values: list[bytes | None], order: bytes, per_key: int) -> tuple[bytes, int]:
    """The matrix of :class:`Blocks` and its slot width, from HMGET's values in reply
    order (``per_key`` per key; ``order``: native int32, the key of each group)."""
    width = max(map(len, filter(None, values)), default=0)
    if not width:
        return b"", 0
    slots: list[bytes | None] = [None] * len(values)
    keys = np.frombuffer(order, np.int32).astype(np.int64)
    where = (keys[:, None] * per_key + np.arange(per_key)).ravel().tolist()
    for at, value in zip(where, values, strict=True):
        slots[at] = value
    empty = bytes(width)
    return b"".join([v.ljust(width, b"\0") if v else empty for v in slots]), width


def _model_state(
    model: str, prefix: str, meta: list, stats: list
) -> tuple[int, bytes | None, bool] | None:
    """Bucket count, epoch and whether it holds CPU or STORAGE entries, from the
    replies of ``_meta`` and ``_stats`` (None: no such model); refuses another layout."""
    buckets, layout, epoch = meta
    if buckets is None:
        return None
    if layout != _LAYOUT:
        raise RedisLayoutError.found(prefix, model, layout)
    return int(buckets), epoch, any(v is not None and v != b"0" for v in stats)


def _parse_names(reply: dict | list) -> dict[int, str]:
    """HGETALL's reply: a map over RESP3 (redis-py's default), a flat list over RESP2."""
    if isinstance(reply, dict):
        return {int(mid): name.decode() for mid, name in reply.items()}
    return {int(reply[i]): reply[i + 1].decode() for i in range(0, len(reply), 2)}

"""Reading block bitmaps from Redis for a lookup: one MULTI/EXEC of plain HMGETs.

Why not a Lua script: Redis runs one script at a time, so a replica's lookups per
second are capped by the script's own time. The walk in Lua cost Redis ~0.9 ms per
512-block, 64-pod lookup; these reads alone cost it ~0.06 ms and the walk moves into
the client (:mod:`kvindex.indexer.redis_walk`), which scales with replicas. The reads
are one transaction, so a lookup still sees every apply whole or not at all.

What a read needs besides the bitmaps comes in the same transaction: the model's
``meta`` (bucket count, layout, epoch) and whether it holds CPU or STORAGE entries at
all (``stats``). The member id -> name map is cached per model (:class:`ModelView`)
and read again only when ``meta``'s epoch moved (a member was given or lost its id);
then, as when a model first gained CPU entries, the read is repeated once with the
missing part, so the answer always comes from one snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from kvindex.indexer.backend import BackendError
from kvindex.indexer.redis_conn import RedisConnection
from kvindex.indexer.redis_keys import LAYOUT, KeySpace, ModelKeys, RedisLayoutError, bucket_numbers
from kvindex.indexer.redis_wire import EXEC, MULTI, bulk, command, field_records, hmget

#: Reads of one lookup at most: a stale name map, then a model that just gained tiers.
_ATTEMPTS = 3
_LAYOUT = str(LAYOUT).encode()


@dataclass(frozen=True, slots=True)
class ModelView:
    """What a reader knows of one model, checked against ``meta`` by every read."""

    buckets: int
    epoch: bytes | None
    names: dict[int, str]  # member id -> member
    ids: dict[str, int]
    rank: np.ndarray  # member id -> its place in name order (-1: no such id)
    tiers: bool  # the model holds CPU or STORAGE entries

    @classmethod
    def of(cls, buckets: int, epoch: bytes | None, names: dict[int, str], tiers: bool) -> ModelView:
        rank = np.full(max(names, default=-1) + 1, -1, np.int64)
        for place, mid in enumerate(sorted(names, key=names.__getitem__)):
            rank[mid] = place
        return cls(buckets, epoch, names, {n: mid for mid, n in names.items()}, rank, tiers)

    def with_state(self, buckets: int, tiers: bool) -> ModelView:
        """The same names (and epoch) with a newer bucket count and tier flag."""
        return ModelView(buckets, self.epoch, self.names, self.ids, self.rank, tiers)


@dataclass(slots=True)
class Blocks:
    """Per looked-up key, in order: the member bitmap of its GPU, CPU and STORAGE
    entries (None: nobody). ``cpu`` and ``storage`` are None when the model holds GPU
    entries only. ``view`` names the member ids, from the same snapshot."""

    gpu: list[bytes | None]
    cpu: list[bytes | None] | None
    storage: list[bytes | None] | None
    view: ModelView


class BlockReader:
    """Reads blocks of one model at a time; thread-safe (views are replaced whole)."""

    def __init__(self, connection: RedisConnection, keyspace: KeySpace) -> None:
        self._connection = connection
        self._keyspace = keyspace
        self._views: dict[str, ModelView] = {}
        self._bucket_heads: dict[str, dict[int, bytes]] = {}
        self._packed_heads: dict[str, tuple[bytes, bytes, bytes]] = {}

    def read(self, model: str, keys: np.ndarray) -> Blocks | None:
        """The bitmaps of ``keys`` (uint64) in ``model``, or None when the index holds
        nothing of the model."""
        names = self._keyspace.model(model)
        view = self._views.get(model)
        if view is None:
            view = self._header(model, names)
            if view is None:
                return None
        tiers, fresh_names = view.tiers, False
        for attempt in range(_ATTEMPTS):
            last = attempt == _ATTEMPTS - 1
            tiers, fresh_names = tiers or last, fresh_names or last
            got = self._transaction(model, names, view, keys, tiers, fresh_names)
            if got is None:
                self._views.pop(model, None)
                return None
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

    # -- one transaction --------------------------------------------------------------------

    def _header(self, model: str, names: ModelKeys) -> ModelView | None:
        """The first read of a model: what it is, before any block of it is read."""
        replies = self._exec(names, list(self._heads(model, names)))
        state = _model_state(model, self._keyspace.prefix, replies[0], replies[1])
        if state is None:
            return None
        return ModelView.of(state[0], state[1], _parse_names(replies[2]), state[2])

    def _transaction(
        self,
        model: str,
        names: ModelKeys,
        view: ModelView,
        keys: np.ndarray,
        tiers: bool,
        fresh_names: bool,
    ) -> tuple[ModelView, Blocks, bool] | None:
        """One read with ``view``'s bucket count: the view the snapshot describes, the
        blocks read and whether ``view``'s names were stale in that snapshot (None: the
        model is gone)."""
        heads = list(self._heads(model, names)[: 3 if fresh_names else 2])
        order, groups = self._bucket_reads(model, names, view.buckets, keys, tiers)
        replies = self._exec(names, heads + groups)
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
        values = list(chain.from_iterable(replies[len(heads) :]))
        return now, _in_key_order(values, order, tiers, now), stale

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

    def _bucket_reads(
        self, model: str, names: ModelKeys, buckets: int, keys: np.ndarray, tiers: bool
    ) -> tuple[np.ndarray, list[bytes]]:
        """One HMGET per bucket the keys fall in; the order the keys are read in."""
        numbers = bucket_numbers(keys, buckets)
        order = np.argsort(numbers, kind="stable")
        numbers = numbers[order]
        rows, per_key = field_records(keys[order], tiers)
        body = rows.tobytes()
        width = rows.shape[1]
        starts = [0, *(np.flatnonzero(np.diff(numbers)) + 1).tolist()]
        ends = [*starts[1:], keys.size]
        heads = self._bucket_heads.setdefault(model, {})
        out = []
        for start, end, number in zip(starts, ends, numbers[starts].tolist(), strict=True):
            head = heads.get(number)
            if head is None:
                head = heads[number] = bulk(names.bucket(number).encode())
            out.append(hmget(head, (end - start) * per_key, body[start * width : end * width]))
        return order, out

    def _exec(self, names: ModelKeys, commands: list[bytes]) -> list:
        payload = b"".join([MULTI, *commands, EXEC])
        replies = self._connection.exchange("lookup", names.meta, payload, len(commands) + 2)
        for reply in replies:
            if isinstance(reply, Exception):
                with self._connection.guard("lookup"):
                    raise reply
        return replies[-1]


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


def _in_key_order(values: list, order: np.ndarray, tiers: bool, view: ModelView) -> Blocks:
    """The replies (in bucket order, one or three values per key) back in key order."""
    where = np.empty_like(order)
    where[order] = np.arange(order.size)
    at = where.tolist()
    if not tiers:
        return Blocks(list(map(values.__getitem__, at)), None, None, view)
    gpu, cpu, storage = values[0::3], values[1::3], values[2::3]
    return Blocks(
        list(map(gpu.__getitem__, at)),
        list(map(cpu.__getitem__, at)),
        list(map(storage.__getitem__, at)),
        view,
    )

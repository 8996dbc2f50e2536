"""vLLM v1's block pool for one KV-cache group, with the events it publishes.

Facts followed (vLLM ``v1/core/block_pool.py`` and ``kv_cache_manager.py``, 0.9-0.33):

* the pool is a fixed number of blocks; free blocks sit in one LRU free queue, never-used
  blocks first (in id order), and allocation pops the queue's head;
* only full blocks get a hash; a hashed free block stays cached until it is popped for a
  new allocation: then its hash is dropped and ``BlockRemoved`` is published (one event
  per evicted block, as vLLM does);
* a cache hit "touches" a block: its reference count goes up and, if it was free, it
  leaves the free queue;
* a request's blocks are released in reverse order, so the tail of a sequence is evicted
  before its head: cached (hashed) blocks to the queue's tail, blocks without a hash to
  its head, to be reused before any cached block (0.33 ``BlockPool.free_blocks``);
* a block gets its hash when it is scheduled, and ``BlockStored`` carries exactly the new
  full blocks, their token ids and the hash of the block before the first of them;
* the same hash may be held by two blocks (a fully cached prompt recomputes its last
  block; a one-block prompt sent twice stores both copies from the chain's root): vLLM
  0.33 keeps both (``BlockHashToBlockMap``: "we don't de-duplicate"), publishes a
  ``BlockStored`` per copy and a ``BlockRemoved`` per copy evicted, and still hits the
  hash while one copy is left (``get_cached_block`` returns any);
* ``reset_prefix_cache`` works only when no block is in use; it drops every hash and
  publishes ``AllBlocksCleared``.

Block keys are the published uint64s (the digest's last 8 bytes), which is what the
index stores. Besides the truth (which hashes the pool holds) the pool keeps the *event
view*: copy counts folded from the published events alone, as kvindex counts them under
vLLM's default report mode (``incremental``: every store adds a copy). vLLM's events
describe its pool exactly, so the two must be equal; :attr:`BlockPool.ghosts` names any
hash where they are not (a simulator bug, never vLLM behaviour).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvindex.events.wire.vllm import AllBlocksCleared, BlockRemoved, BlockStored

Event = BlockStored | BlockRemoved | AllBlocksCleared

#: vLLM >= 0.10.2 names the tier of every event; the GPU pool publishes "GPU".
MEDIUM = "GPU"


class PoolFull(Exception):
    """Not enough free blocks for an allocation (the caller should have checked)."""


class PoolBusy(Exception):
    """A prefix-cache reset while blocks are in use (vLLM refuses it too)."""


class BlockPool:
    """A fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("a pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Block id -> None in LRU order; the head is evicted first. An OrderedDict gives
        # O(1) removal from the middle, which a touch needs.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._refs = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks
        self._cached: dict[int, list[int]] = {}  # key -> block ids holding it
        # Copies per hash as the published events count them (every store adds one, every
        # removal takes one): built from the events only, so it checks that they
        # describe the pool (docs/correctness.md, "Copies and report modes").
        self._view: dict[int, int] = {}
        self.events: list[Event] = []
        self.evictions = 0
        self.duplicate_stores = 0

    # -- queries ------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take (free, cached or not)."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are cached (the longest cached prefix, in blocks)."""
        cached = self._cached
        for i, key in enumerate(keys):
            if key not in cached:
                return i
        return len(keys)

    def cached_keys(self) -> set[int]:
        """Every hash the pool holds now (the truth)."""
        return set(self._cached)

    def event_view(self) -> set[int]:
        """The hashes an index that applied every published event holds."""
        return set(self._view)

    @property
    def ghosts(self) -> set[int]:
        """Hashes on which the pool and its event view disagree (held without the events
        saying so, or the reverse). Always empty while the pool publishes what vLLM
        publishes: anything here is a simulator bug."""
        return set(self._cached).symmetric_difference(self._view)

    def hit_cost(self, keys: Sequence[int]) -> int:
        """Free blocks that touching ``keys``'s blocks would take off the free queue."""
        refs = self._refs
        return sum(1 for key in keys if refs[self._cached[key][0]] == 0)

    # -- the request life cycle ---------------------------------------------------

    def touch(self, keys: Sequence[int]) -> list[int]:
        """Pin the blocks holding ``keys`` (all cached); return their ids."""
        blocks = []
        for key in keys:
            block = self._cached[key][0]
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            blocks.append(block)
        return blocks

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the free queue's head, evicting cached ones."""
        if count > len(self._free):
            raise PoolFull(f"{count} blocks wanted, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def cache(
        self,
        blocks: Sequence[int],
        keys: Sequence[int],
        start: int,
        end: int,
        tokens: Sequence[int],
    ) -> None:
        """Give blocks ``start..end-1`` of a sequence their hashes; publish BlockStored.

        ``blocks`` and ``keys`` cover the whole sequence from its first block, ``tokens``
        at least up to block ``end``.
        """
        if end <= start:
            return
        size = self.block_size
        for i in range(start, end):
            block, key = blocks[i], keys[i]
            if self._key[block] is not None:
                raise ValueError(f"block {block} already holds a hash")
            self._key[block] = key
            holders = self._cached.get(key)
            if holders is None:
                self._cached[key] = [block]
            else:
                holders.append(block)
                self.duplicate_stores += 1
        self._publish(
            BlockStored(
                block_hashes=list(keys[start:end]),
                parent_block_hash=keys[start - 1] if start else None,
                token_ids=list(tokens[start * size : end * size]),
                block_size=size,
                medium=MEDIUM,
            )
        )

    def release(self, blocks: Sequence[int]) -> None:
        """Unpin a finished request's blocks, tail first: cached ones into the free
        queue's tail, the others to its head (reused first: they hold nothing to hit)."""
        refs, free, key = self._refs, self._free, self._key
        unhashed = []
        for block in reversed(blocks):
            refs[block] -= 1
            if refs[block] == 0:
                if key[block] is None:
                    unhashed.append(block)
                else:
                    free[block] = None
        for block in reversed(unhashed):  # the first released ends up at the very head
            free[block] = None
            free.move_to_end(block, last=False)

    def reset(self) -> None:
        """vLLM's ``reset_prefix_cache``: drop every hash; only when nothing is in use."""
        if len(self._free) != self.num_blocks:
            raise PoolBusy(f"{self.used_blocks} blocks are in use")
        self._key = [None] * self.num_blocks
        self._cached.clear()
        self._publish(AllBlocksCleared())

    def drain_events(self) -> list[Event]:
        """The events since the last drain (one scheduler step's batch)."""
        events, self.events = self.events, []
        return events

    def _evict(self, block: int) -> None:
        key = self._key[block]
        if key is None:
            return
        self._key[block] = None
        holders = self._cached[key]
        holders.remove(block)
        if not holders:
            del self._cached[key]
        self.evictions += 1
        self._publish(BlockRemoved(block_hashes=[key], medium=MEDIUM))

    def _publish(self, event: Event) -> None:
        """Queue ``event`` and fold it into the event view, reading only the event."""
        self.events.append(event)
        view = self._view
        if isinstance(event, BlockStored):
            for key in event.block_hashes:
                view[key] = view.get(key, 0) + 1
        elif isinstance(event, BlockRemoved):
            for key in event.block_hashes:
                left = view.pop(key, 0) - 1
                if left > 0:
                    view[key] = left
        else:
            view.clear()

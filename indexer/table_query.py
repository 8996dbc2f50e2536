"""Answering lookups: each member's longest held prefix (:meth:`_Queries.walk`, one
compiled call, or :meth:`_Queries.match`, the numpy path) and per-position presence for
hybrid models (:meth:`_Queries.presence`).

Part of :class:`~kvindex.indexer.memory_table.BlockTable` (a mixin; read-only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvindex.indexer import compiled
from kvindex.indexer.backend import MemberMatch, Tier
from kvindex.indexer.table_layout import (
    Slots,
    U64s,
    _bit_matrix,
    _nonzero_rows,
    _rows_differ,
)


@dataclass(slots=True)
class ChainMatch:
    """Raw lookup answer. The running "held by" mask is ``values[i]`` up to block
    ``ends[i]`` (ascending), so the members whose prefix is exactly ``ends[i]`` blocks
    are ``values[i] & ~values[i + 1]``. ``off_gpu[m]`` counts the blocks of member
    ``m``'s prefix it holds only off the GPU, ``cpu[m]`` those of them in CPU memory
    (the rest are in storage); both None when the model has only GPU entries."""

    ends: list[int]
    values: list[int]
    off_gpu: list[int] | None = None
    cpu: list[int] | None = None


def bit_positions(value: int) -> list[int]:
    """Positions of the set bits of a non-negative int, lowest first."""
    out = []
    while value:
        low = value & -value
        out.append(low.bit_length() - 1)
        value ^= low
    return out


def _row_int(words: list[int]) -> int:
    """A bitmask row of 64-bit words as one int (bit ``64 * w + b`` = word w, bit b)."""
    return sum(word << (64 * w) for w, word in enumerate(words))


class _Queries:
    """Read-only questions about runs of keys."""

    def match(self, keys: U64s, allowed: np.ndarray | np.uint64 | None) -> ChainMatch | None:
        """Each member's longest run of leading ``keys`` held in any tier.

        The running AND of the per-block "held anywhere" masks drops a member's bit at
        its first hole, so the running mask changes at most once per member: the
        prefix lengths come from those few change rows, decoded as Python ints.
        """
        slots = self.find(keys, exact=False)
        first_absent = int(slots.argmin())  # -1 is the smallest slot value
        if slots[first_absent] < 0:
            if first_absent == 0:
                return None
            slots = slots[:first_absent]
        one_word = self.width == 1
        held = None
        for m in self.masks:
            if m is not None:
                rows = (m.reshape(-1) if one_word else m)[slots]
                held = rows if held is None else held | rows
        assert held is not None
        if allowed is not None:
            held &= allowed
        running = np.bitwise_and.accumulate(held, axis=0)
        if one_word:
            length = int(np.count_nonzero(running))
            if not length:
                return None
            run = running[:length]
            last = np.flatnonzero(run[:-1] != run[1:])
            values = run[last].tolist()
            values.append(int(run[-1]))
        else:
            length = int(np.count_nonzero(_nonzero_rows(running)))
            if not length:
                return None
            run = running[:length]
            last = np.flatnonzero(_rows_differ(run))
            values = [_row_int(row) for row in run[last].tolist()]
            values.append(_row_int(run[-1].tolist()))
        ends = (last + 1).tolist()
        ends.append(length)
        found = ChainMatch(ends, values)
        if self.masks[Tier.CPU] is not None or self.masks[Tier.STORAGE] is not None:
            self._count_tiers(found, slots[:length], run)
        return found

    def walk(
        self, keys: U64s | list[int], allowed: int | None, names: list[str | None]
    ) -> list[MemberMatch]:
        """Each member's longest run of leading ``keys`` held in any tier, as the
        compiled kernel answers it in one call (``indexer/_probe.c`` ``walk``): probing,
        the running mask, the prefix lengths, the tier counts and the answer objects,
        best first (the order :func:`kvindex.indexer.memory_answer.answer` gives).

        ``keys`` is a ``uint64`` array or a list of ints (read in C; anything else in
        the list raises TypeError or OverflowError, and the caller converts it);
        ``allowed`` the member filter as an int of bits (None: every member); ``names``
        member id -> name. Only when :data:`kvindex.indexer.compiled.probe` is set.
        """
        probe = compiled.probe
        assert probe is not None
        gpu, cpu, storage = self.masks
        return probe.walk(  # type: ignore[no-any-return]
            self.keys,
            gpu,
            cpu,
            storage,
            keys,
            int(self.seed),
            int(self.shift),
            self.max_disp,
            self.zero_slot if self.zero_used else -1,
            allowed,
            self.width,
            names,
            MemberMatch,
        )

    def presence(self, keys: U64s, allowed: np.ndarray | np.uint64 | None) -> dict[int, list[int]]:
        """Per member id holding any of ``keys``: one bitmask per tier over the positions
        of ``keys`` (bit ``i`` = holds ``keys[i]`` there). No early stop: every key is
        probed (sliding-window and Mamba hits need blocks past a hole)."""
        slots = self.find(keys, exact=False)
        at = np.flatnonzero(slots >= 0)
        out: dict[int, list[int]] = {}
        if not at.size:
            return out
        slots = slots[at]
        n = keys.size
        for tier, masks in enumerate(self.masks):
            if masks is None:
                continue
            rows = masks[slots]
            if allowed is not None:
                rows = rows & allowed
            bits = _bit_matrix(rows)  # uint8[len(at), 64 * W]: column m = member id m
            for mid in np.flatnonzero(bits.any(axis=0)).tolist():
                mask = np.zeros(n, np.uint8)
                mask[at[bits[:, mid].astype(np.bool_)]] = 1
                packed = np.packbits(mask, bitorder="little").tobytes()
                out.setdefault(mid, [0, 0, 0])[tier] = int.from_bytes(packed, "little")
        return out

    def _count_tiers(self, found: ChainMatch, slots: Slots, run: np.ndarray) -> None:
        """Fill ``found.off_gpu`` and ``found.cpu``.

        Row ``i`` of the running mask holds exactly the members whose prefix covers
        block ``i``, so ``run & ~gpu`` marks, per member, the prefix blocks held only off
        the GPU (and ``& cpu`` those in CPU memory). Those rows come in long runs of
        equal values (offloading moves whole ranges), so each distinct run is unpacked
        once and weighted by its length.
        """
        gpu, cpu, _ = self.masks
        assert gpu is not None
        length = slots.size
        off = run.reshape(length, -1) & ~gpu[slots]
        both = off if cpu is None else np.concatenate((off, off & cpu[slots]), axis=1)
        changes = np.flatnonzero(_rows_differ(both)) + 1
        bounds = np.concatenate(((0,), changes, (length,)))
        runs = bounds[1:] - bounds[:-1]
        counts = (runs @ _bit_matrix(both[bounds[:-1]])).tolist()
        n = 64 * self.width
        found.off_gpu = counts[:n]
        found.cpu = counts[n:] if cpu is not None else [0] * n

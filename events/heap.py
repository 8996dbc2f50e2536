"""Giving back the memory a burst of messages used, once it is applied.

While the applier catches up with a burst, its messages wait in libzmq's queues and the
inbox's lanes (tens of MB for a few seconds of a busy cluster). When they are applied
their buffers are freed, but glibc keeps freed memory in its arenas for reuse, so the
process's resident memory stays at the burst's high-water mark, and a container's
memory limit counts it. When the applier has nothing left to do, :class:`HeapTrim`
asks glibc (``malloc_trim``) to return its free pages if it holds more than
``min_free`` bytes free, at most once per ``interval_s``. Elsewhere than glibc it does
nothing.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):  # not glibc (musl), or glibc < 2.33
        return None
    return libc


_LIBC = _glibc()


def free_bytes() -> int | None:
    """Bytes glibc holds free in its arenas (None: not glibc)."""
    return None if _LIBC is None else int(_LIBC.mallinfo2().fordblks)


class HeapTrim:
    """Call :meth:`idle` whenever the applier has nothing to do."""

    def __init__(
        self, clock: Callable[[], float], min_free: int = 32 << 20, interval_s: float = 1.0
    ) -> None:
        self._clock = clock
        self._min_free = min_free
        self._interval = interval_s
        self._next = 0.0
        self.trims = 0

    def idle(self) -> None:
        if _LIBC is None:
            return
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self._interval
        if _LIBC.mallinfo2().fordblks >= self._min_free:
            _LIBC.malloc_trim(0)
            self.trims += 1

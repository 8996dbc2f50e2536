"""The process's memory, as the subscriber sees it: how much it may use, and giving back
what a burst of messages used once it is applied.

:func:`memory_limit` is what the process may use (its cgroup's limit, else the machine's
memory): the inbox's default budget for waiting messages is a share of it.

While the applier catches up with a burst, its messages wait in libzmq's queues and the
inbox's lanes (tens of MB for a few seconds of a busy cluster). When they are applied
their buffers are freed, but glibc keeps freed memory in its arenas for reuse, so the
process's resident memory stays at the burst's high-water mark, and a container's
memory limit counts it. Once the applier has had nothing to do for a moment,
:class:`HeapTrim` asks glibc (``malloc_trim``) to return its free pages if it holds more
than ``min_free`` bytes free. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

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


def memory_limit() -> int:
    """Bytes this process may use: its cgroup's memory limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``) when one is set, else the machine's physical memory."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limits = [physical]
    for path in _cgroup_limit_files():
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 writes ~2**63 for "no limit"
            limits.append(int(text))
    return min(limits)


def _cgroup_limit_files() -> list[str]:
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            files.append(f"/sys/fs/cgroup{path.rstrip('/')}/memory.max")
        elif "memory" in controllers.split(","):
            files.append(f"/sys/fs/cgroup/memory{path.rstrip('/')}/memory.limit_in_bytes")
            files.append("/sys/fs/cgroup/memory/memory.limit_in_bytes")  # a container's own
    return files


def free_bytes() -> int | None:
    """Bytes glibc holds free in its arenas (None: not glibc)."""
    return None if _LIBC is None else int(_LIBC.mallinfo2().fordblks)


class HeapTrim:
    """Tell it when the applier works (:meth:`busy`) and when it has nothing to do
    (:meth:`idle`): once it has been idle ``quiet_s`` after some work, glibc's free memory
    past ``min_free`` is given back (a pause between two batches of a burst is shorter,
    and refilling the pages would cost more than keeping them)."""

    def __init__(
        self, clock: Callable[[], float], min_free: int = 32 << 20, quiet_s: float = 0.2
    ) -> None:
        self._clock = clock
        self._min_free = min_free
        self._quiet = quiet_s
        self._dirty = False  # work done since the last look
        self._quiet_since: float | None = None
        self.trims = 0

    def busy(self) -> None:
        self._dirty = True
        self._quiet_since = None

    def idle(self) -> float | None:
        """Seconds until it wants :meth:`idle` called again (None: no need)."""
        if not self._dirty or _LIBC is None:
            return None
        now = self._clock()
        if self._quiet_since is None:
            self._quiet_since = now
        left = self._quiet_since + self._quiet - now
        if left > 0:
            return left
        self._dirty = False
        if _LIBC.mallinfo2().fordblks >= self._min_free:
            _LIBC.malloc_trim(0)
            self.trims += 1
        return None

"""numpy arrays in files of a shared-memory directory, so other processes can map them.

Why files and not ``multiprocessing.shared_memory``: a table's arrays are replaced as it
grows, and the old ones must go once nobody reads them. A file in ``/dev/shm`` (tmpfs)
is unlinked as soon as the writer drops its array; a reader that still maps it keeps the
pages until it maps the replacement, and a reader that comes too late gets
FileNotFoundError and asks again (:mod:`kvindex.indexer.memory.shared_index`). ``SharedMemory``
cannot be closed while numpy views of it live, and its resource tracker unlinks
segments behind the writer's back when a reader process exits.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import mmap
import os
import weakref

import numpy as np


class SharedMemoryFull(MemoryError):
    """The shared-memory directory cannot hold another array."""


class SharedArrays:
    """Zero-filled arrays, each in its own file of ``directory``, found by :meth:`name_of`."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._counter = itertools.count()
        self._names: dict[int, str] = {}  # id(array) -> file name, while the array lives

    def zeros(self, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        """A zero-filled array of ``shape`` and ``dtype`` in a new file; the file is
        unlinked when the array (and every view of it) is collected.

        A fresh file reads as zeros. Its pages are reserved when it is made
        (``posix_fallocate``), so a tmpfs too small for the index is an error at that
        moment, not a SIGBUS at some later write; a table's keys and masks are spread by
        hash, so nearly every page of them is written soon anyway.
        """
        count = math.prod(shape)
        nbytes = max(1, count * np.dtype(dtype).itemsize)
        name = f"a{next(self._counter)}"
        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserved now: a full tmpfs then fails here, with a message, instead of
            # killing the process with SIGBUS at the first write past what it holds.
            os.posix_fallocate(fd, 0, nbytes)
            mapped = mmap.mmap(fd, nbytes)
        except OSError as exc:
            os.unlink(path)
            raise SharedMemoryFull(
                f"cannot hold {nbytes:,} bytes of the index in {self.directory} ({exc.strerror}); "
                "give it more room (Kubernetes: an emptyDir with medium Memory at /dev/shm; "
                "Docker: --shm-size) or serve with --processes 1"
            ) from None
        finally:
            os.close(fd)
        array = np.frombuffer(mapped, dtype, count).reshape(shape)
        key = id(array)
        self._names[key] = name
        weakref.finalize(array, self._forget, key, path)
        return array

    def name_of(self, array: np.ndarray) -> str:
        """The file holding ``array`` (one this object allocated; KeyError otherwise)."""
        return self._names[id(array)]

    def _forget(self, key: int, path: str) -> None:
        self._names.pop(key, None)
        with contextlib.suppress(FileNotFoundError):  # the directory went first (close)
            os.unlink(path)


def attach(directory: str, name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """A read-only view of the array another process allocated as ``name``. Raises
    FileNotFoundError when it has been dropped meanwhile, ValueError when the file is
    smaller than ``shape`` says."""
    count = math.prod(shape)
    nbytes = max(1, count * np.dtype(dtype).itemsize)
    fd = os.open(os.path.join(directory, name), os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise ValueError(f"shared array {name} is smaller than {shape}")
        mapped = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mapped, dtype, count).reshape(shape)

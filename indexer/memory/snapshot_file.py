"""The snapshot file: a tree of scalars and numpy arrays, versioned, checksummed, and
replaced atomically.

Why a format of its own rather than ``np.savez`` or pickle: pickle runs code from the
file, and neither says in one clear line whether a file is ours, from another version,
cut short or damaged. The layout and the atomic write are in :func:`write_snapshot`.

The same bytes travel between replicas (a peer's ``GET /index/dump``):
:class:`SnapshotBytes` knows its size before the first byte and yields its chunks
straight from the arrays' buffers, and :func:`read_snapshot_from` reads any stream of
known length the way the file is read.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import msgspec
import numpy as np
import xxhash

MAGIC = b"\x89KVXSNP\n"
VERSION = 1
_HEAD = struct.Struct(">4sxxxxQ")  # version (4 bytes, padded to 8), meta length
_DIGEST = 16
#: Array element types a snapshot may hold (no object arrays: nothing in a file runs).
_DTYPES = frozenset({"<u8", "<i8", "<u4", "<i4", "<u2", "|u1", "|b1", "<f8"})
_ARRAY = "__array__"


class SnapshotError(Exception):
    """A snapshot that cannot be used; ``reason`` is a short label for metrics:
    ``missing``, ``unreadable``, ``foreign``, ``version``, ``truncated``, ``corrupt``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class SnapshotBytes:
    """A tree encoded in the snapshot format: its size in bytes up front, its bytes as
    chunks. The arrays are sent from their own buffers (never copied again); the
    checksum is computed as the chunks go by, so it is the last one."""

    def __init__(self, tree: dict[str, Any]) -> None:
        self._arrays: list[np.ndarray] = []
        meta = msgspec.msgpack.encode(
            {
                "tree": _flatten(tree, self._arrays),
                "arrays": [[a.dtype.str, list(a.shape)] for a in self._arrays],
            }
        )
        self._head = MAGIC + _HEAD.pack(VERSION.to_bytes(4, "big"), len(meta)) + meta
        self.size = len(self._head) + sum(a.nbytes for a in self._arrays) + _DIGEST

    def chunks(self, most: int = 1 << 20) -> Iterator[bytes | memoryview]:
        """The bytes, at most ``most`` per chunk past the header (views of the arrays)."""
        hasher = xxhash.xxh3_128(self._head)
        yield self._head
        for array in self._arrays:
            data = _bytes_of(array)
            for start in range(0, len(data), most):
                piece = data[start : start + most]
                hasher.update(piece)
                yield piece
        yield hasher.digest()


def write_snapshot(path: str | Path, tree: dict[str, Any]) -> int:
    """Write ``tree`` (dicts with str keys, lists, scalars, bytes, numpy arrays) to
    ``path`` atomically; return the file's size in bytes. Raises OSError.

    Layout::

        MAGIC (8 bytes) | format version (u32 BE) | meta length (u64 BE) | meta (msgpack)
        | each array's raw bytes, in order | xxh3-128 of everything before (16 bytes)

    ``meta`` holds the tree with each array replaced by ``{"__array__": i}`` and, per
    array, its dtype and shape. Arrays are written straight from their buffers and read
    straight into fresh ones (no second copy in memory); every size is checked against the
    file's length before anything is allocated, so a damaged header cannot make the reader
    allocate wildly. The checksum is verified before the tree is handed back.

    Writes go to a temporary file in the same directory, which is fsynced, renamed over
    the target and the directory fsynced: a crash at any point leaves either the old
    snapshot or the new one, never a torn file.
    """
    path = Path(path)
    encoded = SnapshotBytes(tree)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in encoded.chunks():
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return encoded.size


def read_snapshot(path: str | Path) -> dict[str, Any]:
    """The tree :func:`write_snapshot` wrote; raises :class:`SnapshotError` saying why
    the file cannot be used (never anything else for a bad file)."""
    path = Path(path)
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below, errors mapped
    except FileNotFoundError:
        raise SnapshotError("missing", f"{path} does not exist") from None
    except OSError as exc:
        raise SnapshotError("unreadable", f"cannot open {path}: {exc.strerror}") from None
    with handle:
        try:
            return read_snapshot_from(handle, os.fstat(handle.fileno()).st_size, str(path))
        except OSError as exc:
            raise SnapshotError("unreadable", f"cannot read {path}: {exc.strerror}") from None


class Readable(Protocol):
    """What the reader needs of a stream: ``read(n)`` and ``readinto(buffer)``, each
    short only at the stream's end."""

    def read(self, n: int, /) -> bytes: ...

    def readinto(self, buffer: memoryview, /) -> int: ...


def read_snapshot_from(handle: Readable | BinaryIO, size: int, path: str) -> dict[str, Any]:
    """The tree in the ``size`` bytes ``handle`` gives (a file, or a peer's dump);
    ``path`` names the source in errors. Raises :class:`SnapshotError`; nothing is
    allocated that the stated size cannot hold."""
    hasher = xxhash.xxh3_128()
    magic = _read_exact(handle, hasher, len(MAGIC), path)
    if magic != MAGIC:
        raise SnapshotError("foreign", f"{path} is not a kvindex snapshot (bad magic bytes)")
    version_bytes, meta_len = _HEAD.unpack(_read_exact(handle, hasher, _HEAD.size, path))
    version = int.from_bytes(version_bytes, "big")
    if version != VERSION:
        raise SnapshotError(
            "version",
            f"{path} is snapshot format v{version}; this kvindex reads v{VERSION} "
            "(written by another kvindex release)",
        )
    left = size - len(MAGIC) - _HEAD.size - _DIGEST
    if meta_len > left:
        raise SnapshotError("truncated", f"{path} is shorter than its header says")
    try:
        meta = msgspec.msgpack.decode(_read_exact(handle, hasher, meta_len, path))
        specs = [(np.dtype(d), tuple(int(n) for n in shape)) for d, shape in meta["arrays"]]
        tree = meta["tree"]
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        raise SnapshotError("corrupt", f"{path}: unreadable snapshot header ({exc})") from None
    left -= meta_len
    arrays = []
    for dtype, shape in specs:
        if dtype.str not in _DTYPES or any(n < 0 for n in shape):
            raise SnapshotError("corrupt", f"{path}: array of {dtype} {shape} not allowed")
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        if nbytes > left:
            raise SnapshotError("truncated", f"{path} is shorter than its arrays")
        array = np.empty(shape, dtype)
        view = _bytes_of(array)
        if handle.readinto(view) != nbytes:
            raise SnapshotError("truncated", f"{path} ends inside an array")
        hasher.update(view)
        arrays.append(array)
        left -= nbytes
    if left != 0:
        raise SnapshotError("corrupt", f"{path} has {left} unexpected byte(s) before its checksum")
    if handle.read(_DIGEST + 1) != hasher.digest():
        raise SnapshotError("corrupt", f"{path}: checksum mismatch (the file is damaged)")
    try:
        return _unflatten(tree, arrays)
    except (IndexError, KeyError, TypeError) as exc:
        raise SnapshotError("corrupt", f"{path}: inconsistent snapshot tree ({exc})") from None


def _bytes_of(array: np.ndarray) -> memoryview:
    """A C-contiguous array's buffer as bytes (flattened first: memoryview cannot cast a
    multi-dimensional view with a zero in its shape)."""
    return memoryview(array.reshape(-1)).cast("B")


def _read_exact(handle: Readable | BinaryIO, hasher: Any, n: int, path: str) -> bytes:
    data = handle.read(n)
    if len(data) != n:
        raise SnapshotError("truncated", f"{path} ends early ({len(data)} of {n} bytes)")
    hasher.update(data)
    return data


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some filesystems cannot open a directory; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _flatten(node: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(node, np.ndarray):
        arrays.append(node if node.flags.c_contiguous else np.ascontiguousarray(node))
        return {_ARRAY: len(arrays) - 1}
    if isinstance(node, dict):
        return {str(k): _flatten(v, arrays) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [_flatten(v, arrays) for v in node]
    if isinstance(node, np.integer):
        return int(node)
    return node


def _unflatten(node: Any, arrays: list[np.ndarray]) -> Any:
    if isinstance(node, dict):
        if len(node) == 1 and _ARRAY in node:
            return arrays[node[_ARRAY]]
        return {k: _unflatten(v, arrays) for k, v in node.items()}
    if isinstance(node, list):
        return [_unflatten(v, arrays) for v in node]
    return node

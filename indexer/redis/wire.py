"""RESP by hand for the lookup's reads: commands packed with numpy, replies read at once.

Why not redis-py's pipeline: a 512-block lookup is one ``MULTI``, one ``HMGET`` per
bucket with hundreds of 8-byte fields, and ``EXEC``. redis-py packs each argument and
parses each reply in Python, several times the client CPU of this way
(``bench/bench_redis.py``, "client CPU").
Here every block field is a fixed 14-byte RESP record (``$8\\r\\n`` + key + ``\\r\\n``)
laid out by numpy in one pass, the whole transaction goes out in one ``sendall`` and
the replies come back through one hiredis reader (redis-py's own reply reader when
hiredis is not installed: the same answers, slower).

The connection is a redis-py pooled :class:`redis.connection.Connection`: it does the
connecting, AUTH, SELECT and TLS; only the bytes of one exchange go around it.
"""

from __future__ import annotations

import socket
import sys
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
from redis._parsers.base import BaseParser
from redis.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvindex.indexer.redis.compiled import kernels
from kvindex.indexer.redis.keys import bucket_numbers

try:
    import hiredis
except ImportError:  # the redis-py reader below gives the same replies, slower
    hiredis = None

#: Bytes read from the socket at a time (a 512-block lookup's replies are ~8 KB).
READ_SIZE = 65536

_FIELD_HEAD = np.frombuffer(b"$8\r\n", np.uint8)
_TIER_HEAD = np.frombuffer(b"$9\r\n", np.uint8)
_CRLF = np.frombuffer(b"\r\n", np.uint8)


def bulk(data: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(data), data)


def command(*args: bytes) -> bytes:
    """One RESP command (for the few small ones of a transaction)."""
    return b"*%d\r\n" % len(args) + b"".join(bulk(a) for a in args)


MULTI, EXEC = command(b"MULTI"), command(b"EXEC")
_LITTLE = sys.byteorder == "little"


def field_records(keys: np.ndarray, tiers: bool) -> tuple[np.ndarray, int]:
    """Each block key as its HMGET fields in RESP, one row per key, and the number of
    fields per row: the 8-byte big-endian key (GPU), and with ``tiers`` also key +
    ``\\1`` (CPU) and key + ``\\2`` (STORAGE)."""
    n = keys.size
    key_bytes = keys.astype(">u8").view(np.uint8).reshape(n, 8)
    width = 14 + (30 if tiers else 0)
    rows = np.empty((n, width), np.uint8)
    rows[:, 0:4] = _FIELD_HEAD
    rows[:, 4:12] = key_bytes
    rows[:, 12:14] = _CRLF
    if tiers:
        for at, tier in ((14, 1), (29, 2)):
            rows[:, at : at + 4] = _TIER_HEAD
            rows[:, at + 4 : at + 12] = key_bytes
            rows[:, at + 12] = tier
            rows[:, at + 13 : at + 15] = _CRLF
    return rows, 3 if tiers else 1


def hmget(key: bytes, fields: int, records: bytes) -> bytes:
    """``HMGET key`` (``key`` already a bulk string) of ``fields`` packed fields."""
    return b"*%d\r\n$5\r\nHMGET\r\n%s%s" % (fields + 2, key, records)


def pack_reads(
    keys: np.ndarray, buckets: int, bucket_prefix: bytes, tiers: bool
) -> tuple[bytes, int, bytes]:
    """One HMGET per bucket ``keys`` (uint64) fall in, the key name ``bucket_prefix`` +
    its number: the commands, how many, and (native int32) the key position of each
    field group in reply order. The compiled ``pack_reads`` writes the same bytes."""
    numbers = bucket_numbers(keys, buckets)
    order = np.argsort(numbers, kind="stable")
    numbers = numbers[order]
    rows, per_key = field_records(keys[order], tiers)
    body = rows.tobytes()
    width = rows.shape[1]
    starts = [0, *(np.flatnonzero(np.diff(numbers)) + 1).tolist()]
    ends = [*starts[1:], keys.size]
    out = [
        hmget(bulk(b"%s%d" % (bucket_prefix, number)), (end - start) * per_key,
              body[start * width : end * width])
        for start, end, number in zip(starts, ends, numbers[starts].tolist(), strict=True)
    ]  # fmt: skip
    return b"".join(out), len(out), order.astype(np.int32).tobytes()


def _error(message: str) -> ResponseError:
    return BaseParser.parse_error(message)


def exchange(
    conn: Connection, payload: bytes, replies: int, buffer: bytearray, *, fast: bool = True
) -> list[Any]:
    """Send ``payload`` (whole commands) and read ``replies`` replies; a reply that is
    an error comes back as its exception, in place. A socket that fails or times out
    is disconnected (the pool makes a new one) and raises redis-py's ConnectionError or
    TimeoutError. ``fast=False`` reads with redis-py's reader even when hiredis is
    installed (the tests run both). ``buffer`` is the caller's, reused between calls."""
    conn.send_packed_command([payload], check_health=False)
    sock = getattr(conn, "_sock", None)  # redis-py's connected socket
    if not fast or hiredis is None or sock is None:
        return _read_with_redis_py(conn, replies)
    reader = hiredis.Reader(protocolError=InvalidResponse, replyError=_error, notEnoughData=_MORE)
    out: list[Any] = []
    try:
        while len(out) < replies:
            reply = reader.gets()
            if reply is _MORE:
                got = sock.recv_into(buffer)
                if not got:
                    raise RedisConnectionError("Redis closed the connection")
                reader.feed(buffer, 0, got)
                continue
            out.append(reply)
    except TimeoutError:  # before OSError: it is one
        conn.disconnect()
        raise RedisTimeoutError("Timeout reading from Redis") from None
    except RedisConnectionError:
        conn.disconnect()
        raise
    except OSError as exc:
        conn.disconnect()
        raise RedisConnectionError(f"Error while reading from Redis: {exc}") from None
    except BaseException:  # whatever else stopped the read left the socket mid-reply
        conn.disconnect()
        raise
    return out


class ReadBuffer:
    """One connection's read buffer, grown when an answer does not fit."""

    __slots__ = ("data",)

    def __init__(self, size: int = READ_SIZE) -> None:
        self.data = bytearray(size)


def read_answer(conn: Connection, payload: bytes, replies: int, buffer: ReadBuffer) -> int:
    """Send ``payload`` and read until ``replies`` whole replies are in ``buffer.data``,
    with the compiled framer; where they end. Nothing is parsed: the caller reads the
    bytes (``parse_lookup``, or :func:`decode_answer`). Socket failures and timeouts as
    :func:`exchange`'s; a reply that is not RESP is InvalidResponse (disconnected).

    On a plain socket the compiled ``exchange`` does the send and the reads, the GIL
    released only while it waits (``indexer/redis/_redis_io.h``); a TLS socket, or one not
    yet connected, goes through redis-py's send and ``recv_into`` here."""
    assert kernels is not None
    sock = getattr(conn, "_sock", None)
    if type(sock) is socket.socket:  # TCP or a unix socket: the compiled round trip
        try:
            return kernels.exchange(sock.fileno(), payload, buffer.data, replies, sock.gettimeout())
        except ValueError as exc:
            conn.disconnect()
            raise InvalidResponse(f"Redis's answer: {exc}") from None
        except TimeoutError:  # before OSError: it is one
            conn.disconnect()
            raise RedisTimeoutError("Timeout reading from Redis") from None
        except OSError as exc:
            conn.disconnect()
            raise RedisConnectionError(f"Error while reading from Redis: {exc}") from None
        except BaseException:
            conn.disconnect()
            raise
    conn.send_packed_command([payload], check_health=False)  # connects; TLS goes here
    sock = getattr(conn, "_sock", None)
    if sock is None:
        raise RedisConnectionError("Redis closed the connection")
    if type(sock) is socket.socket:  # just connected
        return read_answer(conn, b"", replies, buffer)
    data, got = buffer.data, 0
    try:
        while True:
            if got == len(data):  # an answer bigger than the buffer: double it
                data = buffer.data = data + bytearray(len(data))
            read = sock.recv_into(memoryview(data)[got:])
            if not read:
                raise RedisConnectionError("Redis closed the connection")
            got += read
            end = kernels.frame(data, got, replies)
            if end == got:
                return end
            if end >= 0:  # bytes past the answer: this connection is out of step
                raise InvalidResponse("Redis sent more than the replies asked for")
    except ValueError:
        conn.disconnect()
        raise InvalidResponse("Redis's answer is not RESP") from None
    except TimeoutError:  # before OSError: it is one
        conn.disconnect()
        raise RedisTimeoutError("Timeout reading from Redis") from None
    except (RedisConnectionError, InvalidResponse):
        conn.disconnect()
        raise
    except OSError as exc:
        conn.disconnect()
        raise RedisConnectionError(f"Error while reading from Redis: {exc}") from None
    except BaseException:
        conn.disconnect()
        raise


def decode_answer(buffer: ReadBuffer, end: int, replies: int) -> list[Any]:
    """The replies :func:`read_answer` read, as :func:`exchange` returns them."""
    assert kernels is not None
    return kernels.decode(buffer.data, end, replies, _error)


class _More:
    """hiredis's 'not enough data yet' marker (a reply can never be this object)."""


_MORE = _More()


def _read_with_redis_py(conn: Connection, replies: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(replies):
        try:
            out.append(conn.read_response(disable_decoding=True))
        except ResponseError as exc:  # an error reply is a whole reply: still in step
            out.append(exc)
    return out


def key_array(keys: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block keys as a uint64 array; ValueError unless each is in [0, 2**64)."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1:
            raise ValueError(f"block keys must be one-dimensional, got shape {keys.shape}")
        kind = keys.dtype.kind
        if kind == "u" or (kind == "i" and not (keys < 0).any()):
            return keys.astype(np.uint64, copy=False)
        raise ValueError(f"block keys must be unsigned 64-bit integers, got {keys.dtype}")
    try:
        words = array("Q", keys)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"block keys must be integers in [0, 2**64): {exc}") from None
    return np.frombuffer(words, np.uint64) if words else np.empty(0, np.uint64)


def pack_keys(keys: Sequence[int] | np.ndarray) -> bytes:
    """Block keys as 8-byte big-endian words (the bucket fields and reverse records);
    ValueError unless each is in [0, 2**64). Lists (what the decoder makes) go through
    ``array``, not numpy, which costs more for a short list."""
    if isinstance(keys, np.ndarray):
        return key_array(keys).astype(">u8").tobytes()
    try:
        words = array("Q", keys)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"block keys must be integers in [0, 2**64): {exc}") from None
    if _LITTLE:
        words.byteswap()
    return words.tobytes()


def unpack_keys(packed: bytes) -> np.ndarray:
    """8-byte big-endian words back to a uint64 array."""
    return np.frombuffer(packed, ">u8").astype(np.uint64)

"""One Redis connection for the index and the stream leases: plain or Cluster, fast to fail.

Why its own module: both the backend and the leases need the same three things - a
client built from a ``redis://`` URL that may point at a single server or a cluster,
scripts run by SHA with a reload when Redis forgot them (restart, failover), and every
redis-py error turned into the backend's own exceptions. Short socket timeouts and no
client-side retries: when Redis is down, ``/score`` must answer 503 in about a second
so gateways fall back to their default balancing, and ingest retries by replay anyway.

The URL options kvindex reads are listed in :class:`RedisOptions`.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis._parsers import _RESP2Parser
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.connection import Connection, ConnectionPool
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    InvalidResponse,
    MasterDownError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.retry import Retry

from kvindex.indexer.backend import BackendError, BackendUnavailable
from kvindex.indexer.redis.compiled import kernels
from kvindex.indexer.redis.keys import LAYOUT, RedisLayoutError
from kvindex.indexer.redis.scripts import SCRIPTS
from kvindex.indexer.redis.wire import ReadBuffer, decode_answer, exchange, read_answer

#: Replies that mean "ask another node" (a slot moved): the slot map is read again.
_REDIRECTS = (MovedError, AskError, TryAgainError, ClusterDownError)

DEFAULT_BUCKETS = 16
DEFAULT_TIMEOUT_S = 1.0

#: Errors that mean "Redis cannot answer now" rather than "Redis refused this".
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.ConnectionError,  # includes BusyLoadingError (a restarted Redis still loading)
    redis.TimeoutError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    ClusterError,
    TryAgainError,
    ReadOnlyError,  # a failover left us talking to a replica
    RedisClusterException,  # no node reachable, slot not covered
    InvalidResponse,  # not speaking Redis: a wrong port, a proxy
    OSError,
)


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """What a ``redis://`` URL says, kvindex's own options split off.

    URL options kvindex reads (and removes before redis-py sees the URL):

    * ``cluster=yes|no`` - Redis Cluster or a single server; default: ask the server
      (``INFO cluster``) on first contact.
    * ``buckets=N`` - hash buckets per model, fixed by the model's first write (1..65536,
      default 16: fastest lookups); later writers use what the model's ``meta`` key says.
      Above 1,024, buckets stay small enough for Redis's compact listpack encoding: about
      half the memory per entry, a slower lookup (see docs/redis.md, "Memory").
    * ``timeout=S`` - socket connect and read timeout in seconds (default 1).
    """

    url: str
    cluster: bool | None = None  # None: probe the server
    buckets: int = DEFAULT_BUCKETS
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def from_url(cls, url: str) -> RedisOptions:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        own = {k: v for k, v in query if k in ("cluster", "buckets", "timeout")}
        rest = [(k, v) for k, v in query if k not in own]
        cluster: bool | None = None
        if "cluster" in own:
            value = own["cluster"].lower()
            if value not in ("yes", "no", "true", "false", "1", "0"):
                raise ValueError(f"{url}: cluster= must be yes or no, got {own['cluster']!r}")
            cluster = value in ("yes", "true", "1")
        try:
            buckets = int(own.get("buckets", DEFAULT_BUCKETS))
            timeout_s = float(own.get("timeout", DEFAULT_TIMEOUT_S))
        except ValueError:
            raise ValueError(f"{url}: buckets= and timeout= must be numbers") from None
        if not 1 <= buckets <= 65536:
            raise ValueError(f"{url}: buckets= must be in 1..65536, got {buckets}")
        if timeout_s <= 0:
            raise ValueError(f"{url}: timeout= must be > 0")
        clean = urlunsplit(parts._replace(query=urlencode(rest)))
        return cls(clean, cluster, buckets, timeout_s)


def _retry() -> Retry:
    """One immediate retry on a broken connection, none on a timeout. A pooled
    connection to a Redis that restarted fails once and succeeds on a fresh socket; a
    Redis that is down is refused twice in a millisecond; a Redis that does not answer
    costs one timeout, not several, before /score says 503."""
    return Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))


class RedisConnection:
    """A lazily built client, script calls and error translation.

    Thread-safe: redis-py clients are; the lazy construction holds a lock. The client is
    built at first use, so kvindex starts (unready) while Redis is down.
    """

    def __init__(
        self, options: RedisOptions, *, use_hiredis: bool = True, compiled: bool = True
    ) -> None:
        self.options = options
        # use_hiredis=False: redis-py's pure-Python reply parser everywhere, as in a
        # process with neither hiredis nor the compiled kernels.
        self.use_hiredis = use_hiredis and redis.utils.HIREDIS_AVAILABLE
        # Lookups read and walked by the compiled kernels (indexer/redis/_redis_lookup.c) when
        # built; compiled=False: hiredis and numpy, as without them. Tests run all three.
        self.compiled = compiled and use_hiredis and kernels is not None
        self._lock = threading.Lock()
        self._client: redis.Redis | RedisCluster | None = None
        self._local = threading.local()  # per thread: its read connections
        # Every thread's read connection, to close them all; weak, so a thread that ends
        # takes its connection with it (redis-py's Connection disconnects when collected).
        self._thread_connections: weakref.WeakSet[Connection] = weakref.WeakSet()
        self._cluster: bool | None = options.cluster
        self.errors: Counter[str] = Counter()  # by operation, read by the metrics layer

    @property
    def is_cluster(self) -> bool | None:
        """True for Redis Cluster, None until the first successful contact decided."""
        return self._cluster

    # -- clients ---------------------------------------------------------------------------

    def _common(self) -> dict[str, Any]:
        timeout = self.options.timeout_s
        common: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": _retry(),
            "decode_responses": False,
        }
        if not self.use_hiredis:
            common["parser_class"] = _RESP2Parser
        return common

    def client(self) -> redis.Redis | RedisCluster:
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._client is None:
                self._client = self._build()
            return self._client

    def _build(self) -> redis.Redis | RedisCluster:
        url = self.options.url
        if self._cluster is None:
            probe = redis.Redis.from_url(url, **self._common())
            try:
                info = probe.info("cluster")
            finally:
                probe.close()
            self._cluster = bool(info.get("cluster_enabled"))
        if self._cluster:
            common = self._common()
            common.pop("retry")
            return RedisCluster.from_url(url, retry=_retry(), **common)
        return redis.Redis.from_url(url, **self._common())

    # -- commands ----------------------------------------------------------------------------

    @contextmanager
    def guard(self, op: str) -> Iterator[None]:
        """Turn redis-py errors into BackendUnavailable / BackendError, counted by ``op``."""
        try:
            yield
        except _UNAVAILABLE as exc:
            self.errors[op] += 1
            raise BackendUnavailable(f"Redis {self._where()} unreachable: {exc}") from None
        except RedisError as exc:
            self.errors[op] += 1
            if str(exc).startswith("KVLAYOUT"):  # the index scripts' layout check
                found = str(exc).split()[-1]
                raise RedisLayoutError(
                    f"Redis {self._where()} refused {op}: it holds a model of kvindex "
                    f"layout {found}, this kvindex reads and writes layout {LAYOUT} only"
                ) from None
            raise BackendError(f"Redis {self._where()} refused {op}: {exc}") from None

    def _where(self) -> str:
        parts = urlsplit(self.options.url)
        return parts.hostname + (f":{parts.port}" if parts.port else "") if parts.hostname else "?"

    def call(self, op: str, *command: Any) -> Any:
        """One command (or one EVALSHA), reloading scripts on NOSCRIPT."""
        with self.guard(op):
            client = self.client()
            try:
                return client.execute_command(*command)
            except NoScriptError:
                self._load_scripts(client)
                return client.execute_command(*command)

    def pipeline(
        self, op: str, commands: Sequence[tuple[Any, ...]], *, partial: bool = False
    ) -> list[Any]:
        """Commands in one round trip (one per node in a cluster), in order; the first
        error is raised after all ran, or with ``partial`` each failed command's result
        is its exception (translated). Scripts are reloaded and the whole pipeline is run
        again on NOSCRIPT, which is safe because index changes are idempotent in order
        and lease commands are compare-and-set."""
        if not commands:
            return []
        with self.guard(op):
            client = self.client()
            results = self._run(client, commands)
            if any(isinstance(r, NoScriptError) for r in results):
                self._load_scripts(client)
                results = self._run(client, commands)
            if not partial:
                for result in results:
                    if isinstance(result, BaseException):
                        raise result
                return results
        out = []
        for result in results:
            if isinstance(result, BaseException):
                try:
                    with self.guard(op):
                        raise result
                except BackendError as exc:
                    result = exc
            out.append(result)
        return out

    def exchange(
        self,
        op: str,
        route_key: str,
        payload: bytes,
        replies: int,
        parse: Callable[[bytearray, int], Any] | None = None,
    ) -> Any:
        """Commands packed by the caller (:mod:`kvindex.indexer.redis.wire`), sent in one
        write to the node serving ``route_key``'s slot; ``replies`` replies, an error
        reply as its exception in place. One immediate retry on a broken connection (as
        :func:`_retry`), and in a cluster one after a redirect, with the slot map read
        again: for reads only, which are safe to send twice.

        With the compiled kernels, ``parse(buffer, end)`` reads the answer's bytes first;
        what it returns, unless None, is the result (it takes clean answers only, so
        there is no redirect or error in them); otherwise the replies are decoded.

        Each thread uses a connection of its own per node, outside redis-py's pool:
        taking one from the pool and giving it back is a large share of a lookup's
        client CPU (the pool's lock, a readability poll, its metrics)."""
        with self.guard(op):
            for attempt in (0, 1):
                conn, buffer = self._thread_connection(route_key)
                try:
                    if self.compiled:
                        end = read_answer(conn, payload, replies, buffer)
                        parsed = None if parse is None else parse(buffer.data, end)
                        if parsed is not None:
                            return parsed
                        replies_read = decode_answer(buffer, end, replies)
                    else:
                        replies_read = exchange(
                            conn, payload, replies, buffer.data, fast=self.use_hiredis
                        )
                except redis.ConnectionError:
                    if attempt:
                        raise
                    continue
                if not self._cluster or not any(isinstance(r, _REDIRECTS) for r in replies_read):
                    return replies_read
                if attempt:
                    raise ClusterError(f"{op}: {replies_read}")
                self.client().nodes_manager.initialize()  # type: ignore[union-attr]
            raise AssertionError("unreachable")

    def _thread_connection(self, route_key: str) -> tuple[Connection, ReadBuffer]:
        """This thread's connection to the node serving ``route_key``, made like the
        pool's own (address, AUTH, TLS, timeouts), and its read buffer."""
        pool = self._pool_for(route_key)
        mine: dict[int, tuple[ConnectionPool, Connection, ReadBuffer]] | None
        mine = getattr(self._local, "connections", None)
        if mine is None:
            mine = self._local.connections = {}
        held = mine.get(id(pool))
        if held is None or held[0] is not pool:
            conn = pool.connection_class(**pool.connection_kwargs)
            with self._lock:
                self._thread_connections.add(conn)
            held = mine[id(pool)] = (pool, conn, ReadBuffer())
        return held[1], held[2]

    def _pool_for(self, route_key: str) -> ConnectionPool:
        client = self.client()
        if isinstance(client, RedisCluster):
            node = client.get_node_from_key(route_key)
            return client.get_redis_connection(node).connection_pool
        return client.connection_pool

    @staticmethod
    def _run(client: redis.Redis | RedisCluster, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        if len(commands) == 1:
            try:
                return [client.execute_command(*commands[0])]
            except NoScriptError as exc:
                return [exc]
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        try:
            return pipe.execute(raise_on_error=False)
        except NoScriptError as exc:  # cluster pipelines raise instead of returning it
            return [exc]

    @staticmethod
    def _load_scripts(client: redis.Redis | RedisCluster) -> None:
        for script in SCRIPTS.values():
            client.script_load(script.source)

    def ping(self) -> None:
        with self.guard("ping"):
            self.client().ping()

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
            connections = list(self._thread_connections)
            self._thread_connections = weakref.WeakSet()
        for conn in connections:
            conn.disconnect()
        if client is not None:
            with suppress(RedisError):
                client.close()

"""``--peers``: a memory replica that starts without a usable snapshot copies a live
peer's index, then resumes every stream by replay from the copy's positions.

The peer answers ``GET /index/dump`` (admin token) with one consistent cut of its index
in the snapshot file's format (:mod:`kvindex.indexer.memory.snapshot_file`), so the copy is
checked as a snapshot is: another format version, a short or damaged dump, or tables
that do not hold together are refused. The dump's stream positions belong to the tables
it ships, so resuming each stream after its position (the replay checks the payload
digest) loses nothing published between the dump and this start. Neither side holds the
index twice: the peer sends from its arrays' buffers, and here the body is read straight
into the arrays it is installed from. Without a usable copy this replica starts empty,
as after a refused snapshot; what happened is logged, counted and said in ``/readyz``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from kvindex.api.serve.settings_derived import ConfigError
from kvindex.indexer.memory.snapshot import IndexImage, SnapshotGate
from kvindex.indexer.memory.snapshot_file import SnapshotError, read_snapshot_from

log = logging.getLogger(__name__)

DUMP_PATH = "/index/dump"
#: The dump's size in bytes, sent before its body: a relayed answer (``--processes``) is
#: streamed chunk by chunk, without Content-Length, and the reader needs the size first.
DUMP_SIZE_HEADER = "x-kvindex-dump-bytes"
CONNECT_TIMEOUT_S = 3.0
#: Longest wait for the peer's next bytes, its answer's head included (the peer copies
#: its index before answering). A peer list that names this replica itself costs this
#: once: the replica does not answer before it has started.
READ_TIMEOUT_S = 10.0
_CHUNK = 1 << 20


def parse_peers(values: list[str]) -> list[str]:
    """``--peers`` as base URLs (each value may be a comma list); ConfigError for one
    that is not ``http(s)://HOST:PORT``."""
    peers = []
    for value in values:
        for part in value.split(","):
            url = part.strip().rstrip("/")
            if not url:
                continue
            parts = urlsplit(url)
            try:
                port = parts.port
            except ValueError:
                port = None
            if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
                raise ConfigError(
                    f"--peers {part.strip()!r}: give each peer as http://HOST:PORT, the "
                    "address its HTTP API listens on"
                )
            if parts.path or parts.query or parts.fragment or parts.username:
                raise ConfigError(f"--peers {url!r}: only scheme, host and port, no path")
            if url not in peers:
                peers.append(url)
    return peers


class PeerDumpError(Exception):
    """One peer gave no usable dump; ``reason`` labels the metric."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(slots=True)
class PeerRecoveryStats:
    """What recovery from peers did at start, for metrics and /readyz."""

    result: str = "none"  # copied, or the last peer's failure
    peer: str | None = None  # the one copied from
    seconds: float = 0.0
    bytes: int = 0
    streams: int = 0
    tried: list[tuple[str, str, str]] = field(default_factory=list)  # peer, reason, detail


class PeerRecovery:
    """Copies the index from the first of ``peers`` that gives a usable dump."""

    def __init__(self, peers: list[str], token: str, image: IndexImage, gate: SnapshotGate) -> None:
        self.peers = peers
        self._token = token
        self._image = image
        self._gate = gate
        self.stats = PeerRecoveryStats()

    def recover(self) -> bool:
        """Try each peer in order; True when a copy was installed. Never raises for a
        peer's failure: each is logged as a warning, and when all failed this replica is
        set to start empty with every stream's whole history owed."""
        started = time.perf_counter()
        for peer in self.peers:
            try:
                size, tree = self._fetch(peer)
                streams = self._image.install(tree, f"the dump of peer {peer}")
            except (PeerDumpError, SnapshotError) as exc:
                self._failed(peer, exc.reason, str(exc))
                continue
            except Exception as exc:  # a peer's bytes must never stop this replica's start
                log.exception("copying the index from peer %s failed unexpectedly", peer)
                self._failed(peer, "error", repr(exc))
                continue
            seconds = time.perf_counter() - started
            self.stats.result, self.stats.peer, self.stats.seconds = "copied", peer, seconds
            self.stats.bytes, self.stats.streams = size, streams
            log.info(
                "copied the index from peer %s in %.2fs (%d bytes); %d streams resume by "
                "replay from the copy's positions",
                peer,
                seconds,
                size,
                streams,
            )
            return True
        self.stats.seconds = time.perf_counter() - started
        self._gate.restore_failed()
        log.error(
            "peer recovery failed: no peer of --peers gave a usable dump (%s). Starting with "
            "an empty index; every stream is marked incomplete unless its engine can replay "
            "its whole history",
            "; ".join(f"{peer}: {reason}" for peer, reason, _ in self.stats.tried),
        )
        return False

    def _failed(self, peer: str, reason: str, detail: str) -> None:
        self.stats.tried.append((peer, reason, detail))
        self.stats.result = reason
        log.warning("cannot copy the index from peer %s (%s): %s", peer, reason, detail)

    def _fetch(self, peer: str) -> tuple[int, dict]:
        url = peer + DUMP_PATH
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        headers = {"Authorization": f"Bearer {self._token}"}
        try:
            with (
                httpx.Client(timeout=timeout, trust_env=False) as client,
                client.stream("GET", url, headers=headers) as answer,
            ):
                if answer.status_code != 200:
                    raise _refused(answer)
                size = _size_of(answer)
                body = _BodyReader(answer.iter_raw(_CHUNK))
                # Bytes past the stated size fail the checksum comparison (read short).
                return size, read_snapshot_from(body, size, f"the dump of peer {peer}")
        except httpx.ConnectError as exc:
            raise PeerDumpError("unreachable", f"cannot connect to {url}: {exc}") from None
        except httpx.TimeoutException as exc:
            raise PeerDumpError("timeout", f"{url} did not answer in time ({exc!r})") from None
        except httpx.HTTPError as exc:  # the connection broke mid-answer
            raise PeerDumpError("truncated", f"{url}: the answer broke off ({exc})") from None

    # -- what operators see ------------------------------------------------------------

    def note(self) -> str | None:
        """A line for /readyz: where the index came from, or why it started empty."""
        stats = self.stats
        if stats.result == "copied":
            return (
                f"index copied at start from peer {stats.peer} ({stats.streams} streams "
                "resumed by replay from the copy's positions)"
            )
        if stats.result == "none":
            return None
        tried = "; ".join(f"{peer}: {reason} ({detail})" for peer, reason, detail in stats.tried)
        return (
            f"peer recovery failed at start ({tried}): the index started empty and every "
            "stream is rebuilt from its engine's replay; streams whose engine no longer "
            "buffers their whole history are incomplete (GET /index/pods)"
        )


def _refused(answer: httpx.Response) -> PeerDumpError:
    answer.read()  # an error answer is small: its detail says why
    try:
        detail = str(answer.json().get("detail", ""))[:300]
    except (ValueError, AttributeError):
        detail = answer.text[:300]
    status = answer.status_code
    if status in (401, 403):
        return PeerDumpError(
            "unauthorized",
            f"{answer.url} answered {status} ({detail}); every replica needs the same "
            "admin token (KVINDEX_ADMIN_TOKEN or --admin-token-file)",
        )
    return PeerDumpError("refused", f"{answer.url} answered {status} ({detail})")


def _size_of(answer: httpx.Response) -> int:
    text = answer.headers.get(DUMP_SIZE_HEADER, "")
    if not text.isdigit():
        raise PeerDumpError(
            "foreign",
            f"{answer.url} sent no {DUMP_SIZE_HEADER} header: not a kvindex dump "
            "(is --peers the address of a kvindex replica?)",
        )
    return int(text)


class _BodyReader:
    """A response body as the snapshot reader's stream: ``read`` and ``readinto`` fill
    what they are asked for unless the body ends first, holding one chunk at a time."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._pending = memoryview(b"")

    def _more(self) -> bool:
        for chunk in self._chunks:
            if chunk:
                self._pending = memoryview(chunk)
                return True
        return False

    def readinto(self, buffer: memoryview) -> int:
        filled = 0
        while filled < len(buffer):
            if not self._pending and not self._more():
                break
            n = min(len(self._pending), len(buffer) - filled)
            buffer[filled : filled + n] = self._pending[:n]
            self._pending = self._pending[n:]
            filled += n
        return filled

    def read(self, n: int) -> bytes:
        # Gathered as it arrives, never allocated at the stated size up front: a header
        # that claims more than the peer sends costs only what it sent.
        parts = []
        while n > 0 and (self._pending or self._more()):
            piece = self._pending[:n]
            parts.append(bytes(piece))
            self._pending = self._pending[len(piece) :]
            n -= len(piece)
        return b"".join(parts)

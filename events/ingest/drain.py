"""Taking a SUB socket's waiting messages in one compiled call (``events/wire/_wire_scan_zmq.h``).

pyzmq costs several microseconds per 3-frame message (a Frame object and a bytes copy per
part, the GIL); with one event per message that is a third of what ingest may spend on
the message. The compiled drain receives up to a limit of messages straight from libzmq
without the GIL, checks their framing, scans their payloads and hands back consecutive
messages of one sender as one group (:meth:`~kvindex.events.ingest.door.Door.admit_group`).

It binds to the libzmq pyzmq itself uses: the functions are looked up through pyzmq's
loaded backend module (which finds them in that module's own dependencies), and the
library's version must be the one pyzmq reports. When that fails (pyzmq built another
way, no compiled scanner), :func:`drain` is None and the receiver reads with pyzmq;
either way ingest gives the same index (``tests/test_events_scan.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from kvindex.events.wire import scanned

log = logging.getLogger(__name__)

Drain = Callable[[int, int, int, bool, int], list]


def _bind() -> Drain | None:
    compiled = scanned.scanner
    if compiled is None or not hasattr(compiled, "drain"):
        return None
    try:
        from zmq.backend.cython import _zmq as backend
    except ImportError:  # another pyzmq backend (CFFI): nothing to bind to
        return None
    try:
        version = compiled.bind(backend.__file__)
    except OSError as exc:
        log.info("KV events: receiving with pyzmq (libzmq not reachable: %s)", exc)
        return None
    if version != zmq.zmq_version_info():
        log.info(
            "KV events: receiving with pyzmq (libzmq %s found, pyzmq uses %s)",
            version,
            zmq.zmq_version_info(),
        )
        return None
    return compiled.drain


_drain = _bind()


def drain() -> Drain | None:
    """The compiled drain, or None when the receiver reads with pyzmq (no compiled scanner
    now: tests swap :data:`kvindex.events.wire.scanned.scanner`)."""
    return _drain if scanned.scanner is not None else None


def implementation() -> str:
    """``"compiled"`` or ``"pyzmq"``: how the receiver takes messages off its sockets."""
    return "compiled" if drain() is not None else "pyzmq"

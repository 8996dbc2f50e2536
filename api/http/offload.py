"""The index work of ``/score`` and ``/route``, kept off the event loop: a deadline, a cap.

Why: the handlers share one event loop, and with Redis a lookup is a network round trip.
Done on the loop, a Redis that accepts connections but never answers stalls every request
and ``/healthz`` with it, long enough for a liveness probe to kill a healthy replica. So
the part of a request that may wait on something outside the process (the model check,
the tokenizer, hashing, the lookup) runs on a small pool of threads, and the handler
awaits it under a deadline (503 ``backend_timeout``; the thread itself ends at the
connection's socket timeout) and a cap on unfinished work (503 ``backend_busy`` at once).
Threads, not an async Redis client, because they also take the tokenizer and the model
list off the loop without an async copy of the backend. The memory backend runs inline:
nothing in it can hang, and the hop would cost ``/score`` latency (bench/README.md).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from contextlib import suppress
from typing import Any, ParamSpec, TypeVar

from kvindex.events.errors import Unavailable

P = ParamSpec("P")
T = TypeVar("T")

#: Threads doing index work at once: a few keep Redis busy while others pack requests
#: and walk answers.
THREADS = 8

#: A worker's item: the caller's loop and future, the work and its arguments; None stops
#: the worker.
_Item = tuple[asyncio.AbstractEventLoop, asyncio.Future, Callable[..., Any], tuple, dict]


class BackendTimeout(Unavailable):
    """The index backend did not answer within the request's deadline."""

    code = "backend_timeout"


class BackendBusy(Unavailable):
    """Too much index work is waiting on the backend; this request was not queued."""

    code = "backend_busy"


class IndexWork:
    """Runs a request's index work: inline, or on threads under a deadline and a cap.

    A pool of its own rather than a ``ThreadPoolExecutor`` behind ``wrap_future``: each
    item is a tuple on a ``SimpleQueue`` and its result goes straight to the caller's
    loop (``call_soon_threadsafe``), without the executor's futures and chained callbacks
    on a path every Redis ``/score`` takes (bench/README.md, "Off the event loop")."""

    def __init__(
        self,
        *,
        inline: bool,
        deadline_s: float,
        max_in_flight: int,
        threads: int = THREADS,
    ) -> None:
        if deadline_s <= 0 or max_in_flight <= 0:
            raise ValueError("the deadline and the in-flight cap must be positive")
        self.inline = inline
        self.deadline_s = deadline_s
        self.max_in_flight = max_in_flight
        self._threads = max(1, min(threads, max_in_flight))
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._closed = False
        self._lock = threading.Lock()  # finished work is counted down on its own thread
        self.in_flight = 0

    async def run(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``work(*args, **kwargs)``'s result or exception; BackendTimeout (503) past the
        deadline, BackendBusy (503) when ``max_in_flight`` pieces are not finished."""
        if self.inline:
            return work(*args, **kwargs)
        with self._lock:
            if self.in_flight >= self.max_in_flight:
                raise BackendBusy(
                    f"{self.in_flight} index lookups are waiting on the backend "
                    f"(--backend-max-in-flight {self.max_in_flight}); retry shortly"
                )
            self.in_flight += 1
        try:
            if not self._workers:
                self._start()
            loop = asyncio.get_running_loop()
            future: asyncio.Future[T] = loop.create_future()
            self._queue.put((loop, future, work, args, kwargs))
        except BaseException:
            self._finished()
            raise
        try:
            async with asyncio.timeout(self.deadline_s):
                return await future
        except TimeoutError:
            # still queued: it never runs; running: it finishes on its own
            raise BackendTimeout(
                f"the index backend did not answer within {self.deadline_s:g} s "
                "(--backend-deadline)"
            ) from None

    def _finished(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("index work was closed")
            if self._workers:
                return
            for n in range(self._threads):
                # daemon: a thread stuck on a hung backend must not hold the process open
                worker = threading.Thread(target=self._work, name=f"index_{n}", daemon=True)
                worker.start()
                self._workers.append(worker)

    def _work(self) -> None:
        """One worker: run items until told to stop; each result goes to its caller's
        loop, unless the caller stopped waiting (deadline) or the loop is gone."""
        take = self._queue.get
        while (item := take()) is not None:
            loop, future, work, args, kwargs = item
            ok, value = True, None
            try:
                if self._closed or future.cancelled():
                    ok, value = False, None  # the caller gave up before it started
                else:
                    value = work(*args, **kwargs)
            except BaseException as exc:
                ok, value = False, exc
            finally:
                self._finished()
            del item, work, args, kwargs
            with suppress(RuntimeError):  # the loop closed: nobody is waiting
                loop.call_soon_threadsafe(_settle, future, ok, value)
            del future, value

    def close(self) -> None:
        """Stop the threads; work still queued never runs."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        for _ in workers:
            self._queue.put(None)


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    """On the caller's loop: hand over a result (``ok``) or an exception; ``ok`` False
    with no exception means the work never ran (cancelled)."""
    if future.done():  # the deadline passed: nobody is waiting
        return
    if ok:
        future.set_result(value)
    elif value is None:
        future.cancel()
    else:
        future.set_exception(value)

"""The index work of ``/score`` and ``/route``, kept off the event loop: a deadline, a cap.

Why: the handlers are coroutines on one event loop. With the Redis backend a lookup is
a network round trip, and done on the loop it stops everything else: with a Redis that
accepted connections but never answered, 8 concurrent ``/score`` calls finished one
after another over 8.2 s and ``/healthz`` took 8.0 s, long enough for a liveness probe
to kill a healthy replica during a Redis brownout (issue 13).

So the part of a request that can wait on something outside the process (the model
check, which may read the index's model list; the tokenizer; block hashing; the lookup)
runs on a small pool of threads, and the handler awaits it:

* **Deadline.** Past ``deadline_s`` the request gets a fast 503 ``backend_timeout``.
  The thread itself cannot be cancelled: it ends when Redis answers or when the
  connection's socket timeout (the URL's ``timeout=``, 1 s by default) passes.
* **Cap.** Work submitted and not yet finished, abandoned work included, is counted;
  past ``max_in_flight`` a request gets a 503 ``backend_busy`` at once instead of
  queueing behind a Redis that does not answer.

Threads rather than an async Redis client: the same lookup pipelined over
``redis.asyncio`` with a connection pool gave no more lookups per second than the
threads (when Redis ran the lookup as a script on its one thread, the bottleneck), and
only threads also take the tokenizer, the model list and the hybrid presence query off
the loop without a second, async copy of the backend.

The threads are a small pool of its own rather than a ``ThreadPoolExecutor`` awaited
through ``asyncio.wrap_future``: each piece of work is a tuple on a ``SimpleQueue``, and
the worker hands the result straight to the caller's event loop
(``call_soon_threadsafe``), without the executor's futures, conditions and chained
callbacks: 13-16 us of CPU per call of work that does nothing at 16 concurrent callers,
against 19-22 us (``bench/bench_redis_offload.py``, "hop"). A real lookup costs ~55-70
us more through either pool than on the loop (the worker's wake-up and its sleep in
``poll()``, the loop's wake-up, the GIL passed between them); taking that off needs the
round trip done on the loop itself, with /score's index work split around it.

The memory backend runs inline (``inline=True``): nothing in it can hang, so neither a
deadline nor a cap has anything to do, and the hop costs latency that issue 13's
/score target (p50 <= 0.4 ms) cannot spare. ``bench/bench_offload.py`` (512 blocks, 64
pods; two runs at load average 7.5 and 9 on 2 CPUs): one caller p50 238 / 210 µs
inline, 553 / 624 µs through the threads; 16 callers 1,380 / 2,120 calls/s inline,
2,259 / 1,347 through the threads (the compiled probe releases the GIL, so a second
core can help, but the runs disagree). Only the latency cost is consistent.
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
    """Runs a request's index work: inline, or on threads under a deadline and a cap."""

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
        self.timeouts = 0
        self.refused = 0

    async def run(self, work: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``work(*args, **kwargs)``'s result or exception; BackendTimeout (503) past the
        deadline, BackendBusy (503) when ``max_in_flight`` pieces are not finished."""
        if self.inline:
            return work(*args, **kwargs)
        with self._lock:
            if self.in_flight >= self.max_in_flight:
                self.refused += 1
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
            with self._lock:
                self.timeouts += 1
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

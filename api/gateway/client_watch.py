"""Noticing that a gateway request's client has gone, in every phase of the request.

A client that disconnects is how vLLM learns to abort a request: the gateway must close
its pod connection as soon as its own client leaves, whether the pod has not answered
yet (a non-streamed answer comes whole, after the whole generation), is streaming, or
is sending a sized body. The ASGI server says so only through ``receive()`` (once the
request body is read, the next message is ``http.disconnect``), and writing to a
departed client does not fail (uvicorn drops the bytes), so one task per request waits
on ``receive()`` from the moment the body is read until the answer's last byte, and
cancels the task serving the request when the client goes. That task's pod connection
is closed wherever the cancellation finds it (:mod:`.pod_http`), and the route is
released.
"""

from __future__ import annotations

import asyncio

from kvindex.api.http.asgi import Receive


class ClientWatch:
    """Cancels the current task when the client disconnects, until :meth:`stop`.

    Whoever catches the ``CancelledError`` asks :meth:`absorb`: True when the client's
    leaving caused it (the cancellation is then consumed and the task goes on to clean
    up); False when someone else cancelled the task (re-raise it)."""

    __slots__ = ("_serving", "_stopped", "_watcher", "left")

    def __init__(self, receive: Receive) -> None:
        self.left = False
        self._stopped = False
        self._serving = asyncio.current_task()
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the server cannot say: nothing to watch (it ends the request)
            return
        # After the answer's last byte the server reports a disconnect too; by then
        # stop() has run (synchronously after that send), and nothing is cancelled.
        if not self._stopped and self._serving is not None:
            self.left = True
            self._serving.cancel()

    def absorb(self) -> bool:
        """Called with a ``CancelledError`` in hand: whether it was the client leaving."""
        if not self.left:
            return False
        if self._serving is not None and self._serving.cancelling():
            self._serving.uncancel()
        return True

    def stop(self) -> None:
        """Stop watching (the answer ended, or no pod is involved any more)."""
        if not self._stopped:
            self._stopped = True
            self._watcher.cancel()

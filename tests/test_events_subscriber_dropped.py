"""A Subscriber dropped without stop() must not hang the thread that collects it.

The Subscriber is full of reference cycles (callbacks that close over it). When such a
cycle is collected, Python clears its weakrefs before running finalizers, so a private
zmq.Context's ``__del__`` found none of its sockets to close and blocked in ``term()``
for good, in whatever thread the collector happened to run: in CI that was the test
client of an unrelated test, two minutes later. The subscriber now uses the process-wide
context, which is never collected; this runs the old failure in a child process with a
deadline.
"""

from __future__ import annotations

import subprocess
import sys

DROP_WITHOUT_STOP = """
import gc
from kvindex.events.ingest.config import SubscriberConfig
from kvindex.events.ingest.subscriber import Subscriber
from kvindex.events.wire.endpoints import PodEndpoint
from kvindex.events.ingest.testing import RecordingSink

for _ in range(3):
    sub = Subscriber(RecordingSink(), SubscriberConfig())
    sub.bind("tcp://127.0.0.1:0")
    sub.connect(PodEndpoint("tcp://127.0.0.1:1", pod="127.0.0.9:8000", model="m"))
    del sub
    gc.collect()
print("collected")
"""


def test_a_subscriber_dropped_without_stop_is_collected_without_hanging() -> None:
    done = subprocess.run(
        [sys.executable, "-c", DROP_WITHOUT_STOP], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "collected"

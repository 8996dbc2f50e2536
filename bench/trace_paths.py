"""Which kvindex modules one BlockStored and one ``/score`` pass through, per thread, in
a real ``kvindex serve`` (memory backend, bind mode, loopback): the data paths of
docs/design.md, read off the running code rather than written by hand.

A profile hook (``bench/trace_paths_hook/sitecustomize.py``) records the modules each
thread calls into while one batch is applied, then while one ``/score`` is answered;
the service is warmed first so no lazy set-up is counted. The applier's own periodic
work in that second falls in its list too. Prints the lists; asserts nothing.

    python bench/trace_paths.py
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kvindex.api.testing import ServeProcess, free_port, publisher_into
from kvindex.events.wire.vllm import BlockStored

ROOT = Path(__file__).resolve().parents[1]
MODEL, POD, BLOCK = "m", "127.0.0.1:8001", 16


def stored(first: int) -> BlockStored:
    tokens = list(range(first, first + BLOCK))
    return BlockStored(
        block_hashes=[first],
        parent_block_hash=None,
        token_ids=tokens,
        block_size=BLOCK,
        lora_id=None,
    )


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="kvindex-trace-")) / "seen.json"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "bench" / "trace_paths_hook"),
        "KVTRACE_OUT": str(out),
        "KVTRACE_ROOT": str(ROOT),
    }
    zmq = f"tcp://127.0.0.1:{free_port()}"
    flags = ("--zmq-bind", zmq, "--block-size", str(BLOCK))
    with ServeProcess(*flags, env=env) as serve:
        serve.wait_ready()
        publisher = publisher_into(zmq, POD, MODEL)
        body = {"model": MODEL, "token_ids": list(range(2 * BLOCK))}
        for i in range(3):  # warm every lazy path
            publisher.publish([stored(1000 + i * BLOCK)])
            httpx.post(serve.url + "/score", json=body).raise_for_status()
        time.sleep(1.0)

        def trace(action: Callable[[], object]) -> dict[str, list[str]]:
            serve.process.send_signal(signal.SIGUSR1)
            time.sleep(0.3)  # the signal is handled between two bytecodes of the main thread
            action()
            time.sleep(1.0)  # the batch crosses two threads; nothing to wait on from here
            serve.process.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 10
            while not out.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            seen = json.loads(out.read_text())
            out.unlink()
            return seen

        ingest = trace(lambda: publisher.publish([stored(5000)]))
        score = trace(lambda: httpx.post(serve.url + "/score", json=body).raise_for_status())
        publisher.close()
    for name, seen, threads in (
        ("one BlockStored", ingest, ("kvindex-receiver", "kvindex-applier")),
        ("one /score", score, ("MainThread",)),
    ):
        print(f"== {name}")
        for thread in threads:
            modules = list(dict.fromkeys(seen.get(thread, [])))
            print(f"  {thread}: {len(modules)} modules")
            print("    " + " -> ".join(modules))


if __name__ == "__main__":
    sys.exit(main())

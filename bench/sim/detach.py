"""Run a command in its own session, ending when the process that started it dies.

    python bench/sim/detach.py PARENT_PID COMMAND [ARG...]

The simulator starts ``kvindex serve`` through this file (:mod:`bench.sim.service`):

* ``setsid`` puts the service in its own process group, so a Ctrl-C at the terminal
  reaches only the simulator, which then stops the service itself (in order: the pods'
  last events, then the service), and stopping the group takes anything it spawned;
* ``PR_SET_PDEATHSIG`` (Linux) has the kernel send the service SIGTERM when the
  simulator dies, SIGKILL included, which no handler in the simulator could see (the
  kernel watches the *thread* that started it: start it from one that lives as long
  as the service should). The setting survives ``execv``. If the simulator died before
  it was set, the parent is already someone else and the command is not started.

It runs as a script (not ``preexec_fn``): code between ``fork`` and ``exec`` of a
threaded parent (the simulator's pods serve ``/metrics`` from threads) may deadlock.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: detach.py PARENT_PID COMMAND [ARG...]", file=sys.stderr)
        return 2
    parent = int(argv[0])
    os.setsid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            print(f"detach.py: prctl failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
            return 1
    if os.getppid() != parent:
        return 1  # the parent is gone already: nothing would stop what we start
    os.execv(argv[1], argv[1:])
    return 1  # not reached: execv replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

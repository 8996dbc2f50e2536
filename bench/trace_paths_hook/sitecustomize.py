"""Loaded by ``bench/trace_paths.py``'s ``kvindex serve`` (this folder is put on its
PYTHONPATH): records which kvindex modules each thread calls into between SIGUSR1 and
SIGUSR2, then writes them to ``$KVTRACE_OUT`` as JSON. Inactive without KVTRACE_OUT."""

import os

if os.environ.get("KVTRACE_OUT"):
    import json
    import signal
    import sys
    import threading

    _root = os.environ["KVTRACE_ROOT"]
    _recording = False
    _seen: dict[str, list[str]] = {}

    def _note(thread: str, module: str) -> None:
        modules = _seen.setdefault(thread, [])
        if not modules or modules[-1] != module:
            modules.append(module)

    def _profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if not _recording:
            return
        if event == "call":
            filename = frame.f_code.co_filename
            if filename.startswith(_root) and "/.venv" not in filename and __file__ != filename:
                _note(threading.current_thread().name, os.path.relpath(filename, _root))
        elif event == "c_call":
            module = getattr(arg, "__module__", None) or ""
            if module.startswith("kvindex."):
                _note(threading.current_thread().name, module + " (C)")

    def _start(*_: object) -> None:
        global _recording
        _seen.clear()
        _recording = True

    def _stop(*_: object) -> None:
        global _recording
        _recording = False
        with open(os.environ["KVTRACE_OUT"], "w") as out:
            json.dump(_seen, out)

    sys.setprofile(_profile)
    threading.setprofile(_profile)
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)

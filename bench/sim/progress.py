"""A progress bar for long runs: tqdm when installed (the ``bench`` extra), else a plain
counter on stderr every few percent, so a run is never silent for minutes."""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...
    def describe(self, text: str) -> None: ...
    def close(self) -> None: ...


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def describe(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class _Counter:
    """Prints ``desc: done/total`` to stderr at most every 5 % or 10 s."""

    def __init__(self, total: int) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.text = ""
        self._next = self.total / 20
        self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.done >= self._next or now - self._last > 10:
            self._next = self.done + self.total / 20
            self._last = now
            percent = 100 * self.done / self.total
            print(f"{self.text} {self.done}/{self.total} ({percent:.0f}%)", file=sys.stderr)

    def describe(self, text: str) -> None:
        self.text = text

    def close(self) -> None:
        pass


class _Tqdm:
    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def describe(self, text: str) -> None:
        self._bar.set_description_str(text, refresh=False)

    def close(self) -> None:
        self._bar.close()


def progress(total: int, *, enabled: bool = True) -> Progress:
    """A progress bar over ``total`` requests."""
    if not enabled:
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total)
    return _Tqdm(tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True))


SILENT: Progress = _Silent()

"""What ``/route`` reads about the cluster on every request, re-read at most every
``max_age_s``.

Which pods exist (the candidates when a request names none, and the only pods it may
name) and which pods' index entries are in doubt come from the subscriber and the index:
reading every stream per request would cost more than the routing decision itself. A
pod that appeared, or a stream that gapped, since the last read is seen at the next one:
no later than the load figures, and a gap is itself seen only when the next batch
arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class _Recent(Generic[T]):
    """``read()``'s value, read again once it is older than ``max_age_s``."""

    def __init__(self, read: Callable[[], T], max_age_s: float, clock: Callable[[], float]):
        self._read, self._max_age, self._clock = read, max_age_s, clock
        self._value: tuple[float, T] | None = None

    def get(self) -> T:
        now = self._clock()
        cached = self._value
        if cached is not None and now - cached[0] < self._max_age:
            return cached[1]
        value = self._read()
        self._value = (now, value)  # one assignment: a racing reader sees either
        return value

    def last(self, default: T) -> T:
        """The value as last read, however old, without reading again."""
        cached = self._value
        return default if cached is None else cached[1]


class RouteView:
    """Known pods, and per model the pods whose index entries are in doubt, each
    refreshed at most every ``max_age_s``."""

    def __init__(
        self,
        known_pods: Callable[[], list[str]],
        doubts: Callable[[str], Mapping[str, tuple[str, str]]],
        max_age_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pods = _Recent(known_pods, max_age_s, clock)
        self._known: tuple[list[str], frozenset[str]] = ([], frozenset())
        self._doubts_of = doubts
        self._max_age, self._clock = max_age_s, clock
        self._doubts: dict[str, _Recent[Mapping[str, tuple[str, str]]]] = {}

    def pods(self) -> list[str]:
        return self._pods.get()

    def known(self) -> frozenset[str]:
        """:meth:`pods` as a set, built once per read of them: the pods a request may
        name (/route checks every named pod against it)."""
        pods = self._pods.get()
        cached = self._known
        if cached[0] is not pods:
            cached = self._known = (pods, frozenset(pods))  # one assignment, as in _Recent
        return cached[1]

    def last_pods(self) -> list[str]:
        """The known pods as last read (none before the first read): what /route
        chooses among when reading them again would wait on a backend that hangs."""
        return self._pods.last([])

    def doubts(self, model: str, pods: Collection[str]) -> dict[str, tuple[str, str]]:
        """Of ``pods``, those whose entries for ``model`` are in doubt: (doubt, why)."""
        recent = self._doubts.get(model)
        if recent is None:
            if len(self._doubts) >= _MAX_MODELS:  # unknown model names are not hoarded
                self._doubts.clear()
            recent = self._doubts[model] = _Recent(
                lambda: self._doubts_of(model), self._max_age, self._clock
            )
        found = recent.get()
        return {pod: found[pod] for pod in pods if pod in found} if found else {}


_MAX_MODELS = 1024

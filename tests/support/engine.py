"""A publishing vLLM engine for tests that start ``kvindex serve``: connect mode (it
binds, kvindex connects), a replay buffer, and the blocks it holds (what the index must
equal), for the model ``MODEL``."""

from __future__ import annotations

import random

from kvindex.api.testing import free_port
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import AllBlocksCleared, BlockRemoved, BlockStored

MODEL = "acme/chat-7b"


class Engine:
    """A publishing engine and the blocks it holds (what the index must equal)."""

    def __init__(self, host: str, replay_port: int, seed: int, buffer_steps: int = 10_000):
        self.pod = f"{host}:8000"
        self._host, self._replay_port, self._buffer = host, replay_port, buffer_steps
        self._rng = random.Random(seed)
        self.held: set[int] = set()
        self.pub = self._open()

    def _open(self) -> EnginePublisher:
        return EnginePublisher(
            f"tcp://{self._host}:{free_port()}",
            replay_endpoint=f"tcp://{self._host}:{self._replay_port}",
            bind=True,
            buffer_steps=self._buffer,
        )

    @property
    def connect(self) -> str:
        return f"{self.pod}@{MODEL}={self.pub.endpoint}"

    def step(self, stores: int = 8, removes: int = 3) -> int:
        """One batch: new blocks, and evictions of blocks it holds."""
        gone = self._rng.sample(sorted(self.held), min(removes, len(self.held)))
        new = [self._rng.getrandbits(64) for _ in range(stores)]
        self.held.difference_update(gone)
        self.held.update(new)
        events: list = [BlockStored(new, None, [], 16)]
        if gone:
            events.append(BlockRemoved(gone))
        return self.pub.publish(events)

    def clear(self) -> int:
        self.held.clear()
        return self.pub.publish([AllBlocksCleared()])

    def restart(self) -> None:
        """The engine process restarted: seq from 0, empty cache and replay buffer."""
        self.pub.restart()
        self.held.clear()

    @property
    def last_seq(self) -> int:
        return self.pub.next_seq - 1

"""The time model of a simulated pod: how long prefill and decode take.

Deliberately small, so every figure it produces can be checked by hand:

* **prefill** runs one request at a time per pod, first come first served, at
  ``prefill_tokens_per_s`` for the tokens the prefix cache did not supply (vLLM's
  chunked prefill shares forward passes between requests; serialising them is the same
  total work in the same order);
* **decode** costs ``decode_s_per_token`` per output token after the first, whatever the
  batch size (per-token latency of a well-batched GPU is flat until memory runs out);
* a pod runs at most ``batch_limit`` requests at once (vLLM's ``max_num_seqs``); the
  rest wait in a FIFO queue of at most ``max_waiting`` requests, beyond which a request
  is rejected (a gateway's 429).

Time to first token is therefore queueing for a batch slot and for KV blocks, queueing
behind other prefills, and the request's own uncached prefill: it reflects both cache
hits and load.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    prefill_tokens_per_s: float = 10_000.0
    decode_s_per_token: float = 0.02
    batch_limit: int = 256
    max_waiting: int = 256

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_s_per_token < 0:
            raise ValueError("prefill throughput must be > 0 and decode time >= 0")
        if self.batch_limit < 1 or self.max_waiting < 0:
            raise ValueError("batch limit must be >= 1 and the queue bound >= 0")

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def decode_s(self, output_tokens: int) -> float:
        """Time from the first output token to the last."""
        return max(output_tokens - 1, 0) * self.decode_s_per_token

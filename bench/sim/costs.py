"""The engine model of a simulated pod: vLLM v1's per-step limits and what a step costs.

A vLLM engine runs in *steps*: each step the scheduler picks work under two limits,
``max_num_batched_tokens`` (tokens computed in one forward pass, prefill chunks and
decode tokens together) and ``max_num_seqs`` (requests running at once), and the
model runs one forward pass over all of it. Defaults are vLLM 0.33's for an OpenAI API
server on a GPU with >= 70 GiB that is not an A100 (``engine/arg_utils.py``): 8,192
tokens and 1,024 sequences.

Step time is a roofline-style linear model, documented so every figure can be checked
by hand::

    step_s = overhead_s + tokens x token_s + context_tokens x kv_token_s

* ``overhead_s`` (15 ms): reading the weights once per step - Qwen3-32B in bf16 is
  65.6 GB, at the H200's 4.8 TB/s that is 13.7 ms - plus ~1 ms of scheduler and
  launch overhead;
* ``token_s`` (132 us): compute per batched token - 2 x 32.8 G parameters = 65.6 GFLOP,
  at 50% of the H200's 989 dense bf16 TFLOP/s; a full 8,192-token prefill step takes
  ~1.1 s, i.e. ~7,500 prefill tokens/s per pod;
* ``kv_token_s`` (55 ns): reading one token of KV cache - 256 KiB per token for
  Qwen3-32B (64 layers x 8 KV heads x 128 dims x K and V x 2 bytes) at 4.8 TB/s -
  charged once per scheduled request for its whole context, so a decode step grows
  with batch size and context length (64 requests of 3,000 tokens: ~34 ms).

The model is the one llm-d's published precise-routing benchmark served (8 x Qwen3-32B),
which the issue's claims cite. Sources: NVIDIA's H200 data sheet (bandwidth, FLOP/s),
Qwen3-32B's config. The sum of a memory term and a compute term overestimates a step a
little (a real kernel overlaps them); attention's quadratic prefill cost is ignored.
A request that a pod's
waiting queue (``max_waiting``) cannot take is rejected, as a gateway answers 429.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    max_waiting: int = 512
    overhead_s: float = 0.015
    token_s: float = 132e-6
    kv_token_s: float = 55e-9

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1 or self.max_waiting < 0:
            raise ValueError("token budget and sequence limit must be >= 1, queue bound >= 0")
        if min(self.overhead_s, self.token_s, self.kv_token_s) < 0:
            raise ValueError("step time constants must be >= 0")
        if self.overhead_s + self.token_s <= 0:
            raise ValueError("a step must take some time")

    def step_s(self, tokens: int, context_tokens: int) -> float:
        return self.overhead_s + tokens * self.token_s + context_tokens * self.kv_token_s

    def as_dict(self) -> dict[str, float]:
        return {
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_waiting": self.max_waiting,
            "overhead_ms": self.overhead_s * 1e3,
            "token_us": self.token_s * 1e6,
            "kv_token_ns": self.kv_token_s * 1e9,
        }

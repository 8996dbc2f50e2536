"""vLLM engines without a model: real KVCacheManagers publishing through real ZmqEventPublishers.

Runs under the interpreter of the vLLM venv (``KVTEST_VLLM_PYTHON``, made by
``tests/conformance/vllm_env.sh``), never under kvindex's: the conformance tests start
it as a child process and talk to it in JSON lines (one command on stdin, one answer on
stdout). It holds several "pods", each one engine core as vLLM 0.33 builds it:

* a real ``KVCacheManager`` (its real coordinator and ``BlockPool``) with prefix caching
  and KV events on, over a deliberately small block pool so eviction and preemption are
  constant; one full-attention group, or full attention + sliding window (hybrid);
* real ``Request`` objects hashed by ``get_request_block_hasher`` with the function
  ``get_hash_fn_by_name(prefix_caching_hash_algo)`` after ``init_none_hash`` - the three
  calls ``EngineCore.__init__`` makes (v1/engine/core.py);
* a real ``ZmqEventPublisher`` (``vllm.distributed.kv_events``, PUB + replay ROUTER)
  made by ``EventPublisherFactory.create`` from a ``KVEventsConfig``, as the scheduler
  does, publishing ``KVEventBatch(ts, manager.take_events())`` after every step.

:class:`MiniScheduler` replays the calls vLLM 0.33's ``Scheduler`` makes on the manager
(v1/core/sched/scheduler.py), for the default configuration (no spec decode, no KV
connector, no encoder, FCFS): ``schedule()`` calls ``new_step_starts``, then for each
running request ``allocate_slots(request, num_new_tokens)``, preempting the last running
request while that fails (``_preempt_request``: ``free``, status PREEMPTED,
``num_computed_tokens = 0``, back to the front of the queue); then, only if nothing was
preempted, admits waiting requests: ``get_computed_blocks`` when
``num_computed_tokens == 0``, then ``allocate_slots(request, num_tokens - hit, hit,
blocks, has_scheduled_reqs=...)``; then ``_update_after_schedule`` advances
``num_computed_tokens``. "Executing the model" samples one token for every request whose
prompt is fully computed; ``update_from_output`` appends it (which hashes new full
blocks), stops at ``max_tokens`` and ``free``s finished requests, and finally publishes
``take_events()``. Aborts (``finish_requests``) free at once; ``reset_prefix_cache``
preempts every running request first (``reset_running_requests=True``).

NONE_HASH is a process global in vLLM (one engine per process); pods with different
hash settings share this process, so every pod operation first calls ``init_none_hash``
with that pod's function and ``PYTHONHASHSEED`` - what that pod's engine did at start.
That includes making a ``Request``: its constructor hashes the prompt's full blocks at
once (an inactive pod's NONE_HASH there made the first blocks of each workload hash as no
real engine would; kvindex's hash check rightly flagged them).
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

BLOCK = 16
VOCAB = 32_000
MAX_MODEL_LEN = 2048
U64 = 2**64 - 1


def as_u64(block_hash: int | bytes) -> int:
    """A hash as kvindex sees it on the wire (vLLM publishes ints by default)."""
    value = maybe_convert_block_hash(block_hash)
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & U64
    return value & U64


@dataclass
class PodConfig:
    pod: str
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    num_blocks: int = 48
    hybrid: bool = False
    sliding_window: int = 48
    token_budget: int = 96
    max_num_seqs: int = 6
    endpoint: str = ""
    replay_endpoint: str | None = None
    topic: str = ""
    host_ip: str = "127.0.0.1"
    hwm: int = 100_000
    buffer_steps: int = 10_000


class MiniScheduler:
    """vLLM 0.33 Scheduler's calls on its KVCacheManager, without a model (see module doc)."""

    def __init__(self, manager: KVCacheManager, token_budget: int, max_num_seqs: int) -> None:
        self.manager = manager
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def _preempt(self, request: Request) -> None:
        self.manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> dict[str, int]:
        manager = self.manager
        budget = self.token_budget
        scheduled: dict[str, int] = {}
        preempted = False
        manager.new_step_starts()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            new_blocks = None
            while True:
                new_blocks = manager.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled[request.request_id] = num_new
            budget -= num_new
            index += 1
        if not preempted:
            while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                blocks, hit = manager.empty_kv_cache_blocks, 0
                if request.num_computed_tokens == 0:
                    blocks, hit, _ = manager.get_computed_blocks(request)
                num_new = min(request.num_tokens - hit, budget)
                new_blocks = manager.allocate_slots(
                    request,
                    num_new,
                    num_new_computed_tokens=hit,
                    new_computed_blocks=blocks,
                    has_scheduled_reqs=bool(self.running),
                )
                if new_blocks is None:
                    break
                self.waiting.popleft()
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                # _update_after_schedule counts the hit as computed before the chunk.
                request.num_computed_tokens = hit
                scheduled[request.request_id] = num_new
                budget -= num_new
        for request in self.running:
            n = scheduled.get(request.request_id)
            if n:
                request.num_computed_tokens += n
                request.num_in_flight_tokens += n
        return scheduled

    def update_from_output(self, scheduled: dict[str, int], rng: random.Random) -> None:
        for request in list(self.running):
            n = scheduled.get(request.request_id)
            if not n:
                continue
            request.num_in_flight_tokens -= n
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk that did not reach the end samples nothing
            request.append_output_token_ids(rng.randrange(VOCAB))
            if request.num_output_tokens >= request.max_tokens:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self.running.remove(request)
                self.manager.free(request)

    def abort(self, request: Request) -> None:
        """``Scheduler.finish_requests(..., FINISHED_ABORTED)``."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            return
        request.status = RequestStatus.FINISHED_ABORTED
        self.manager.free(request)

    def reset_prefix_cache(self) -> bool:
        """``Scheduler.reset_prefix_cache(reset_running_requests=True)``."""
        while self.running:
            self._preempt(self.running.pop())
        return self.manager.reset_prefix_cache()

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)


@dataclass
class Pod:
    config: PodConfig
    manager: KVCacheManager = field(init=False)
    scheduler: MiniScheduler = field(init=False)
    publisher: Any = field(init=False)
    hasher: Any = field(init=False)
    hash_fn: Any = field(init=False)
    published: int = 0
    incarnation: int = 0
    next_request: int = 0
    duplicates_seen: set[int] = field(default_factory=set)
    history: list[dict[str, Any]] = field(default_factory=list)
    endpoint: str = ""
    replay_endpoint: str | None = None

    def activate(self) -> None:
        """This pod's engine's NONE_HASH (see the module docstring)."""
        if self.config.hash_seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = self.config.hash_seed
        init_none_hash(self.hash_fn)

    def start(self) -> None:
        """Engine start: a fresh manager and publisher (seq from 0)."""
        cfg = self.config
        self.hash_fn = get_hash_fn_by_name(cfg.hash_algo)
        self.activate()
        self.hasher = get_request_block_hasher(BLOCK, self.hash_fn)
        dtype = torch.float32
        groups = [
            KVCacheGroupSpec(
                ["model.layers.0.attn"],
                FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=dtype),
            )
        ]
        if cfg.hybrid:
            groups.append(
                KVCacheGroupSpec(
                    ["model.layers.1.attn"],
                    SlidingWindowSpec(
                        block_size=BLOCK,
                        num_kv_heads=1,
                        head_size=8,
                        dtype=dtype,
                        sliding_window=cfg.sliding_window,
                    ),
                )
            )
        kv_config = KVCacheConfig(
            num_blocks=cfg.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        self.manager = KVCacheManager(
            kv_config,
            max_model_len=MAX_MODEL_LEN,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        self.scheduler = MiniScheduler(self.manager, cfg.token_budget, cfg.max_num_seqs)
        os.environ["VLLM_HOST_IP"] = cfg.host_ip  # what "tcp://*:0" binds (vLLM's get_ip)
        self.publisher = EventPublisherFactory.create(
            KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=cfg.endpoint,
                replay_endpoint=cfg.replay_endpoint,
                buffer_steps=cfg.buffer_steps,
                hwm=cfg.hwm,
                topic=cfg.topic,
            ),
            0,
        )
        resolved = self.publisher.get_publisher_config()
        self.endpoint = resolved.endpoint
        self.replay_endpoint = resolved.replay_endpoint
        self.published = 0
        self.duplicates_seen = set()

    def stop(self) -> None:
        self.publisher.shutdown()

    def restart(self) -> None:
        """Engine restart: the old process's sockets close, a new one starts from nothing.

        ZMQ closes a socket in its I/O thread, after ``close()`` returns; a new process
        would find the replay port free, so wait (bounded) until it is."""
        self.stop()
        if self.replay_endpoint:
            wait_until_bindable(self.replay_endpoint)
        self.incarnation += 1
        self.start()

    # -- requests -----------------------------------------------------------------

    def request(
        self,
        prompt: list[int],
        max_tokens: int,
        lora: str | None = None,
        salt: str | None = None,
        report_mode: str = "incremental",
        mm: list[list[Any]] | None = None,
        session: str | None = None,
    ) -> Request:
        self.next_request += 1
        params = SamplingParams(
            max_tokens=max_tokens, extra_args={"kv_cache_report_mode": report_mode}
        )
        lora_request = None
        if lora is not None:
            lora_request = LoRARequest(lora, LORAS[lora][0], LORAS[lora][1])
        self.activate()  # Request() hashes the prompt now, with the global NONE_HASH
        request = Request(
            f"{self.config.pod}-{self.incarnation}-{self.next_request}",
            list(prompt),
            params,
            None,
            mm_features=mm_features(mm),
            lora_request=lora_request,
            cache_salt=salt,
            block_hasher=self.hasher,
            session_id=session,  # what the API server takes from the client (0.30+)
        )
        self.history.append({"tokens": list(prompt), "lora": lora, "salt": salt, "mm": mm})
        return request

    def step(self, rng: random.Random) -> None:
        """One engine step, then its events published as one batch (if any)."""
        self.activate()
        scheduled = self.scheduler.schedule()
        self.scheduler.update_from_output(scheduled, rng)
        self.flush()

    def flush(self) -> None:
        events = self.manager.take_events()
        self._note_duplicates()
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.published += 1

    def _note_duplicates(self) -> None:
        for key, blocks in self.manager.block_pool.cached_block_hash_to_block._cache.items():
            if isinstance(blocks, dict) and len(blocks) > 1:
                self.duplicates_seen.add(as_u64(get_block_hash(key)))

    def drain(self, rng: random.Random, max_steps: int = 2000) -> int:
        steps = 0
        while self.scheduler.busy and steps < max_steps:
            self.step(rng)
            steps += 1
        if self.scheduler.busy:
            raise RuntimeError(f"{self.config.pod}: requests still running after {steps} steps")
        return steps

    # -- the truth ----------------------------------------------------------------

    def cached_blocks(self) -> dict[int, list[int]]:
        """``cached_block_hash_to_block``'s keys, per KV group, as published uint64s."""
        out: dict[int, set[int]] = {}
        for key in self.manager.block_pool.cached_block_hash_to_block._cache:
            out.setdefault(get_group_id(key), set()).add(as_u64(get_block_hash(key)))
        return {group: sorted(keys) for group, keys in out.items()}

    def hit_blocks(self, probe: dict[str, Any]) -> tuple[int, int]:
        """``get_computed_blocks`` for the probe, in blocks: uncapped (the cached prefix,
        ``max_cache_hit_length=num_tokens``) and as the scheduler calls it (capped at
        ``num_tokens - 1``)."""
        self.activate()
        params = SamplingParams(max_tokens=1)
        lora = probe.get("lora")
        request = Request(
            "probe",
            list(probe["tokens"]),
            params,
            None,
            mm_features=mm_features(probe.get("mm")),
            lora_request=LoRARequest(lora, LORAS[lora][0], LORAS[lora][1]) if lora else None,
            cache_salt=probe.get("salt"),
            block_hasher=self.hasher,
        )
        _, uncapped, _ = self.manager.get_computed_blocks(request, request.num_tokens)
        _, capped, _ = self.manager.get_computed_blocks(request)
        return uncapped // BLOCK, capped // BLOCK


def mm_features(items: list[list[Any]] | None) -> list[MultiModalFeatureSpec] | None:
    """``[identifier, offset, length]`` items as the engine core holds them once the
    processed data is cached (``data=None``): only identifier and position are hashed.
    Each identifier its own string object, as each item's is in vLLM (decoded from its
    own message), so pickle writes it whole in every block."""
    if not items:
        return None
    return [
        MultiModalFeatureSpec(None, "image", "".join(i), PlaceholderRange(o, n))
        for i, o, n in items
    ]


def wait_until_bindable(endpoint: str, timeout_s: float = 10.0) -> None:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, int(port)))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.05)


#: LoRA adapters the workloads use: name -> (lora_int_id, lora_path). vLLM >= 0.31
#: hashes the path too; kvindex's model config lists the same paths.
LORAS = {"sql-adapter": (1, "/adapters/sql"), "chat-adapter": (2, "/adapters/chat")}


# -- workloads ---------------------------------------------------------------------


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def unaligned(rng: random.Random, low: int, high: int) -> int:
    """A length in [low, high] that is not a multiple of the block size: a fully cached
    prompt of such a length never recomputes a cached block into a second copy."""
    while True:
        n = rng.randint(low, high)
        if n % BLOCK:
            return n


def chat(pod: Pod, rng: random.Random, rounds: int = 6, sessions: int = 4, **kw: Any) -> None:
    """Multi-turn chats over a shared system prompt; each turn resends the history."""
    system = tokens(rng, 40)
    histories = [list(system) for _ in range(sessions)]
    for _ in range(rounds):
        live = []
        for s in range(sessions):
            prompt = histories[s] + tokens(rng, 1)
            prompt += tokens(rng, unaligned(rng, len(prompt) + 5, len(prompt) + 40) - len(prompt))
            if len(prompt) > MAX_MODEL_LEN // 2:
                prompt = system + tokens(rng, 23)
            request = pod.request(prompt, rng.randint(3, 10), **kw)
            pod.scheduler.add(request)
            live.append((s, request))
        for _ in range(rng.randint(2, 5)):
            pod.step(rng)
        pod.drain(rng)
        for s, request in live:
            history = list(request.all_token_ids)
            if len(history) % BLOCK == 0:
                history = history[:-1]
            histories[s] = history


def shared(pod: Pod, rng: random.Random, users: int = 10, **kw: Any) -> None:
    """One document, many questions: a long shared prefix, different unaligned tails."""
    document = tokens(rng, 5 * BLOCK + 7)
    for _ in range(users):
        prompt = document + tokens(rng, unaligned(rng, 3, 40))
        while len(prompt) % BLOCK == 0:
            prompt.append(rng.randrange(VOCAB))
        pod.scheduler.add(pod.request(prompt, rng.randint(2, 8), **kw))
        if rng.random() < 0.5:
            pod.step(rng)
    pod.drain(rng)


def regenerate(pod: Pod, rng: random.Random, times: int = 4) -> None:
    """ "Regenerate": the same prompt again, the first answer aborted halfway."""
    prompt = tokens(rng, unaligned(rng, 50, 120))
    for _ in range(times):
        request = pod.request(prompt, 12)
        pod.scheduler.add(request)
        for _ in range(rng.randint(1, 6)):
            pod.step(rng)
        pod.scheduler.abort(request)
        pod.flush()
    pod.drain(rng)


def lora_and_salt(pod: Pod, rng: random.Random) -> None:
    """The same prompts plain, under two LoRA adapters and under cache salts."""
    base = tokens(rng, unaligned(rng, 60, 100))
    variants: list[dict[str, Any]] = [
        {},
        {"lora": "sql-adapter"},
        {"lora": "chat-adapter"},
        {"salt": "tenant-a"},
        {"salt": "tenant-b"},
        {"lora": "sql-adapter", "salt": "tenant-a"},
    ]
    for variant in variants:
        chat(pod, rng, rounds=2, sessions=2, **variant)
        tail = base + tokens(rng, 1 if len(base) % BLOCK == BLOCK - 1 else 0)
        pod.scheduler.add(pod.request(tail, 3, **variant))
        pod.drain(rng)


def report_full(pod: Pod, rng: random.Random) -> None:
    """kv_cache_report_mode="full": every hit re-announces the reused blocks."""
    chat(pod, rng, rounds=3, sessions=3, report_mode="full")
    shared(pod, rng, users=6, report_mode="full")
    chat(pod, rng, rounds=2, sessions=2)


def canned_aligned(pod: Pod, rng: random.Random) -> None:
    """Many users send one canned, block-aligned prompt: a fully cached aligned prompt
    recomputes its last block into a second physical block with the same hash, and
    evicting one copy publishes BlockRemoved while the other stays cached. First the
    issue's minimal case: A computes a 48-token prompt; B sends it again and stays
    running; C evicts A's copy; D continues the chat."""
    canned = tokens(rng, 3 * BLOCK)
    a = pod.request(canned, 1)
    pod.scheduler.add(a)
    pod.drain(rng)
    b = pod.request(canned, 400)
    pod.scheduler.add(b)
    for _ in range(3):
        pod.step(rng)
    filler = (pod.config.num_blocks - 8) * BLOCK
    c = pod.request(tokens(rng, filler + 3), 1)
    pod.scheduler.add(c)
    for _ in range(6):
        pod.step(rng)
    pod.scheduler.abort(b)
    pod.flush()
    pod.drain(rng)
    for _ in range(3):
        for _ in range(rng.randint(2, 4)):
            pod.scheduler.add(pod.request(canned, rng.randint(2, 20)))
        for _ in range(rng.randint(1, 3)):
            pod.step(rng)
        pod.scheduler.add(pod.request(tokens(rng, unaligned(rng, 100, 300)), 2))
        pod.drain(rng)


def canned_one_block(pod: Pod, rng: random.Random) -> None:
    """A canned prompt of exactly one block: the second request cannot hit at all (the
    last token is always recomputed), so it stores a second copy from the chain's root.
    As in the aligned case: A's copy is evicted while B keeps its own running."""
    canned = tokens(rng, BLOCK)
    a = pod.request(canned, 1)
    pod.scheduler.add(a)
    pod.drain(rng)
    b = pod.request(canned, 400)
    pod.scheduler.add(b)
    for _ in range(3):
        pod.step(rng)
    c = pod.request(tokens(rng, (pod.config.num_blocks - 6) * BLOCK + 3), 1)
    pod.scheduler.add(c)
    for _ in range(6):
        pod.step(rng)
    pod.scheduler.abort(b)
    pod.flush()
    pod.drain(rng)
    for _ in range(3):
        for _ in range(rng.randint(2, 3)):
            pod.scheduler.add(pod.request(canned, rng.randint(2, 30)))
        for _ in range(rng.randint(1, 3)):
            pod.step(rng)
        pod.scheduler.add(pod.request(tokens(rng, unaligned(rng, 200, 400)), 2))
        pod.drain(rng)


def preemption(pod: Pod, rng: random.Random) -> None:
    """Long decodes in a pool too small for them: preemption and recompute constantly."""
    for _ in range(3):
        for _ in range(pod.config.max_num_seqs):
            pod.scheduler.add(pod.request(tokens(rng, unaligned(rng, 30, 90)), rng.randint(40, 90)))
        pod.drain(rng)


def reset_prefix_cache(pod: Pod, rng: random.Random) -> None:
    """reset_prefix_cache with requests running: AllBlocksCleared, then new stores."""
    chat(pod, rng, rounds=2, sessions=3)
    for _ in range(3):
        pod.scheduler.add(pod.request(tokens(rng, unaligned(rng, 40, 90)), 30))
    for _ in range(4):
        pod.step(rng)
    pod.activate()
    if not pod.scheduler.reset_prefix_cache():
        raise RuntimeError("reset_prefix_cache refused")
    pod.step(rng)
    pod.drain(rng)
    shared(pod, rng, users=4)


def burst(pod: Pod, rng: random.Random) -> None:
    """Many steps back to back into a publisher whose PUB high-water mark is tiny, so ZMQ
    drops some batches silently; then a slow trickle, so the last batches arrive and the
    subscriber sees the gaps (and replays them from the ROUTER)."""
    for _ in range(3):
        chat(pod, rng, rounds=2, sessions=4)
        shared(pod, rng, users=6)
    for _ in range(6):
        time.sleep(0.15)
        pod.scheduler.add(pod.request(tokens(rng, unaligned(rng, 20, 40)), 1))
        pod.drain(rng)


def restart(pod: Pod, rng: random.Random) -> None:
    """Traffic, an engine restart (new process: empty cache, new sockets, seq from 0),
    traffic again - twice."""
    for _ in range(2):
        chat(pod, rng, rounds=2, sessions=3)
        pod.restart()
        time.sleep(0.3)  # the new PUB connects (ZMQ's slow joiner) before it publishes
        shared(pod, rng, users=5)


IMAGE_TOKEN = VOCAB - 1  # a model's image placeholder token, repeated over the item


def with_images(
    rng: random.Random, parts: list[int | tuple[str, int]], start: int = 0
) -> tuple[list[int], list[list[Any]]]:
    """Tokens and items of a prompt made of ``parts``: n random text tokens, or an image
    (identifier, placeholder length); offsets counted from ``start``."""
    toks: list[int] = []
    items: list[list[Any]] = []
    for part in parts:
        if isinstance(part, int):
            toks += tokens(rng, part)
        else:
            identifier, length = part
            items.append([identifier, start + len(toks), length])
            toks += [IMAGE_TOKEN] * length
    return toks, items


def multimodal(pod: Pod, rng: random.Random) -> None:
    """Prompts with images: chats that resend earlier turns' images in their history,
    the same tokens with another image in the same place, one image twice in a prompt
    (also twice in one block), images on block boundaries and spanning several blocks,
    with and without a LoRA adapter and a salt."""
    sizes = [1, 7, BLOCK, BLOCK + 5, 3 * BLOCK + 2]
    gallery = [(f"{rng.getrandbits(128):032x}", rng.choice(sizes)) for _ in range(6)]
    for variant in ({}, {"lora": "sql-adapter", "salt": "tenant-a"}):
        histories = [([], []) for _ in range(3)]
        for _ in range(3):
            live = []
            for s, (history, items) in enumerate(histories):
                parts: list[int | tuple[str, int]] = [rng.randint(1, 20), rng.choice(gallery)]
                if rng.random() < 0.5:
                    parts += [rng.choice([0, 3]), rng.choice(gallery)]
                parts.append(rng.randint(1, 30))
                new, new_items = with_images(rng, parts, start=len(history))
                prompt, mm = history + new, items + new_items
                if len(prompt) > MAX_MODEL_LEN // 2:
                    prompt, mm = new, [[i, o - len(history), n] for i, o, n in new_items]
                request = pod.request(prompt, rng.randint(2, 6), mm=mm, **variant)
                pod.scheduler.add(request)
                live.append((s, request, mm))
            for _ in range(rng.randint(1, 4)):
                pod.step(rng)
            pod.drain(rng)
            for s, request, mm in live:
                history = list(request.all_token_ids)
                if len(history) % BLOCK == 0:
                    history = history[:-1]
                histories[s] = (history, mm)
        # One prompt's tokens with each of three images in the same place.
        lead, tail = tokens(rng, rng.randint(3, 40)), tokens(rng, 9)
        for identifier, _ in gallery[:3]:
            prompt = lead + [IMAGE_TOKEN] * (2 * BLOCK) + tail
            mm = [[identifier, len(lead), 2 * BLOCK]]
            pod.scheduler.add(pod.request(prompt, 2, mm=mm, **variant))
        pod.drain(rng)
        # One image twice, back to back inside a block and again later.
        twice = (gallery[0][0], 3)
        prompt, mm = with_images(rng, [5, twice, twice, 20, twice, 11])
        pod.scheduler.add(pod.request(prompt, 2, mm=mm, **variant))
        pod.drain(rng)


def image_chat_session(pod: Pod, rng: random.Random) -> None:
    """One image chat's first turn under the client session ``image-chat@<pod>``, as the
    API server hands it to the engine (``Request.session_id``): its stores carry it."""
    image = (f"{rng.getrandbits(128):032x}", BLOCK + 5)
    prompt, mm = with_images(rng, [20, image, 30])
    session = f"image-chat@{pod.config.pod}"
    pod.scheduler.add(pod.request(prompt, 3, mm=mm, session=session))
    pod.drain(rng)


WORKLOADS = {
    "image_chat_session": image_chat_session,
    "multimodal": multimodal,
    "chat": chat,
    "shared": shared,
    "regenerate": regenerate,
    "lora_and_salt": lora_and_salt,
    "report_full": report_full,
    "canned_aligned": canned_aligned,
    "canned_one_block": canned_one_block,
    "preemption": preemption,
    "reset_prefix_cache": reset_prefix_cache,
    "burst": burst,
    "restart": restart,
}


# -- probes ------------------------------------------------------------------------


def probes_for(pod: Pod, rng: random.Random, limit: int) -> list[dict[str, Any]]:
    """Prompts to compare hits on: recent prompts whole, cut short (mid-block and on a
    boundary), extended, and one never sent."""
    recent = pod.history[-limit:]
    out: list[dict[str, Any]] = []
    for item in recent:
        toks = item["tokens"]
        extra = {"lora": item["lora"], "salt": item["salt"], "mm": item.get("mm")}
        out.append({"tokens": toks, **extra})
        cut = rng.randint(1, len(toks))
        out.append({"tokens": toks[:cut], **extra})
        out.append({"tokens": toks + tokens(rng, rng.randint(1, 40)), **extra})
        if len(toks) > BLOCK:
            out.append({"tokens": toks[: (len(toks) // BLOCK) * BLOCK], **extra})
        if item.get("mm"):  # the same tokens without the images: a text prompt
            out.append({"tokens": toks, **extra, "mm": None})
    out.append({"tokens": tokens(rng, 50), "lora": None, "salt": None})
    return [_within(p) for p in out if len(p["tokens"]) >= 2]


def _within(probe: dict[str, Any]) -> dict[str, Any]:
    """A probe with only the images its tokens hold whole (a prompt cut inside an image
    is a prompt without it); a /score with an item past the prompt is a 400."""
    items = [i for i in probe.get("mm") or [] if i[1] + i[2] <= len(probe["tokens"])]
    return {**probe, "mm": items or None}


# -- command loop ------------------------------------------------------------------


class Driver:
    def __init__(self) -> None:
        self.pods: dict[str, Pod] = {}

    def start_pods(self, pods: list[dict[str, Any]]) -> dict[str, Any]:
        out = {}
        for spec in pods:
            pod = Pod(PodConfig(**spec))
            pod.start()
            self.pods[pod.config.pod] = pod
            out[pod.config.pod] = {"endpoint": pod.endpoint, "replay": pod.replay_endpoint}
        return {"pods": out}

    def run(self, workloads: list[dict[str, Any]]) -> dict[str, Any]:
        for item in workloads:
            pod = self.pods[item["pod"]]
            rng = random.Random(f"{item['pod']}/{item['workload']}/{item.get('seed', 0)}")
            WORKLOADS[item["workload"]](pod, rng)
        return self.published()

    def published(self) -> dict[str, Any]:
        return {
            "published": {name: pod.published for name, pod in self.pods.items()},
            "preemptions": {name: pod.scheduler.preemptions for name, pod in self.pods.items()},
        }

    def truth(self, pods: list[str], probes: int, seed: int = 0) -> dict[str, Any]:
        out = {}
        for name in pods:
            pod = self.pods[name]
            rng = random.Random(f"{name}/probes/{seed}")
            answers = []
            for probe in probes_for(pod, rng, probes):
                uncapped, capped = pod.hit_blocks(probe)
                answers.append({**probe, "uncapped": uncapped, "capped": capped})
            out[name] = {
                "blocks": {str(g): keys for g, keys in pod.cached_blocks().items()},
                "probes": answers,
                "duplicates_seen": sorted(pod.duplicates_seen),
                "published": pod.published,
                "preemptions": pod.scheduler.preemptions,
            }
        return {"truth": out}

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command.pop("op")
        if op == "start_pods":
            return self.start_pods(command["pods"])
        if op == "run":
            return self.run(command["workloads"])
        if op == "truth":
            return self.truth(command["pods"], command.get("probes", 12), command.get("seed", 0))
        if op == "stop":
            for pod in self.pods.values():
                pod.stop()
            return {"stopped": True}
        raise ValueError(f"unknown op {op!r}")


def main() -> int:
    driver = Driver()
    print(json.dumps({"ready": True, "vllm": _vllm_version()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = driver.handle(json.loads(line))
        except Exception as exc:  # the test reports it; the driver keeps serving
            answer = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(json.dumps(answer), flush=True)
        if answer.get("stopped"):
            return 0
    for pod in driver.pods.values():
        pod.stop()
    return 0


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    sys.exit(main())

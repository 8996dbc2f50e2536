"""SGLang pods for the conformance suite: SGLang 0.5.23's own event classes and its own
``ZmqEventPublisher``, run under the SGLang venv's interpreter (sglang_env.sh).

SGLang's package ``__init__`` imports torch and its model runtime, so this loads the two
module files the KV-event code needs by path (``sglang/srt/utils/network.py``, then
``sglang/srt/disaggregation/kv_events.py``) under their real names; the one other import,
``runtime_context.get_parallel``, only gates which scheduler rank publishes and is never
called here.

The workload is the radix cache's (``sglang/srt/mem_cache/events.py``, 0.5.23): one
``BlockStored`` per page chain with ``block_size`` = page size, hashes from SGLang's rule
(SHA-256 page chain, first 8 bytes as a signed int64: ``hash_str_to_int64``),
``session_id`` and ``cache_salt`` set per request, host-tier copies as ``CPU_PINNED``,
evictions as ``BlockRemoved``. Usage:

    sglang_driver.py --check VERSION           import check (sglang_env.sh)
    sglang_driver.py --publish ENDPOINT MODEL REPLAY_PORT [POD_A,POD_B]
                                               publish (as these two pod ids), print
                                               the truth
    sglang_driver.py --capture DIR             write the payloads as fixtures
    sglang_driver.py --load BASE DP_SIZE       a pod's load topic: one SGLang
                                               SchedulerLoadPublisher per rank; commands on
                                               stdin (serve_load says which)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import select
import sys
import time
import types
from pathlib import Path
from typing import Any

PAGE = 4
POD_A, POD_B = "127.0.0.41:8000", "127.0.0.42:8000"


def load_sglang() -> types.ModuleType:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not installed"
    root = Path(spec.submodule_search_locations[0])
    packages = (
        "sglang",
        "sglang.srt",
        "sglang.srt.utils",
        "sglang.srt.disaggregation",
        "sglang.srt.managers",
        "sglang.srt.managers.scheduler_components",
    )
    for name in packages:
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = package
    context = types.ModuleType("sglang.srt.runtime_context")

    def get_parallel() -> Any:
        # --load sets the scheduler's parallel layout before building each rank's publisher
        parallel = getattr(context, "parallel", None)
        if parallel is None:
            raise RuntimeError("not a scheduler process")
        return parallel

    context.get_parallel = get_parallel  # type: ignore[attr-defined]
    sys.modules[context.__name__] = context
    for name, rel in (
        ("sglang.srt.utils.network", "srt/utils/network.py"),
        ("sglang.srt.disaggregation.kv_events", "srt/disaggregation/kv_events.py"),
        ("sglang.version", "version.py"),
        (
            "sglang.srt.managers.scheduler_components.load_publisher",
            "srt/managers/scheduler_components/load_publisher.py",
        ),
    ):
        module_spec = importlib.util.spec_from_file_location(name, root / rel)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        module_spec.loader.exec_module(module)
    return sys.modules["sglang.srt.disaggregation.kv_events"]


def page_hashes(tokens: list[int], salt: str | None = None) -> list[int]:
    """SGLang's published ids for a prompt's full pages: a SHA-256 chain over the pages
    (seeded by the salt), each id the digest's first 8 bytes as a signed int64."""
    previous = b"" if salt is None else hashlib.sha256(b"salt\0" + salt.encode()).digest()
    out = []
    for start in range(0, len(tokens) - len(tokens) % PAGE, PAGE):
        page = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + PAGE])
        previous = hashlib.sha256(previous + page).digest()
        out.append(int.from_bytes(previous[:8], "big", signed=True))
    return out


def workload(
    kv: types.ModuleType, pod_a: str = POD_A, pod_b: str = POD_B
) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """Batches per pod (KVEventBatch objects) and the truth: per pod and tier, the token
    prefixes of the blocks it holds; per pod, the sessions it stored for."""
    chat = list(range(1000, 1016))  # 4 pages
    turn2 = chat + list(range(2000, 2008))  # 2 more pages
    salted = list(range(3000, 3008))
    other = list(range(4000, 4012))
    a, b = [], []

    def stored(tokens, first, count, *, salt=None, session=None, medium="GPU"):
        hashes = page_hashes(tokens, salt)
        return kv.BlockStored(
            block_hashes=hashes[first : first + count],
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tokens[first * PAGE : (first + count) * PAGE],
            block_size=PAGE,
            lora_id=None,
            medium=medium,
            cache_salt=salt,
            session_id=session,
        )

    now = time.time()
    a.append(kv.KVEventBatch(ts=now, events=[stored(chat, 0, 4, session="s1")]))
    a.append(kv.KVEventBatch(ts=now, events=[stored(turn2, 4, 2, session="s1")]))
    a.append(
        kv.KVEventBatch(
            ts=now,
            events=[
                kv.BlockRemoved(block_hashes=page_hashes(turn2)[5:], medium="GPU"),
                stored(salted, 0, 2, salt="tenant-a", session="s2"),
                stored(chat, 0, 2, medium="CPU_PINNED"),
            ],
        )
    )
    b.append(kv.KVEventBatch(ts=now, events=[stored(chat, 0, 3, session="s3")]))
    b.append(kv.KVEventBatch(ts=now, events=[kv.AllBlocksCleared()]))
    b.append(kv.KVEventBatch(ts=now, events=[stored(other, 0, 3, session="s4")]))
    truth = {
        pod_a: {
            "gpu": [turn2[: (i + 1) * PAGE] for i in range(5)],
            "cpu": [chat[:PAGE], chat[: 2 * PAGE]],
            "salted_gpu": [salted[:PAGE], salted[: 2 * PAGE]],
        },
        pod_b: {"gpu": [other[: (i + 1) * PAGE] for i in range(3)], "cpu": [], "salted_gpu": []},
        "prompts": {"chat": turn2, "salted": salted, "other": other},
        "chat_ids": page_hashes(turn2),  # what SGLang published for the chat's pages
        "salt": "tenant-a",
    }
    return {pod_a: a, pod_b: b}, truth


def publish(endpoint: str, model: str, replay_port: int, pods: tuple[str, str]) -> None:
    import zmq

    kv = load_sglang()
    batches, truth = workload(kv, *pods)
    publishers = {}
    for pod in batches:
        host = pod.rsplit(":", 1)[0]
        publisher = kv.ZmqEventPublisher(
            attn_dp_rank=0,
            endpoint=endpoint,
            replay_endpoint=f"tcp://{host}:{replay_port}",
            topic=f"kv@{pod}@{model}",
        )
        # A connecting PUB socket drops what it sends before the connection is up (ZMQ's
        # slow joiner): wait for the handshake; kvindex replays anything still missed.
        monitor = publisher._pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        if monitor.poll(10_000):
            monitor.recv_multipart()
        publisher._pub.disable_monitor()
        monitor.close(linger=0)
        publishers[pod] = publisher
    for pod, pod_batches in batches.items():
        for batch in pod_batches:
            publishers[pod].publish(batch)
    published = {pod: len(b) for pod, b in batches.items()}
    print(json.dumps({"published": published, "truth": truth}), flush=True)
    # Replay stays served until the test is done with us (it closes our stdin). "again"
    # publishes one empty batch per pod: a pod whose every batch went out before
    # kvindex's subscription reached the socket (the handshake comes first) is unknown to
    # kvindex until one arrives; its seq then shows the gap, which kvindex replays.
    for line in sys.stdin:
        if line.strip() != "again":
            break
        for publisher in publishers.values():
            publisher.publish(kv.KVEventBatch(ts=time.time(), events=[]))
        print(json.dumps({"again": True}), flush=True)
    for publisher in publishers.values():
        publisher.shutdown()


def capture(directory: Path) -> None:
    """The payload frames SGLang's publisher sends (it encodes each batch with
    ``msgspec.msgpack.Encoder().encode``), one hex line each, pod by pod; then one
    ``LoadStat`` of its load topic, under the topic's name."""
    import msgspec

    kv = load_sglang()
    batches, truth = workload(kv)
    encoder = msgspec.msgpack.Encoder()
    lines = [
        f"{pod} {encoder.encode(batch).hex()}"
        for pod, pod_batches in batches.items()
        for batch in pod_batches
    ]
    version = sys.modules["sglang.version"].__version__
    # The load topic's frames, as SchedulerLoadPublisher sends a LoadStat
    load = sys.modules["sglang.srt.managers.scheduler_components.load_publisher"]
    stat = load.LoadStat(
        num_running_reqs=3,
        num_waiting_reqs=2,
        num_tokens=4096,
        max_total_num_tokens=16384,
        attn_dp_rank=1,
        num_waiting_uncached_tokens=700,
    )
    lines.append(f"{kv.LOAD_TOPIC} {load._encoder.encode(stat).hex()}")
    (directory / f"sglang_{version.replace('.', '_')}_payloads.txt").write_text(
        "\n".join(lines) + "\n"
    )
    (directory / f"sglang_{version.replace('.', '_')}_truth.json").write_text(
        json.dumps(truth, indent=1) + "\n"
    )


#: The pod's KV-event endpoint as --kv-events-config names it; never bound here (the load
#: publisher reads it to place its own range and to check the two do not overlap).
KV_EVENTS_CONFIG = json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": ""})


def serve_load(base: int, dp_size: int) -> None:
    """One SGLang pod's load topic: a ``SchedulerLoadPublisher`` per data-parallel rank,
    built as each rank's scheduler builds it (``--load-publish-endpoint tcp://*:BASE``,
    rank r binding BASE + r), driven as its scheduler loop drives it when idle: a forced
    ``publish_load_stat`` every 50 ms, which SGLang sends when the figures changed and
    otherwise once a second (its heartbeat). Prints the ``kv_events`` block /server_info
    serves, from the resolver ``describe_kv_events_publisher`` calls, then reads commands:

    * ``load RANK RUNNING WAITING TOKENS CAPACITY``: the rank's scheduler state from now on
    * ``garbage RANK``: two payloads that are no LoadStat, on the rank's own socket
    * ``stop``: close every socket (the pod's pushes stop)

    and answers each with one JSON line once it is done."""
    kv = load_sglang()
    publisher_module = sys.modules["sglang.srt.managers.scheduler_components.load_publisher"]
    context = sys.modules["sglang.srt.runtime_context"]
    endpoint = f"tcp://*:{base}"
    publishers = []
    for rank in range(dp_size):
        context.parallel = types.SimpleNamespace(  # pure DP: rank r is dp_rank r
            pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, num_dp_ranks=dp_size,
            attn_dp_size=1, attn_dp_rank=0, dp_rank=rank,
        )  # fmt: skip
        publisher = publisher_module.SchedulerLoadPublisher(
            kv_events_config=KV_EVENTS_CONFIG, load_publish_endpoint=endpoint
        )
        assert publisher.enable, f"rank {rank}'s load socket did not bind"
        publishers.append(publisher)
    resolved, reason = kv.resolve_load_pub_range(
        kv_endpoint="tcp://*:5557",
        replay_endpoint=None,
        dp_size=dp_size,
        load_publish_endpoint=endpoint,
    )
    assert resolved is not None, reason
    descriptor = {
        "publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": 5557, "topic": "",
        "block_size": PAGE, "dp_size": dp_size,
        "load_endpoint_port_base": resolved[1], "load_topic": kv.LOAD_TOPIC,
    }  # fmt: skip
    print(json.dumps({"kv_events": descriptor}), flush=True)
    # The fields publish_load_stat reads from SGLang's LoadSnapshot
    # (sglang/srt/managers/load_snapshot.py), per rank; idle to begin with.
    snapshots = [
        types.SimpleNamespace(
            num_running_reqs=0,
            num_waiting_reqs=0,
            num_used_tokens=0,
            max_total_num_tokens=16384,
            num_waiting_uncached_tokens=0,
            num_total_tokens=0,
            max_running_requests=256,
            total_prefill_uncached_tokens=0,
            total_prefill_busy_us=0,
        )
        for _ in range(dp_size)
    ]
    pending = b""
    while True:
        for publisher, snapshot in zip(publishers, snapshots, strict=True):
            publisher.publish_load_stat(
                lambda snapshot=snapshot: snapshot, force=True, snapshot=snapshot
            )
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], 0.05)
        if not ready:
            continue
        chunk = os.read(sys.stdin.fileno(), 4096)
        if not chunk:
            break
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            command, *args = line.decode().split()
            if command == "load":
                rank, running, waiting, tokens, capacity = map(int, args)
                snapshot = snapshots[rank]
                snapshot.num_running_reqs, snapshot.num_waiting_reqs = running, waiting
                snapshot.num_used_tokens, snapshot.max_total_num_tokens = tokens, capacity
                publishers[rank].publish_load_stat(
                    lambda snapshot=snapshot: snapshot, force=True, snapshot=snapshot
                )
                print(json.dumps({"load": rank}), flush=True)
            elif command == "garbage":
                sock = publishers[int(args[0])]._socket
                seq = (2**62).to_bytes(8, "big")
                # not msgpack; a LoadStat whose num_running_reqs is -1
                for payload in (b"\xc1 not msgpack", b"\x95\xa8LoadStat\xff\x00\x00\x00"):
                    sock.send_multipart((kv.LOAD_TOPIC.encode(), seq, payload))
                print(json.dumps({"garbage": int(args[0])}), flush=True)
            elif command == "stop":
                for publisher in publishers:
                    publisher.close()
                print(json.dumps({"stopped": True}), flush=True)
                return


def main() -> None:
    command = sys.argv[1]
    if command == "--check":
        load_sglang()
        version = sys.modules["sglang.version"].__version__
        assert version == sys.argv[2], version
    elif command == "--publish":
        pod_a, pod_b = sys.argv[5].split(",") if len(sys.argv) > 5 else (POD_A, POD_B)
        publish(sys.argv[2], sys.argv[3], int(sys.argv[4]), (pod_a, pod_b))
    elif command == "--capture":
        capture(Path(sys.argv[2]))
    elif command == "--load":
        serve_load(int(sys.argv[2]), int(sys.argv[3]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()

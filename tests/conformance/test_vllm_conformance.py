"""Conformance: kvindex against vLLM 0.33's own engine-core code, end to end.

``kvindex serve`` runs as a real process; the pods are real vLLM ``KVCacheManager``s
publishing through real ``ZmqEventPublisher``s (``vllm_driver.py``, under the vLLM venv's
interpreter), in both ZMQ topologies: pods that connect to kvindex's bound socket with
topic ``kv@<pod>@<model>``, and pods that bind (``tcp://*:0`` on their own loopback
address, vLLM's own rule) and that kvindex connects to. Every pod serves replay on its
address and the same port. Two hash configurations run side by side as two models:
sha256 with no seed, and sha256_cbor seeded with PYTHONHASHSEED; each also as a model
whose clients send report-mode "full" requests (configured ``kv_cache_report_mode:
full``), and a hybrid (full-attention + sliding-window) model.

Each test is one phase: a workload on its own pods, then the check of
:func:`harness.compare_pod` for each of them - the pod's block set in kvindex equals
vLLM's ``cached_block_hash_to_block`` keys, and every probe's ``/score`` equals
``get_computed_blocks`` (how the cap at ``num_tokens - 1`` is compared: see harness.py).
Every phase must agree exactly; none is marked as an expected failure.

Run: ``bash tests/conformance/vllm_env.sh`` once (makes ``.venv-vllm``), then
``.venv/bin/python -m pytest tests/conformance``. Without a vLLM interpreter the suite
skips, except in CI (``CI=true``), where that is a failure.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port
from tests.conformance.harness import (
    Divergence,
    DriverProcess,
    Kvindex,
    PodSpec,
    compare_pod,
    hash_alarms,
    hash_check_problems,
)
from tests.support.vllm import vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SHA = "conformance/sha256"
CBOR = "conformance/sha256-cbor"
#: The same hashes, for pods whose clients send kv_cache_report_mode="full" requests:
#: the model config says so (docs/correctness.md, "Copies and report modes").
SHA_FULL = "conformance/sha256-full"
CBOR_FULL = "conformance/sha256-cbor-full"
HYBRID = "conformance/hybrid"
CBOR_SEED = "4242"
LORAS = {"sql-adapter": "/adapters/sql", "chat-adapter": "/adapters/chat"}

PODS = [
    PodSpec("127.0.0.11:8000", SHA, "bind"),
    PodSpec("127.0.0.12:8000", CBOR, "bind"),
    PodSpec("127.0.0.13:8000", SHA_FULL, "connect", topic=False),
    PodSpec("127.0.0.14:8000", CBOR_FULL, "connect"),
    PodSpec("127.0.0.15:8000", SHA, "connect", options={"hwm": 1}),
    PodSpec("127.0.0.16:8000", CBOR, "bind", options={"hwm": 1}),
    PodSpec("127.0.0.17:8000", SHA, "bind"),
    PodSpec("127.0.0.18:8000", SHA, "bind", options={"num_blocks": 40}),
    PodSpec("127.0.0.19:8000", CBOR, "connect", options={"num_blocks": 40}),
    PodSpec("127.0.0.20:8000", SHA, "bind", options={"num_blocks": 32, "max_num_seqs": 5}),
    PodSpec(
        "127.0.0.21:8000",
        HYBRID,
        "bind",
        options={"hybrid": True, "num_blocks": 64, "max_num_seqs": 2},
    ),
    PodSpec("127.0.0.22:8000", CBOR, "connect", options={"num_blocks": 40}),
    PodSpec("127.0.0.23:8000", SHA, "bind"),
    PodSpec("127.0.0.24:8000", CBOR, "connect"),
]
BY_ID = {spec.pod: spec for spec in PODS}


def _driver_pod(spec: PodSpec, bind_port: int, replay_port: int) -> dict:
    topic = f"kv@{spec.pod}@{spec.model}" if spec.topic else ""
    config = {
        "pod": spec.pod,
        "hash_algo": "sha256_cbor" if spec.model in (CBOR, CBOR_FULL) else "sha256",
        "hash_seed": CBOR_SEED if spec.model in (CBOR, CBOR_FULL) else None,
        "replay_endpoint": f"tcp://{spec.host}:{replay_port}",
        "topic": topic,
        "host_ip": spec.host,
        **spec.options,
    }
    if spec.topology == "bind":
        config["endpoint"] = f"tcp://127.0.0.1:{bind_port}"
    else:
        config["endpoint"] = "tcp://*:0"  # vLLM binds VLLM_HOST_IP (the pod's address)
    return config


def _model_config(path: Path) -> Path:
    cbor = {"block_size": 16, "hash_algo": "sha256_cbor", "hash_seed": CBOR_SEED}
    sha = {"block_size": 16, "hash_algo": "sha256"}
    full = {"kv_cache_report_mode": "full"}
    models = {
        SHA: {**sha, "loras": LORAS},
        CBOR: {**cbor, "loras": LORAS},
        SHA_FULL: {**sha, "loras": LORAS, **full},
        CBOR_FULL: {**cbor, "loras": LORAS, **full},
        HYBRID: sha,
    }
    path.write_text(json.dumps({"models": models}))
    return path


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    python = vllm_python()
    if python is None:
        reason = (
            "no vLLM interpreter: run `bash tests/conformance/vllm_env.sh` (makes .venv-vllm) "
            "or set KVTEST_VLLM_PYTHON to a Python with vllm 0.33.0"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but {reason}")
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("conformance")
    driver = DriverProcess(python, tmp / "driver.log")
    server = None
    kvindex = None
    try:
        ready = driver.answer(timeout_s=300)  # importing vLLM (torch) is most of it
        assert ready.get("vllm") == "0.33.0", ready
        bind_port, replay_port = free_port(), free_port()
        started = driver.call(
            "start_pods", pods=[_driver_pod(s, bind_port, replay_port) for s in PODS]
        )["pods"]
        flags = [
            "--zmq-bind", f"tcp://127.0.0.1:{bind_port}",
            # Every pod connects from 127.0.0.1 whatever its topic says (one machine).
            "--bind-allow", "127.0.0.0/8",
            "--replay-port", str(replay_port),
            "--model-config", str(_model_config(tmp / "models.json")),
            "--block-size", "16",
            "--log-format", "json",
        ]  # fmt: skip
        for spec in PODS:
            if spec.topology == "connect":
                flags += [
                    "--zmq-connect",
                    f"{spec.pod}@{spec.model}={started[spec.pod]['endpoint']}",
                ]
        server = ServeProcess(*flags, log_path=tmp / "kvindex.log")
        server.wait_ready(60.0)
        kvindex = Kvindex(server.url)
        yield {"driver": driver, "kvindex": kvindex, "server": server, "log_seen": 0}
    finally:
        if kvindex is not None:
            kvindex.close()
        driver.close()
        if server is not None:
            server.stop()


def run_phase(
    suite: dict, workloads: list[tuple[str, str]], check: list[str] | None = None, probes: int = 12
) -> dict:
    """Run ``(pod, workload)`` items, wait until kvindex applied every published batch,
    and check each pod involved (or ``check``): blocks and scores equal vLLM's, kvindex's
    hash check passed, and kvindex logged no hash alarm during the phase. Returns vLLM's
    truth per pod; raises :class:`Divergence` listing every difference."""
    driver: DriverProcess = suite["driver"]
    kvindex: Kvindex = suite["kvindex"]
    published = driver.call(
        "run", timeout_s=240, workloads=[{"pod": p, "workload": w} for p, w in workloads]
    )["published"]
    pods = check or list(dict.fromkeys(p for p, _ in workloads))
    for pod in pods:
        eventually(
            lambda pod=pod: kvindex.caught_up(pod, published[pod]),
            f"{pod} to apply its {published[pod]} batches and be live "
            f"(report: {kvindex.pod_report(pod)})\n{suite['server'].log_tail(2000)}",
            timeout_s=30.0,
        )
    truth = driver.call("truth", pods=pods, probes=probes)["truth"]
    problems = [line for pod in pods for line in compare_pod(kvindex, BY_ID[pod], truth[pod])]
    problems += [line for pod in pods for line in hash_check_problems(kvindex, pod)]
    alarms, suite["log_seen"] = hash_alarms(suite["server"].log_path, suite["log_seen"])
    problems += [f"kvindex logged a hash alarm: {line}" for line in alarms]
    if problems:
        raise Divergence("kvindex differs from vLLM:\n" + "\n".join(problems))
    return truth


def test_multi_turn_chat_and_shared_prompts_both_topologies_both_hashes(suite: dict) -> None:
    run_phase(
        suite,
        [
            ("127.0.0.11:8000", "chat"),
            ("127.0.0.12:8000", "chat"),
            ("127.0.0.13:8000", "chat"),
            ("127.0.0.14:8000", "chat"),
            ("127.0.0.11:8000", "shared"),
            ("127.0.0.12:8000", "shared"),
            ("127.0.0.13:8000", "shared"),
        ],
    )


def test_regenerate(suite: dict) -> None:
    run_phase(suite, [("127.0.0.11:8000", "regenerate"), ("127.0.0.14:8000", "regenerate")])


def test_lora_and_cache_salt(suite: dict) -> None:
    run_phase(suite, [("127.0.0.12:8000", "lora_and_salt"), ("127.0.0.13:8000", "lora_and_salt")])


def test_report_mode_full(suite: dict) -> None:
    run_phase(suite, [("127.0.0.13:8000", "report_full"), ("127.0.0.14:8000", "report_full")])


def test_reset_prefix_cache(suite: dict) -> None:
    run_phase(suite, [("127.0.0.14:8000", "reset_prefix_cache")])


def test_message_drops_are_replayed(suite: dict) -> None:
    pods = ["127.0.0.15:8000", "127.0.0.16:8000"]
    run_phase(suite, [(pod, "burst") for pod in pods])
    gaps = {pod: suite["kvindex"].pod_report(pod)["gaps"] for pod in pods}
    print(f"gaps seen by kvindex: {gaps}")
    assert sum(gaps.values()) > 0, f"no batch was dropped, the phase proved nothing: {gaps}"


def test_engine_restarts(suite: dict) -> None:
    run_phase(suite, [("127.0.0.17:8000", "restart")])
    assert suite["kvindex"].pod_report("127.0.0.17:8000")["restarts"] == 2


def test_preemption(suite: dict) -> None:
    truth = run_phase(suite, [("127.0.0.20:8000", "preemption")])
    assert truth["127.0.0.20:8000"]["preemptions"] > 0


def test_duplicate_copies_of_block_aligned_prompts(suite: dict) -> None:
    truth = run_phase(suite, [("127.0.0.18:8000", "canned_aligned")])
    assert truth["127.0.0.18:8000"]["duplicates_seen"], "vLLM never held two copies"


def test_duplicate_copies_of_one_block_prompts(suite: dict) -> None:
    truth = run_phase(suite, [("127.0.0.19:8000", "canned_one_block")])
    assert truth["127.0.0.19:8000"]["duplicates_seen"], "vLLM never held two copies"


def test_hybrid_full_attention_and_sliding_window(suite: dict) -> None:
    """One full-attention and one sliding-window (48 tokens) group in one block pool."""
    run_phase(suite, [("127.0.0.21:8000", "chat"), ("127.0.0.21:8000", "shared")])


def test_multimodal_prompts(suite: dict) -> None:
    """Prompts with images (``MultiModalFeatureSpec``s on vLLM's ``Request``): /score
    with the same ``mm_features`` equals vLLM's hits, and kvindex's hash check verified
    the events' multimodal extra keys rather than skipping them."""
    pods = ["127.0.0.23:8000", "127.0.0.24:8000"]
    truth = run_phase(suite, [(pod, "multimodal") for pod in pods])
    for pod in pods:
        hits = [p["uncapped"] for p in truth[pod]["probes"] if p["mm"]]
        assert max(hits) > 2, f"no image prompt was a hit, the phase proved little: {hits}"
        check = suite["kvindex"].pod_report(pod)["hash_check"][pod]
        assert check["checked_events"] > 0 and check["skipped_events"] == 0, check


def test_every_other_pod_still_agrees_at_the_end(suite: dict) -> None:
    """After every phase (and more traffic on a fresh pod), each pod outside the known
    failures still agrees with its engine: nothing one pod did leaked into another."""
    clean = [spec.pod for spec in PODS]
    run_phase(suite, [("127.0.0.22:8000", "chat"), ("127.0.0.22:8000", "shared")], check=clean)

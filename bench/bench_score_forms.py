"""/score's prompt forms side by side (issue 13): JSON ``token_ids``, JSON
``block_hashes`` (ints and hex strings) and a binary body of little-endian uint32 token
ids, the same 8,192-token prompt against the same index.

Called by ``bench/bench_score.py`` with its running server and load generator; it first
checks that every form gives the same answer (a faster form that answered differently
would measure nothing), then measures each: one client sequentially (p50 / p99) and
``clients`` concurrent keep-alive clients for ``seconds`` (req/s, p50 / p99), and prints
PASS/FAIL against issue 13's targets where it sets one.
"""

from __future__ import annotations

import json
import struct
import urllib.request
from collections.abc import Callable
from urllib.parse import quote

from kvindex.indexer.keys import BlockHasher, HashConfig

JSON = "application/json"
OCTET = "application/octet-stream"
# issue 13, 2 cores, 8,192 tokens, 64 pods, memory backend: (p50 ms, req/s with 16 clients)
TARGETS = {"token_ids JSON": (0.4, 3_500), "block_hashes JSON": (0.15, 8_000)}


def _post(port: int, path: str, content_type: str, body: bytes) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", body, {"Content-Type": content_type}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def measure_forms(
    port: int,
    model: str,
    prompt: list[int],
    block_size: int,
    requests: int,
    seconds: float,
    clients: int,
    measure: Callable[..., dict[str, float]],
    server_pid: int | None = None,
) -> bool:
    """Print each form's figures and verdicts; True when every target is met. With
    ``server_pid``, also the CPU time per request of the server and of the load
    generator (its own process on the same machine) in the concurrent run."""
    keys = BlockHasher(HashConfig(block_size=block_size)).keys(prompt)
    forms = [
        ("token_ids JSON", "/score", JSON, {"model": model, "token_ids": prompt}),
        ("block_hashes JSON", "/score", JSON, {"model": model, "block_hashes": keys}),
        (
            "block_hashes hex",
            "/score",
            JSON,
            {"model": model, "block_hashes": [f"{k:016x}" for k in keys]},
        ),
        (
            "binary uint32",
            f"/score?model={quote(model, safe='')}",
            OCTET,
            struct.pack(f"<{len(prompt)}I", *prompt),
        ),
    ]
    cases = [
        (name, path, kind, body if isinstance(body, bytes) else json.dumps(body).encode())
        for name, path, kind, body in forms
    ]
    answers = [_post(port, path, kind, body) for _, path, kind, body in cases]
    same = all(answer == answers[0] for answer in answers)
    matched = max((p["matched_blocks"] for p in answers[0]["pods"]), default=0)
    print(
        f"/score prompt forms: {len(prompt)} tokens = {len(keys)} blocks, "
        f"{len(answers[0]['pods'])} pods matched (best {matched} blocks); "
        f"identical answers from every form: {'yes' if same else 'NO'}"
    )
    print(
        f"  {'form':18} {'body B':>7}  1 client p50 / p99 ms   "
        f"{clients} clients req/s, p50 / p99 ms   CPU us/req: server, generator"
    )
    passed = same
    verdicts = []
    for name, path, kind, body in cases:
        measure(port, [body], 1, count=200, path=path, content_type=kind)  # warm up
        one = measure(port, [body], 1, count=requests, path=path, content_type=kind)
        many = measure(
            port, [body], clients, seconds=seconds, path=path, content_type=kind,
            server_pid=server_pid,
        )  # fmt: skip
        cpu = f"{many['server_us']:6.0f}, {many['generator_us']:4.0f}" if server_pid else ""
        print(
            f"  {name:18} {len(body):7}  {one['p50_ms']:6.3f} / {one['p99_ms']:6.3f}"
            f"          {many['rps']:6.0f}, {many['p50_ms']:6.2f} / {many['p99_ms']:6.2f}"
            f"          {cpu}"
        )
        if name in TARGETS:
            p50_target, rps_target = TARGETS[name]
            ok_p50 = one["p50_ms"] <= p50_target
            ok_rps = many["rps"] >= rps_target
            passed = passed and ok_p50 and ok_rps
            verdicts.append(
                f"    {name}: p50 {one['p50_ms']:.3f} ms (target <= {p50_target} ms) "
                f"{'PASS' if ok_p50 else 'FAIL'}; {many['rps']:.0f} req/s with {clients} "
                f"clients (target >= {rps_target:,}) {'PASS' if ok_rps else 'FAIL'}"
            )
    print("  issue 13 targets:")
    for line in verdicts:
        print(line)
    return passed

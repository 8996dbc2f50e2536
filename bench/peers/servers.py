"""The two peers as processes: start, wait ready, query, read RSS and CPU, stop.

Both answer "which pods hold how many leading tokens of this prompt"; ``matches`` turns
either answer into ``{publisher index: matched tokens}`` (pods with none left out), so
answers can be compared key for key.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import xxhash

from kvindex.api.testing import ServeProcess, free_port
from kvindex.indexer.keys import BlockHasher, HashConfig

from .feed import BLOCK, MODEL, pod_name

DYNAMO_MODEL = "default"  # dynamo.indexer --model-name's default


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (for RSS and CPU of a server that forks workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid``'s process tree, each shared page counted once: the sum
    of the processes' proportional set sizes (kvindex serve --processes maps one index
    into every process; summing RSS would count it once per process)."""
    total = 0
    for p in tree_pids(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def cpu_seconds(pid: int) -> float:
    total = 0
    for p in tree_pids(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:
            pass
    return total / os.sysconf("SC_CLK_TCK")


class Peer:
    name = ""
    path = ""
    hash_path = ""
    process: subprocess.Popen
    port: int

    def body(self, tokens: list[int]) -> bytes:
        raise NotImplementedError

    def matches(self, answer: dict) -> dict[int, int]:
        raise NotImplementedError

    def hash_body(self, tokens: list[int]) -> bytes:
        raise NotImplementedError

    def query(self, client: httpx.Client, tokens: list[int], by_hash: bool = False):
        response = client.post(
            f"http://127.0.0.1:{self.port}{self.hash_path if by_hash else self.path}",
            content=self.hash_body(tokens) if by_hash else self.body(tokens),
            headers={"content-type": "application/json"},
            timeout=10,
        )
        response.raise_for_status()
        return self.matches(response.json())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


class KvindexPeer(Peer):
    """``kvindex serve`` connected to every publisher (pod and model from the topic)."""

    name = "kvindex"
    path = hash_path = "/score"

    def __init__(self, endpoints: list[str], extra: list[str]) -> None:
        flags = ["--log-level", "warning", *extra]
        for endpoint in endpoints:
            flags += ["--zmq-connect", endpoint]
        self.serve = ServeProcess(*flags)
        self.process, self.port = self.serve.process, self.serve.port

    def wait_ready(self, timeout_s: float) -> None:
        self.serve.wait_ready(timeout_s)

    def body(self, tokens: list[int]) -> bytes:
        return json.dumps({"model": MODEL, "token_ids": tokens}).encode()

    def hash_body(self, tokens: list[int]) -> bytes:
        """The engine's (vLLM sha256) hashes of the prompt's full blocks."""
        keys = BlockHasher(HashConfig(block_size=BLOCK)).keys(tokens)
        return json.dumps({"model": MODEL, "block_hashes": keys}).encode()

    def matches(self, answer: dict) -> dict[int, int]:
        index = {pod_name(i): i for i in range(4096)}
        return {index[p["pod"]]: p["matched_tokens"] for p in answer["pods"] if p["matched_tokens"]}


class DynamoPeer(Peer):
    """``python -m dynamo.indexer``: instance i + 1 subscribes to publisher i."""

    name = "Dynamo"
    path = "/query"
    hash_path = "/query_by_hash"

    def __init__(self, python: str, endpoints: list[str], threads: int | None) -> None:
        self.port = free_port()
        workers = ",".join(f"{i + 1}={e}" for i, e in enumerate(endpoints))
        argv = [python, "-m", "dynamo.indexer", "--block-size", "16", "--port", str(self.port)]
        if threads:
            argv += ["--threads", str(threads)]
        argv += ["--workers", workers]
        handle, name = tempfile.mkstemp(prefix="dynamo-indexer-", suffix=".log")
        os.close(handle)
        self.log_path = Path(name)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                sys.exit(f"dynamo.indexer exited:\n{self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/workers", timeout=2).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        sys.exit(f"dynamo.indexer not ready after {timeout_s:.0f} s")

    def body(self, tokens: list[int]) -> bytes:
        return json.dumps({"model_name": DYNAMO_MODEL, "token_ids": tokens}).encode()

    def hash_body(self, tokens: list[int]) -> bytes:
        """Dynamo's own per-block hashes: XXH3-64, seed 1337, of the block's token ids as
        little-endian u32 (checked against its /dump's tokens_hash), sent as i64."""
        data = np.asarray(tokens[: len(tokens) // BLOCK * BLOCK], dtype="<u4").tobytes()
        step = 4 * BLOCK
        hashes = []
        for i in range(0, len(data), step):
            h = xxhash.xxh3_64_intdigest(data[i : i + step], seed=1337)
            hashes.append(h - (1 << 64) if h >= 1 << 63 else h)
        return json.dumps({"model_name": DYNAMO_MODEL, "block_hashes": hashes}).encode()

    def matches(self, answer: dict) -> dict[int, int]:
        out = {}
        for instance, detail in answer.get("instances", {}).items():
            if detail["longest_matched"]:
                out[int(instance) - 1] = detail["longest_matched"]
        return out

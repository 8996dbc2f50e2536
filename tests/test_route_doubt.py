"""Issue 27, item 1: doubt is per pod. A pod whose index entries are in doubt (its events
late, its stream incomplete, its hashes wrong) costs that pod alone its prefix credit,
by :mod:`kvindex.scoring.route.doubt`'s rule; the other pods' prefixes still decide.

End to end: a real ``kvindex serve``, three pods publishing KV events over real ZMQ on
loopback (bind mode) and serving vLLM 0.33 ``/metrics`` pages over real HTTP. Pod c is
doubted; a four-turn conversation (each prompt extends the last; the pod each turn is
routed to publishes its blocks, as its engine would) stays on the healthy pod it
started on. Before, one doubted candidate made every decision load-only
(``fallback_stale_index``) and the conversation alternated between a and b.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port, publisher_into
from kvindex.events.ingest.status import StreamStatus
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.memory.backend import MemoryBackend
from kvindex.indexer.pods import HASH_MISMATCH, PodDirectory
from kvindex.scoring.route.doubt import LAGGING, NO_CREDIT, credits_prefix, discredit
from tests.test_load import MetricsServer
from tests.test_route import HASHER, MODEL, Cluster, page

BS = 16
BASE = list(range(20_000, 20_200))  # turn 1: 12 full blocks and 8 tokens
# Each turn's prompt extends the last by 40 tokens (the answer and the next question).
TURNS = [BASE + list(range(30_000, 30_000 + 40 * n)) for n in range(4)]
OWN = list(range(50_000, 50_000 + BS * 8 + 4))  # the doubted pod's own prompt: 8 blocks
LAG_S = 60.0  # how late the lagging pod's batches are (--max-event-lag 5)


def full_blocks(tokens: list[int]) -> list[int]:
    return HASHER.keys(tokens[: len(tokens) // BS * BS])


@pytest.fixture
def doubted_cluster(request: pytest.FixtureRequest) -> Iterator[tuple[Cluster, str]]:
    """Pods a, b and c, c doubted as ``request.param`` says; c's page is a touch busier
    (KV usage 0.05), so a conversation's first turn, which nobody holds, goes to a or b."""
    doubt: str = request.param
    metrics = [MetricsServer(page()) for _ in range(2)] + [MetricsServer(page(kv=0.05))]
    bind = free_port()
    server = ServeProcess(
        "--zmq-bind", f"tcp://127.0.0.1:{bind}",
        "--model", MODEL,
        "--load-interval", "0.5",
        "--load-timeout", "2",
        "--route-ttl", "60",
        "--max-event-lag", "5",
        # Follow-up turns find their pod by its published events alone.
        "--speculative-ttl", "0",
        env={**os.environ},
    )  # fmt: skip
    pubs: list[EnginePublisher] = []
    try:
        server.wait_ready(20.0)
        for m in metrics:
            pubs.append(publisher_into(f"tcp://127.0.0.1:{bind}", m.pod, MODEL))
        cluster = Cluster(server, metrics, pubs)
        for pub, base in ((pubs[0], 5000), (pubs[1], 6000)):  # known, live, nothing shared
            other = list(range(base, base + BS))
            pub.publish([BlockStored(HASHER.keys(other), None, other, BS)])
        make_doubted(cluster, doubt)
        eventually(
            lambda: (
                {p["pod"] for p in httpx.get(f"{cluster.url}/index/pods", timeout=5).json()["pods"]}
                == {m.pod for m in metrics}
            ),
            "three pods indexed",
        )
        cluster.set_pages(c=page(kv=0.05))
        yield cluster, doubt
    finally:
        for pub in pubs:
            pub.close()
        server.stop()
        for m in metrics:
            m.close()


def make_doubted(cluster: Cluster, doubt: str) -> None:
    """Pod c's events make it doubted; run again before each turn (a lag counts only
    while recent: a late batch is published again, and applied before this returns)."""
    pub = cluster.pubs[2]
    own = BlockStored(full_blocks(OWN), None, OWN[: len(OWN) // BS * BS], BS)
    if doubt == LAGGING:
        seq = pub.publish([own], ts=time.time() - LAG_S)
        url = f"{cluster.url}/index/pods/{cluster.c}"
        eventually(
            lambda: httpx.get(url, timeout=5).json()["last_seq"].get(cluster.c, -1) >= seq,
            f"late batch {seq} applied",
        )
    elif doubt == "incomplete" and pub.next_seq == 0:
        pub.publish([own], send=False)  # kvindex first hears seq 1, with no replay port
        pub.publish([own])
    elif doubt == HASH_MISMATCH and pub.next_seq == 0:
        # Hashes that claim the whole conversation, over other tokens: kvindex's check
        # recomputes them from the tokens and finds they do not match.
        keys = full_blocks(TURNS[-1])
        wrong = list(range(70_000, 70_000 + len(keys) * BS))
        pub.publish([BlockStored(keys, None, wrong, BS)])


def route_rows(cluster: Cluster, tokens: list[int], request_id: str, **extra: object) -> dict:
    answer = cluster.route(tokens, request_id=request_id, **extra)
    assert answer.status_code == 200, answer.text
    return answer.json()


def serve_turn(cluster: Cluster, pod: str, held: int, tokens: list[int]) -> int:
    """``pod``'s engine caches ``tokens``' full blocks past the ``held`` it had, and
    publishes them; waits until kvindex applied them. Returns the blocks it holds."""
    keys = full_blocks(tokens)
    pub = cluster.pubs[[m.pod for m in cluster.metrics].index(pod)]
    parent = keys[held - 1] if held else None
    pub.publish([BlockStored(keys[held:], parent, tokens[held * BS : len(keys) * BS], BS)])

    def applied() -> bool:
        body = {"model": MODEL, "token_ids": tokens}
        scored = httpx.post(f"{cluster.url}/score", json=body, timeout=5).json()
        return any(p["pod"] == pod and p["matched_blocks"] == len(keys) for p in scored["pods"])

    eventually(applied, f"{pod} holds {len(keys)} blocks")
    return len(keys)


@pytest.mark.parametrize("doubted_cluster", [LAGGING, "incomplete", HASH_MISMATCH], indirect=True)
def test_a_conversation_stays_on_its_pod_while_another_pod_is_doubted(
    doubted_cluster: tuple[Cluster, str],
) -> None:
    cluster, doubt = doubted_cluster
    a, b, c = cluster.a, cluster.b, cluster.c

    def doubt_seen() -> bool:
        make_doubted(cluster, doubt)
        # Only c: the probe's session, homed where it is routed, weighs on c alone.
        answer = route_rows(cluster, OWN, "doubt-probe", pods=[c])
        cluster.done("doubt-probe")
        return {row["pod"]: row["doubt"] for row in answer["candidates"]}[c] == doubt

    eventually(doubt_seen, f"pod c {doubt}")
    home, held = None, 0
    for turn, tokens in enumerate(TURNS, 1):  # nothing else routed in between
        make_doubted(cluster, doubt)
        answer = route_rows(cluster, tokens, f"turn-{turn}")
        rows = {row["pod"]: row for row in answer["candidates"]}
        assert rows[c]["doubt"] == doubt and rows[c]["load"] == "known", rows[c]
        assert rows[a]["doubt"] is None and rows[b]["doubt"] is None
        assert any(c in w for w in answer["warnings"]), answer["warnings"]
        if doubt == HASH_MISMATCH:  # its claims on the whole conversation earn nothing
            assert rows[c]["matched_blocks"] == 0 and rows[c]["prefix_cost"] > 0
        if home is None:
            home = answer["pod"]
            assert home in (a, b) and answer["reason"] == "load", answer
        else:
            assert (turn, answer["pod"], answer["reason"]) == (turn, home, "prefix"), answer
            assert rows[home]["matched_blocks"] == held
        cluster.done(f"turn-{turn}")
        held = serve_turn(cluster, home, held, tokens)
    if doubt != HASH_MISMATCH:
        # Its own prefix still counts: a prompt only c holds goes to c, by prefix.
        make_doubted(cluster, doubt)
        answer = route_rows(cluster, OWN, "own")
        rows = {row["pod"]: row for row in answer["candidates"]}
        assert (answer["pod"], answer["reason"], rows[c]["doubt"]) == (c, "prefix", doubt)
        assert rows[c]["matched_blocks"] == len(OWN) // BS
        cluster.done("own")
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=5).text
    assert 'reason="fallback_stale_index"' not in metrics


def test_the_credit_rule_per_doubt() -> None:
    """A pure rule: entries that may claim blocks the engine does not hold earn nothing;
    entries that are a lower bound of its cache (or a few seconds late) earn their
    matched blocks."""
    assert {HASH_MISMATCH, "gapped"} == NO_CREDIT
    for doubt in (None, LAGGING, "incomplete", "restored", "unheard", "replaying"):
        assert credits_prefix(doubt), doubt
    for doubt in (HASH_MISMATCH, "gapped"):
        assert not credits_prefix(doubt), doubt
    matches: dict[str, object] = {"p:1": 5, "q:1": 7, "q:1/dp1": 3, "r:1": 2, "s:1": 4}
    speculative = {"q:1": 2, "r:1": 1, "t:1": 6}
    doubts = {"q:1": HASH_MISMATCH, "r:1": "incomplete", "s:1": LAGGING, "t:1": "gapped"}
    dropped = discredit(matches, speculative, doubts)
    assert dropped == ["q:1", "q:1/dp1", "t:1"]  # a pod's data-parallel ranks go with it
    assert matches == {"p:1": 5, "r:1": 2, "s:1": 4}
    assert speculative == {"r:1": 1}
    assert discredit(matches, speculative, {}) == [] and matches == {"p:1": 5, "r:1": 2, "s:1": 4}


def test_a_pods_doubt_is_its_worst_streams() -> None:
    """A pod's data-parallel ranks may differ: the doubt it gets is the worst of theirs
    (a hash mismatch worst of all), whichever rank is read first."""

    def stream(member: str, state: str) -> StreamStatus:
        pod = member.split("/dp", 1)[0]
        return StreamStatus(
            pod, 0, member, MODEL, state, 0, 0, None, None, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, "map", None,
        )  # fmt: skip

    streams = [
        stream("p:1", "incomplete"), stream("p:1/dp1", "gapped"),
        stream("q:1", "replaying"), stream("q:1/dp1", "live"),
        stream("r:1", "live"),
    ]  # fmt: skip
    directory = PodDirectory(MemoryBackend(), lambda: streams)
    doubts = directory.index_doubts(MODEL)
    assert {pod: doubt for pod, (doubt, _) in doubts.items()} == {
        "p:1": "gapped",
        "q:1": "replaying",
    }
    assert directory.index_doubts("another/model") == {}

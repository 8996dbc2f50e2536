"""``/route`` end to end in-process: speculative entries, event-lag staleness, least bad
instead of 429, P/D roles and data-parallel ranks.

A fully composed Service behind the ASGI app, its subscriber bound to real loopback ZMQ
ports that real EnginePublishers connect to (rank r to port + r, as vLLM's ranks do), and
each pod's vLLM 0.33 ``/metrics`` page served over real HTTP.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvindex.api.http.app import create_app
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from kvindex.api.testing import eventually
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig
from tests.test_load import DP1_IDLE, DP2, MetricsServer, with_values

MODEL = "m"
TOKENS = list(range(1000, 1000 + 16 * 24 + 5))  # 24 full blocks and a partial one
KEYS = BlockHasher(HashConfig()).keys(TOKENS)


def page(waiting: int = 0, kv: float = 0.0) -> str:
    text = with_values(DP1_IDLE, "vllm:num_requests_waiting", "0", waiting)
    return with_values(text, "vllm:kv_cache_usage_perc", "0", kv)


def two_free_ports() -> int:
    """A port P with P + 1 also free on 127.0.0.1 (rank 1 publishes to P + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise AssertionError("no two consecutive free ports")


class Live:
    """The service, its pods' metrics servers and their publishers."""

    def __init__(self, client: TestClient, service: Service, port: int) -> None:
        self.client, self.service, self.port = client, service, port
        self.pubs: dict[tuple[str, int], EnginePublisher] = {}
        self.metrics: list[MetricsServer] = []

    def pod(self, text: str) -> str:
        server = MetricsServer(text)
        self.metrics.append(server)
        return server.pod

    def publish(self, pod: str, events: list[Any], rank: int = 0, ts: float | None = None) -> None:
        pub = self.pubs.get((pod, rank))
        if pub is None:
            pub = EnginePublisher(
                f"tcp://127.0.0.1:{self.port}",
                topic=f"kv@{pod}@{MODEL}",
                bind=False,
                data_parallel_rank=rank,
            )
            self.pubs[(pod, rank)] = pub
            assert pub.wait_for_subscribers(1, 5.0)
        seq = pub.publish(events, ts)
        member = pod if rank == 0 else f"{pod}/dp{rank}"
        eventually(
            lambda: any(
                s.member == member and s.last_seq >= seq for s in self.service.subscriber.streams()
            ),
            f"{member} seq {seq} applied",
        )

    def hold(self, pod: str, blocks: int, rank: int = 0) -> None:
        self.publish(pod, [BlockStored(KEYS[:blocks], None, TOKENS[: blocks * 16], 16)], rank)

    def scraped(self, *pods: str) -> None:
        from kvindex.scoring.load import PodLoad

        eventually(
            lambda: all(
                isinstance(load, PodLoad) for load in self.service.load.snapshot(pods).values()
            ),
            f"{pods} scraped",
        )

    def route(self, **body: Any) -> dict[str, Any]:
        answer = self.client.post("/route", json={"model": MODEL, "token_ids": TOKENS, **body})
        assert answer.status_code == 200, answer.text
        return answer.json()

    def close(self) -> None:
        for pub in self.pubs.values():
            pub.close()
        for server in self.metrics:
            server.close()


@pytest.fixture
def live() -> Iterator[Callable[..., Live]]:
    made: list[tuple[Live, TestClient]] = []

    def make(**settings: Any) -> Live:
        port = two_free_ports()
        service = Service(
            from_flags(
                zmq_bind=[f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"],
                model=MODEL,
                load_interval=0.1,
                load_timeout=2.0,
                **settings,
            ),
            route_seed=0,
        )
        client = TestClient(create_app(service))
        client.__enter__()
        state = Live(client, service, port)
        made.append((state, client))
        return state

    yield make
    for state, client in made:
        client.__exit__(None, None, None)
        state.close()


def test_a_burst_before_the_events_lands_on_the_routed_pod(live) -> None:
    cluster = live()
    a, b = cluster.pod(page()), cluster.pod(page())
    other = list(range(50_000, 50_000 + 16))
    for pod in (a, b):  # both known, neither holds the prompt
        cluster.publish(pod, [BlockStored(BlockHasher(HashConfig()).keys(other), None, other, 16)])
    cluster.scraped(a, b)
    first = cluster.route(request_id="r1")
    assert first["reason"] == "load"
    chosen = first["pod"]
    # Before the pod's events arrive, the next request with the prompt goes there too,
    # and every following one: it waits there for r1's queued prefill rather than
    # compute the prompt elsewhere (the speculative prefix outweighs the queued work).
    for n in range(2, 6):
        answer = cluster.route(request_id=f"r{n}")
        assert (answer["pod"], answer["reason"]) == (chosen, "prefix")
        row = next(c for c in answer["candidates"] if c["pod"] == chosen)
        assert (row["matched_blocks"], row["speculative_blocks"]) == (0, 24)
        # r1's whole prompt, then each copy's last partial block, queued as prefill
        assert row["queued_tokens"] == len(TOKENS) + (n - 2) * (len(TOKENS) - 24 * 16)
    # r1's first token is out: its prefill is no longer queued there.
    assert cluster.client.post("/route/r1/first-token").status_code == 200
    peek = cluster.route(request_id="r-peek")
    row = next(c for c in peek["candidates"] if c["pod"] == chosen)
    assert row["queued_tokens"] == 4 * (len(TOKENS) - 24 * 16)
    # /score shows the guess apart and never in the confirmed counts.
    scored = cluster.client.post("/score", json={"model": MODEL, "token_ids": TOKENS}).json()
    (row,) = [p for p in scored["pods"] if p["pod"] == chosen]
    assert (row["matched_blocks"], row["score"], row["speculative_blocks"]) == (0, 0.0, 24)
    # The pod's real events confirm the first 10 blocks, then all of them.
    cluster.hold(chosen, 10)
    scored = cluster.client.post("/score", json={"model": MODEL, "token_ids": TOKENS}).json()
    row = next(p for p in scored["pods"] if p["pod"] == chosen)
    assert (row["matched_blocks"], row["speculative_blocks"]) == (10, 14)
    cluster.hold(chosen, 24)
    scored = cluster.client.post("/score", json={"model": MODEL, "token_ids": TOKENS}).json()
    row = next(p for p in scored["pods"] if p["pod"] == chosen)
    assert (row["matched_blocks"], row["speculative_blocks"]) == (24, 0)
    outcomes = cluster.service.speculative.outcomes()
    assert outcomes["added"] == 6
    metrics = cluster.client.get("/metrics").text
    assert 'kvindex_route_speculative_entries_total{event="added"} 6.0' in metrics
    assert 'kvindex_route_decisions_total{reason="prefix"} 5.0' in metrics


def test_speculative_entries_expire_after_their_ttl(live) -> None:
    cluster = live(speculative_ttl=0.3)
    a, b = cluster.pod(page()), cluster.pod(page())
    cluster.hold(a, 1)
    cluster.hold(b, 1)
    cluster.scraped(a, b)
    chosen = cluster.route(request_id="x1")["pod"]
    cluster.client.post("/route/x1/done")
    eventually(lambda: len(cluster.service.speculative) == 0, "x1's entry to expire")
    answer = cluster.route(request_id="x2")
    assert all(c["speculative_blocks"] == 0 for c in answer["candidates"])
    assert answer["reason"] == "prefix"  # both hold block 0: a tie, any pod
    outcomes = cluster.service.speculative.outcomes()
    assert outcomes["expired"] == 1 and outcomes["confirmed"] == 0, (chosen, outcomes)
    metrics = cluster.client.get("/metrics").text
    assert 'kvindex_route_speculative_entries_total{event="expired"} 1.0' in metrics


def test_event_lag_above_the_threshold_doubts_that_pod_alone(live) -> None:
    """Issue 27: a pod whose events arrive late is doubted (``lagging``, warned), and its
    entries, a few seconds old, keep their credit; the decision stays by prefix."""
    cluster = live(max_event_lag=5.0)
    a, b = cluster.pod(page()), cluster.pod(page(waiting=1))
    cluster.publish(a, [BlockStored(KEYS[:20], None, TOKENS[: 20 * 16], 16)], ts=time.time() - 30)
    cluster.hold(b, 2)
    cluster.scraped(a, b)
    answer = cluster.route()
    assert answer["reason"] == "prefix" and answer["pod"] == a
    rows = {c["pod"]: c for c in answer["candidates"]}
    assert (rows[a]["doubt"], rows[a]["matched_blocks"], rows[b]["doubt"]) == ("lagging", 20, None)
    assert any(a in w and "event lag" in w for w in answer["warnings"])
    metrics = cluster.client.get("/metrics").text
    assert f'kvindex_event_lag_last_seconds{{pod="{a}"}}' in metrics
    # A batch on time: no doubt.
    cluster.hold(a, 20)
    answer = cluster.route()
    assert answer["reason"] == "prefix" and answer["warnings"] == []
    assert all(c["doubt"] is None for c in answer["candidates"])


def test_every_pod_incomplete_still_routes_by_prefix(live) -> None:
    """Issue 27: after a bind-mode restart without replay every pod's stream is
    ``incomplete`` (kvindex first hears it past seq 0); what each is known to hold is
    real, so the decision stays by prefix (it was load-only while they lasted)."""
    cluster = live()
    a, b = cluster.pod(page()), cluster.pod(page())
    for pod, blocks in ((a, 20), (b, 2)):
        pub = EnginePublisher(
            f"tcp://127.0.0.1:{cluster.port}", topic=f"kv@{pod}@{MODEL}", bind=False
        )
        cluster.pubs[(pod, 0)] = pub
        assert pub.wait_for_subscribers(1, 5.0)
        pub.publish([BlockStored(KEYS[:1], None, TOKENS[:16], 16)], send=False)  # missed
        cluster.hold(pod, blocks)
    cluster.scraped(a, b)
    answer = cluster.route()
    assert (answer["pod"], answer["reason"]) == (a, "prefix")
    rows = {c["pod"]: c for c in answer["candidates"]}
    assert {pod: row["doubt"] for pod, row in rows.items()} == {a: "incomplete", b: "incomplete"}
    assert (rows[a]["matched_blocks"], rows[b]["matched_blocks"]) == (20, 2)
    assert len(answer["warnings"]) == 2


def test_least_bad_instead_of_429(live) -> None:
    full = page(waiting=3, kv=0.99)
    strict = live(max_waiting=2)
    a = strict.pod(full)
    strict.hold(a, 4)
    strict.scraped(a)
    refused = strict.client.post("/route", json={"model": MODEL, "token_ids": TOKENS})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    lenient = live(when_full="least_bad", max_waiting=2)
    a, b = lenient.pod(full), lenient.pod(page(waiting=9, kv=0.98))
    lenient.hold(a, 4)
    lenient.hold(b, 1)
    lenient.scraped(a, b)
    answer = lenient.route()
    assert (answer["pod"], answer["reason"]) == (a, "least_bad")
    assert not any(c["admitted"] for c in answer["candidates"])
    metrics = lenient.client.get("/metrics").text
    assert 'kvindex_route_decisions_total{reason="least_bad"} 1.0' in metrics


def test_pd_names_a_prefill_and_a_decode_pod(live) -> None:
    servers = [MetricsServer(page()) for _ in range(3)]
    d, p1, p2 = (s.pod for s in servers)
    cluster = live(pod_role=[f"{d}=decode", f"{p1}=prefill", f"{p2}=prefill"], pd_threshold=64)
    cluster.metrics.extend(servers)
    cluster.hold(d, 1)
    cluster.hold(p1, 1)
    cluster.hold(p2, 20)
    cluster.scraped(d, p1, p2)
    answer = cluster.route(request_id="pd1")
    assert (answer["pod"], answer["decode_pod"], answer["prefill_pod"]) == (d, d, p2)
    assert answer["prefill_reason"] == "prefix"
    roles = {c["pod"]: c["role"] for c in answer["candidates"]}
    assert roles == {d: "decode", p1: "prefill", p2: "prefill"}
    flying = cluster.service.routing.ledger.all()
    assert flying[d].requests == 1 and flying[p2].requests == 1
    assert cluster.client.post("/route/pd1/done").json() == {"route_id": "pd1", "pod": d}
    assert cluster.service.routing.ledger.all() == {}
    # The decode pod now holds every full block: 5 uncached tokens, under the threshold.
    cluster.hold(d, 24)
    answer = cluster.route(request_id="pd2")
    assert answer["prefill_pod"] is None and "pd-threshold" in answer["prefill_reason"]
    # Asking for one role routes among that role only.
    only = cluster.route(role="prefill", request_id="pd3")
    assert only["pod"] in (p1, p2) and only["decode_pod"] is None
    # pd2 repeated pd1's prompt: a session come back, whose later turns are expected;
    # under P/D they prefill on the prefill pods, so no decision prices them.
    assert cluster.service.routing.ledger.future_prefill() > 0
    assert answer["future_prefill_tokens"] == only["future_prefill_tokens"] == 0.0
    metrics = cluster.client.get("/metrics").text
    assert 'kvindex_route_prefill_decisions_total{outcome="remote"} 1.0' in metrics
    assert 'kvindex_route_prefill_decisions_total{outcome="local"} 1.0' in metrics


def test_a_data_parallel_pod_is_one_target_and_names_its_best_rank(live) -> None:
    cluster = live()
    # Rank 0 is busy, rank 1 idle (the captured DP=2 page, with rank 1's queue emptied).
    dp = with_values(DP2, "vllm:num_requests_waiting", "1", 0)
    dp = with_values(dp, "vllm:num_requests_running", "1", 0)
    dp = with_values(dp, "vllm:kv_cache_usage_perc", "1", 0.0)
    pod, single = cluster.pod(dp), cluster.pod(page(waiting=2))
    cluster.hold(pod, 12, rank=1)
    cluster.hold(pod, 2, rank=0)
    cluster.hold(single, 12)
    cluster.scraped(pod, single)
    answer = cluster.route(request_id="dp1")
    assert (answer["pod"], answer["rank"], answer["reason"]) == (pod, 1, "prefix")
    rows = {(c["pod"], c["rank"]): c for c in answer["candidates"]}
    assert set(rows) == {(pod, 0), (pod, 1), (single, 0)}
    assert rows[(pod, 1)]["matched_blocks"] == 12 and rows[(pod, 0)]["matched_blocks"] == 2
    assert rows[(pod, 1)]["waiting"] == 0
    assert cluster.service.routing.ledger.all()[f"{pod}/dp1"].requests == 1
    assert cluster.client.post("/route/dp1/done").json()["pod"] == pod

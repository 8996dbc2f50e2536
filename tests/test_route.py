"""``POST /route`` end to end: a real ``kvindex serve``, pods publishing KV events over
real ZMQ on loopback, and each pod's vLLM 0.33 ``/metrics`` page served over real HTTP
(the captured page, with only the scheduler gauges' values changed)."""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvindex.api.testing import ServeProcess, eventually, free_port, publisher_into
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig
from kvindex.scoring.load_metrics import parse_engine_loads
from tests.redis_fixtures import RedisServer
from tests.test_load import DP1_IDLE, MetricsServer, with_values

pytestmark = pytest.mark.slow

MODEL = "acme/route-7b"
TOKENS = list(range(1000, 1000 + 16 * 32))  # 32 blocks
COLD = list(range(90_000, 90_000 + 16 * 8))  # nobody holds these
HASHER = BlockHasher(HashConfig())
KEYS = HASHER.keys(TOKENS)


def page(running: int = 0, waiting: int = 0, kv: float = 0.0) -> str:
    text = with_values(DP1_IDLE, "vllm:num_requests_running", "0", running)
    text = with_values(text, "vllm:num_requests_waiting", "0", waiting)
    return with_values(text, "vllm:kv_cache_usage_perc", "0", kv)


class ConnectionCounter:
    """A TCP listener on loopback that counts the connections made to it (and closes
    them): proof that kvindex did or did not dial an address."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.pod = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5.0)
        self.sock.close()


class Cluster:
    def __init__(self, server: ServeProcess, pods: list[MetricsServer], pubs) -> None:
        self.server, self.metrics, self.pubs = server, pods, pubs
        self.url = server.url
        self.a, self.b, self.c = (m.pod for m in pods)

    def route(self, tokens=TOKENS, **extra) -> httpx.Response:
        body = {"model": MODEL, "token_ids": tokens, **extra}
        return httpx.post(f"{self.url}/route", json=body, timeout=5)

    def done(self, route_id: str) -> httpx.Response:
        return httpx.post(f"{self.url}/route/{route_id}/done", timeout=5)

    def set_pages(self, **pages: str) -> None:
        """Serve new pages (idle unless named) and wait until /route sees them."""
        for name, server in zip("abc", self.metrics, strict=True):
            server.page = pages.get(name, page())
        # The whole load, not just the queue: a page that only lowers KV usage (0.95 ->
        # idle) has the same waiting count, and a pod still read at 0.95 is not admitted.
        loads = {s.pod: parse_engine_loads(s.page)["0"] for s in self.metrics}
        want = {pod: (e.running, e.waiting, e.kv_usage) for pod, e in loads.items()}

        def seen() -> bool:
            # A model kvindex does not know: load only, no prompt keys, so the probe
            # leaves no session home behind (the same prompt probed again would claim
            # it, and count as a session returning to that pod in the test's decision).
            answer = self.route(COLD, model="probe/unknown", request_id="probe")
            self.done("probe")
            if answer.status_code != 200:
                return False
            got = {
                c["pod"]: (c["running"], c["waiting"], c["kv_usage"])
                for c in answer.json()["candidates"]
            }
            return got == want

        eventually(seen, f"scraped (running, waiting, kv_usage) {want}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    metrics = [MetricsServer(page()) for _ in range(3)]
    bind = free_port()
    server = ServeProcess(
        "--zmq-bind", f"tcp://127.0.0.1:{bind}",
        "--model", MODEL,
        # Scrapes every 0.5 s: a load is stale after three intervals, and 0.3 s (at 0.1)
        # passed without a scrape on a loaded CI machine, turning answers into fallbacks.
        "--load-interval", "0.5",
        "--load-timeout", "2",
        "--max-kv-usage", "0.9",
        "--max-waiting", "40",
        "--route-ttl", "60",
        # The cost model on confirmed entries alone: speculative entries would send a
        # same-prompt burst to one pod (tests/test_route_live.py covers them).
        "--speculative-ttl", "0",
        env={**os.environ},
    )  # fmt: skip
    pubs: list[EnginePublisher] = []
    try:
        server.wait_ready(20.0)
        for m in metrics:
            pubs.append(publisher_into(f"tcp://127.0.0.1:{bind}", m.pod, MODEL))
        cluster = Cluster(server, metrics, pubs)
        # Pod A holds half the prompt; B and C something else, so all three are known.
        pubs[0].publish([BlockStored(KEYS[:16], None, TOKENS[: 16 * 16], 16)])
        for pub, base in ((pubs[1], 5000), (pubs[2], 6000)):
            other = list(range(base, base + 16))
            pub.publish([BlockStored(HASHER.keys(other), None, other, 16)])
        eventually(
            lambda: (
                sorted(
                    p["pod"]
                    for p in httpx.get(f"{server.url}/index/pods", timeout=5).json()["pods"]
                )
                == sorted(m.pod for m in metrics)
            ),
            "three pods indexed",
        )
        cluster.set_pages()
        yield cluster
    finally:
        for pub in pubs:
            pub.close()
        server.stop()
        for m in metrics:
            m.close()


def test_prefix_wins_at_equal_load(cluster: Cluster) -> None:
    cluster.set_pages()
    answer = cluster.route(request_id="eq-1", max_tokens=64)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["pod"], body["reason"], body["route_id"]) == (cluster.a, "prefix", "eq-1")
    assert body["prompt_blocks"] == 32 and body["block_size"] == 16
    by_pod = {c["pod"]: c for c in body["candidates"]}
    assert set(by_pod) == {cluster.a, cluster.b, cluster.c}
    assert by_pod[cluster.a]["matched_blocks"] == 16 and by_pod[cluster.b]["matched_blocks"] == 0
    assert by_pod[cluster.a]["prefix_cost"] == pytest.approx(1.0)  # half the prompt, weight 2
    assert by_pod[cluster.b]["prefix_cost"] == pytest.approx(2.0)
    assert by_pod[cluster.a]["decode_cost"] == by_pod[cluster.a]["queue_cost"] == 0.0
    assert all(c["load"] == "known" and c["admitted"] for c in body["candidates"])
    assert cluster.done("eq-1").json() == {"route_id": "eq-1", "pod": cluster.a}
    assert cluster.done("eq-1").status_code == 404


def test_load_wins_when_the_prefix_pod_is_saturated(cluster: Cluster) -> None:
    cluster.set_pages(a=page(running=30, waiting=20, kv=0.8), c=page(running=2, kv=0.2))
    answer = cluster.route(request_id="busy-1").json()
    assert (answer["pod"], answer["reason"]) == (cluster.b, "load")
    by_pod = {c["pod"]: c for c in answer["candidates"]}
    a, b = by_pod[cluster.a], by_pod[cluster.b]
    assert (a["running"], a["waiting"], a["kv_usage"]) == (30, 20, 0.8)
    assert a["admitted"] and a["prefix_cost"] < b["prefix_cost"] and a["cost"] > b["cost"]
    cluster.done("busy-1")
    # Past --max-kv-usage the prefix pod is not admitted at all.
    cluster.set_pages(a=page(kv=0.95))
    answer = cluster.route(request_id="full-1").json()
    a = next(c for c in answer["candidates"] if c["pod"] == cluster.a)
    assert answer["pod"] != cluster.a and not a["admitted"] and "max-kv-usage" in a["refused"]
    cluster.done("full-1")


def test_in_flight_routes_spread_a_burst_until_done(cluster: Cluster) -> None:
    cluster.set_pages()
    ids = [f"burst-{i}" for i in range(6)]
    picks = [cluster.route(COLD, request_id=rid).json()["pod"] for rid in ids]
    assert Counter(picks) == {cluster.a: 2, cluster.b: 2, cluster.c: 2}
    last = cluster.route(COLD, request_id="burst-peek").json()
    assert {c["in_flight"] for c in last["candidates"]} == {2}
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=5).text
    assert f'kvindex_route_in_flight{{pod="{cluster.a}"}}' in metrics
    for rid in [*ids, "burst-peek"]:
        assert cluster.done(rid).status_code == 200
    after = cluster.route(COLD, request_id="burst-after").json()
    assert {c["in_flight"] for c in after["candidates"]} == {0}
    cluster.done("burst-after")


def test_a_routes_prefill_counts_as_queued_until_its_first_token(cluster: Cluster) -> None:
    cluster.set_pages()
    first = cluster.route(COLD, request_id="ft-1", pods=[cluster.b]).json()
    assert first["pod"] == cluster.b

    def row() -> dict:
        answer = cluster.route(COLD, request_id="ft-peek", pods=[cluster.b]).json()
        cluster.done("ft-peek")
        # F, the prefill a starting session's later turns are expected to bring, is
        # in the decode term (0 when the peek continues the previous one's session).
        return {**answer["candidates"][0], "future": answer["future_prefill_tokens"]}

    queued = row()
    assert (queued["in_flight"], queued["queued_tokens"]) == (1, len(COLD))
    assert queued["queue_cost"] == pytest.approx(1.0)
    # R: the request in flight and the sessions homed on b by the earlier tests' routes.
    sharing = queued["in_flight"] + queued["sessions"]
    decode = sharing * (len(COLD) + queued["future"]) / len(COLD)
    assert queued["decode_cost"] == pytest.approx(decode)
    answer = httpx.post(f"{cluster.url}/route/ft-1/first-token", timeout=5)
    assert answer.json() == {"route_id": "ft-1", "pod": cluster.b}
    decoding = row()  # still a request on the pod, its prefill no longer queued
    assert (decoding["in_flight"], decoding["queued_tokens"], decoding["queue_cost"]) == (1, 0, 0)
    assert cluster.done("ft-1").status_code == 200
    assert httpx.post(f"{cluster.url}/route/ft-1/first-token", timeout=5).status_code == 404


def test_a_pod_restarted_since_its_last_events_is_not_credited_its_old_cache(
    cluster: Cluster,
) -> None:
    """Pod A's page says its server started after the last KV-event batch the index
    applied from it (``process_start_time_seconds`` of the captured page, moved): its
    engine restarted and has not published since, so its index entries are the old
    engine's, ignored with a warning. Its next batch (stamped after the start) makes
    them count again."""
    cluster.set_pages()
    captured = "process_start_time_seconds 1.79612220932e+09"
    assert captured in page()
    started = time.time() + 5.0  # the pod's clock: after its last batch's timestamp

    def row_of_a() -> dict:
        answer = cluster.route(request_id="rs-probe").json()
        cluster.done("rs-probe")
        return next(c for c in answer["candidates"] if c["pod"] == cluster.a), answer

    assert row_of_a()[0]["matched_blocks"] == 16
    cluster.metrics[0].page = page().replace(captured, f"process_start_time_seconds {started}")
    eventually(lambda: row_of_a()[0]["matched_blocks"] == 0, "A's old entries ignored")
    warnings = row_of_a()[1]["warnings"]
    assert any(cluster.a in w and "restarted" in w for w in warnings), warnings
    cluster.pubs[0].publish(
        [BlockStored(KEYS[16:18], KEYS[15], TOKENS[16 * 16 : 18 * 16], 16)], ts=started + 1.0
    )
    eventually(lambda: row_of_a()[0]["matched_blocks"] == 18, "A heard from since its start")
    cluster.set_pages()


def test_every_pod_full_is_saturation_and_the_cost_still_decides(cluster: Cluster) -> None:
    """Issue 28: past --max-kv-usage on every pod (running requests fill every cache at
    twice the knee) the cluster is saturated, not closed: each pod is admitted, the prefix
    still decides, and a warning and a counter say so."""
    full = page(running=50, kv=0.97)
    for server in cluster.metrics:
        server.page = full

    def saturated() -> bool:
        answer = cluster.route()
        assert answer.status_code == 200, answer.text
        cluster.done(answer.json()["route_id"])
        return any("saturated" in w for w in answer.json()["warnings"])

    eventually(saturated, "every pod over --max-kv-usage")
    answer = cluster.route()
    body = answer.json()
    cluster.done(body["route_id"])
    assert (body["pod"], body["reason"]) == (cluster.a, "prefix")
    assert all(c["admitted"] and c["refused"] is None for c in body["candidates"])
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=5).text
    assert "kvindex_route_saturated_total" in metrics
    cluster.set_pages()


def test_no_admissible_pod_is_429_with_retry_after(cluster: Cluster) -> None:
    queued = page(running=50, waiting=41, kv=0.5)
    for server in cluster.metrics:
        server.page = queued

    def refused() -> bool:
        answer = cluster.route(COLD)
        if answer.status_code == 200:  # not scraped yet: release it, later tests count
            cluster.done(answer.json()["route_id"])
        return answer.status_code == 429

    eventually(refused, "every pod over --max-waiting")
    refused = cluster.route(COLD)
    assert refused.json()["error"] == "no_capacity"
    assert "more than --max-waiting 40" in refused.json()["detail"]
    assert int(refused.headers["retry-after"]) == math.ceil(0.1)
    metrics = httpx.get(f"{cluster.url}/metrics", timeout=5).text
    assert 'kvindex_route_decisions_total{reason="no_capacity"}' in metrics
    assert 'kvindex_route_decisions_total{reason="prefix"}' in metrics
    cluster.set_pages()


def test_an_unknown_model_falls_back_to_load(cluster: Cluster) -> None:
    cluster.set_pages(a=page(waiting=3))
    answer = cluster.route(model="nobody/knows", request_id="unk-1").json()
    assert answer["reason"] == "fallback_unknown_model" and answer["pod"] != cluster.a
    cluster.done("unk-1")
    bad = cluster.route(model=MODEL, token_ids=None)
    assert bad.status_code == 400 and bad.json()["error"] == "invalid_request"


def test_pods_kvindex_does_not_know_are_ignored_and_never_dialled(cluster: Cluster) -> None:
    """Issue 26, item 3: a pod named in /route's ``pods`` was scraped (GET
    http://HOST:PORT/metrics every load interval for 5 minutes), could be chosen, and
    its scrape errors were a /metrics label: kvindex dialled any address a client wrote.
    Now a named pod kvindex does not know (not configured, discovered or publishing) is
    left out with a warning and never dialled; naming only such pods is a 503 no_pods."""
    cluster.set_pages()
    stranger = ConnectionCounter()  # listens on loopback: a dial would be counted
    known_server = cluster.metrics[1]  # pod b: scraped every load interval
    try:
        answer = cluster.route(COLD, pods=[stranger.pod, cluster.b], request_id="ssrf-1")
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["pod"] == cluster.b and [c["pod"] for c in body["candidates"]] == [cluster.b]
        assert any(stranger.pod in w and "not known" in w for w in body["warnings"])
        cluster.done("ssrf-1")
        alone = cluster.route(COLD, pods=[stranger.pod, "127.0.0.1:9"])
        assert alone.status_code == 503 and alone.json()["error"] == "no_pods"
        assert stranger.pod in alone.json()["detail"]
        # Several load intervals (0.5 s each): b scraped four more times, the stranger
        # not once, and no metric names it.
        scrapes = known_server.requests
        eventually(lambda: known_server.requests >= scrapes + 4, "four more scrapes of b")
        assert stranger.connections == 0
        metrics = httpx.get(f"{cluster.url}/metrics", timeout=5).text
        assert stranger.pod not in metrics and "127.0.0.1:9" not in metrics
    finally:
        stranger.close()


def scrape_errors(url: str) -> dict[tuple[str, str], float]:
    """kvindex's ``kvindex_load_scrape_errors_total`` by (pod, kind)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        (sample.labels["pod"], sample.labels["kind"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "kvindex_load_scrape_errors"
        for sample in family.samples
        if sample.name == "kvindex_load_scrape_errors_total"
    }


@pytest.mark.parametrize("value", ["1e30", "+Inf", "NaN", "-5"])
def test_a_pod_page_with_an_impossible_figure_is_that_pods_scrape_error_alone(
    cluster: Cluster, value: str
) -> None:
    """Issue 26, item 2: ``vllm:num_requests_running 1e30`` on one pod's page made
    every /route naming it a 500 (OverflowError in the route loop), and ``+Inf`` aborted
    every scrape round (all pods' load went stale). Now that page is that pod's scrape
    error (bad_metrics), its load unknown, while the others are scraped and routed."""
    cluster.set_pages()
    bad = (cluster.c, "bad_metrics")
    before = scrape_errors(cluster.url)
    cluster.metrics[2].page = with_values(page(), "vllm:num_requests_running", "0", value)
    eventually(
        lambda: scrape_errors(cluster.url).get(bad, 0) >= before.get(bad, 0) + 2,
        "c's page counted as bad twice",
    )
    # The other pods are still scraped: a new figure on a's page is seen.
    cluster.metrics[0].page = page(waiting=2)

    def rows() -> dict[str, dict]:
        answer = cluster.route(COLD, request_id="bad-page")
        assert answer.status_code == 200, answer.text
        cluster.done("bad-page")
        return {c["pod"]: c for c in answer.json()["candidates"]}

    eventually(lambda: rows()[cluster.a]["waiting"] == 2, "a's new page scraped")
    got = rows()
    assert got[cluster.c]["load"] == "not_scraped" and got[cluster.c]["running"] is None
    assert got[cluster.a]["load"] == got[cluster.b]["load"] == "known"
    after = scrape_errors(cluster.url)
    assert {key: n for key, n in after.items() if n != before.get(key, 0)}.keys() == {bad}
    cluster.set_pages()


@pytest.mark.parametrize("max_tokens", [2**63, 1e30, 2**64 * 10, -1])
def test_max_tokens_out_of_range_is_a_clear_400(cluster: Cluster, max_tokens: float) -> None:
    """Issue 26, item 2: a /route body's ``max_tokens`` past any output (2^63, 1e30)
    is refused, naming the field, not taken into the ledger's counts."""
    answer = cluster.route(COLD, max_tokens=max_tokens, request_id="huge-output")
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "invalid_request" and "max_tokens" in answer.text
    most = cluster.route(COLD, max_tokens=2**31 - 1, request_id="long-output")
    assert most.status_code == 200, most.text
    assert cluster.done("long-output").status_code == 200


def test_a_gapped_pod_loses_its_own_prefix_credit_alone(cluster: Cluster) -> None:
    """Issue 27: a gapped stream (its lost batches may have held evictions) costs its pod
    the credit of its entries, and only that pod: its load still counts, another pod's
    shorter prefix still decides, and its row says why. (Before, the whole decision went
    load-only, ``fallback_stale_index``.)"""
    # Runs last in this module: pod A's stream stays gapped (no replay endpoint).
    cluster.set_pages()
    fresh = list(range(200_000, 200_000 + 16 * 8))  # a prompt no earlier test routed
    keys = HASHER.keys(fresh)
    cluster.pubs[1].publish([BlockStored(keys[:4], None, fresh[: 4 * 16], 16)])
    pub = cluster.pubs[0]
    pub.publish([BlockStored(KEYS[16:20], KEYS[15], TOKENS[16 * 16 : 20 * 16], 16)], send=False)
    pub.publish([BlockStored(keys, None, fresh, 16)])  # all of it, after the gap

    def route(request_id: str, **extra) -> tuple[dict, dict[str, dict]]:
        answer = cluster.route(fresh, request_id=request_id, **extra).json()
        cluster.done(request_id)
        return answer, {c["pod"]: c for c in answer["candidates"]}

    def gapped() -> bool:  # probes A alone: their sessions, homed there, weigh on A only
        _, by_pod = route("gap-probe", pods=[cluster.a])
        return by_pod[cluster.a]["doubt"] == "gapped"

    eventually(gapped, "pod A's stream gapped")
    eventually(lambda: route("b-probe", pods=[cluster.b])[1][cluster.b]["matched_blocks"] == 4,
               "B's blocks indexed")  # fmt: skip
    answer, by_pod = route("gap-1")
    assert (answer["pod"], answer["reason"]) == (cluster.b, "prefix"), answer
    assert by_pod[cluster.a]["matched_blocks"] == 0 and by_pod[cluster.a]["load"] == "known"
    assert by_pod[cluster.b]["doubt"] is None and by_pod[cluster.c]["doubt"] is None
    assert any(cluster.a in w and "gapped" in w and "not credited" in w for w in answer["warnings"])
    answer, _ = route("gap-2", pods=[cluster.b, cluster.c])
    assert answer["reason"] == "prefix" and answer["warnings"] == []  # A is not asked


def test_backend_down_falls_back_to_load(redis_server: RedisServer) -> None:
    metrics = [MetricsServer(page()), MetricsServer(page(waiting=2))]
    server = ServeProcess(
        "--backend", redis_server.url,
        "--model", MODEL,
        "--load-interval", "0.5",
        # Configured: nothing publishes here, and kvindex routes only to pods it knows.
        *(arg for m in metrics for arg in ("--pod-role", f"{m.pod}=both")),
        env={**os.environ},
    )  # fmt: skip
    try:
        server.wait_ready(20.0)
        body = {"model": MODEL, "token_ids": TOKENS, "pods": [m.pod for m in metrics]}

        def by_load() -> bool:
            answer = httpx.post(f"{server.url}/route", json=body, timeout=10)
            return answer.json()["reason"] == "load"

        eventually(by_load, "a decision by load once both pods are scraped")
        redis_server.stop()  # the index backend goes away under a running kvindex
        answer = httpx.post(f"{server.url}/route", json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        got = answer.json()
        assert got["reason"] == "fallback_backend_down" and got["pod"] in body["pods"]
        assert any("index backend unavailable" in w for w in got["warnings"])
        assert httpx.post(f"{server.url}/route/nope/done", timeout=5).status_code == 404
    finally:
        server.stop()
        for m in metrics:
            m.close()


def test_a_session_between_turns_counts_on_its_pod_until_its_next_turn() -> None:
    """A finished route homes its session on its pod (``sessions`` in the row, counted
    in ``decode_cost``), so a new session goes elsewhere; the session's next turn, whose
    prompt extends the last one, claims the home before its own decision."""
    metrics = [MetricsServer(page()) for _ in range(2)]
    a, b = (m.pod for m in metrics)
    server = ServeProcess(
        "--zmq-bind", f"tcp://127.0.0.1:{free_port()}",
        "--model", MODEL,
        # The pages never change here: a long interval keeps the loads from going stale
        # (after three intervals) between the probe and the decisions on a loaded machine.
        "--load-interval", "3",
        "--speculative-ttl", "0",
        "--pod-role", f"{a}=both", "--pod-role", f"{b}=both",  # known: nothing publishes
        env={**os.environ},
    )  # fmt: skip
    turns = [list(range(200_000, 200_000 + 40 * n)) for n in (1, 2, 3)]  # one chat, growing

    def route(tokens: list[int], rid: str, pods: list[str]) -> dict:
        body = {"model": MODEL, "token_ids": tokens, "request_id": rid, "pods": pods}
        answer = httpx.post(f"{server.url}/route", json=body, timeout=5)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def done(rid: str) -> None:
        assert httpx.post(f"{server.url}/route/{rid}/done", timeout=5).status_code == 200

    try:
        server.wait_ready(20.0)

        def both_scraped() -> bool:  # a prompt under one block: no keys, so no home
            probe = route(list(range(10)), "probe", [a, b])
            done("probe")
            return all(c["load"] == "known" for c in probe["candidates"])

        eventually(both_scraped, "both pods scraped")
        for i, tokens in enumerate(turns[:2]):  # the first return teaches kvindex that
            assert route(tokens, f"turn-{i}", [a])["pod"] == a  # sessions come back
            done(f"turn-{i}")
        fresh = route(list(range(300_000, 300_064)), "new-session", [a, b])
        rows = {c["pod"]: c for c in fresh["candidates"]}
        assert (rows[a]["sessions"], rows[b]["sessions"]) == (1.0, 0.0)
        # Its later turns: one return of one home (share 1, priced at most 0.9) of a
        # continuation that computed all its 80 tokens (nothing was published): 9 x 80.
        assert fresh["future_prefill_tokens"] == pytest.approx(720.0)
        assert rows[a]["decode_cost"] == pytest.approx(1.0 * (64 + 720) / 64)
        assert rows[b]["decode_cost"] == 0.0
        assert fresh["pod"] == b  # nothing cached anywhere: the homed session decides
        back = route(turns[2], "turn-2", [a, b])
        assert {c["pod"]: c["sessions"] for c in back["candidates"]} == {a: 0.0, b: 0.0}
        assert back["future_prefill_tokens"] == 0.0  # a later turn follows its history
    finally:
        server.stop()
        for m in metrics:
            m.close()


def test_an_external_clock_ages_route_state_by_the_callers_time() -> None:
    """``--clock external``: each /route call's ``?now=`` is kvindex's time. A route
    entered at 0 is still held at 59 virtual seconds (--route-ttl 60) and gone at 61,
    however little wall time passed; a call without its time, or going back, is a 400."""
    metrics = MetricsServer(page())
    server = ServeProcess(
        "--zmq-bind", f"tcp://127.0.0.1:{free_port()}",
        "--model", MODEL,
        "--load-interval", "0.5",
        "--route-ttl", "60",
        "--clock", "external",
        "--route-seed", "3",
        "--pod-role", f"{metrics.pod}=both",
        env={**os.environ},
    )  # fmt: skip
    body = {"model": MODEL, "token_ids": TOKENS, "pods": [metrics.pod]}

    def post(path: str, now: float | None, **kwargs) -> httpx.Response:
        params = {} if now is None else {"now": str(now)}
        return httpx.post(f"{server.url}{path}", params=params, timeout=5, **kwargs)

    try:
        server.wait_ready(20.0)
        for rid, now in (("held", 0.0), ("expired", 0.0)):
            answer = post("/route", now, json={**body, "request_id": rid})
            assert answer.status_code == 200, answer.text
        assert post("/route/held/done", 59.0).status_code == 200
        assert post("/route/expired/done", 61.0).status_code == 404  # its TTL passed
        missing = post("/route", None, json=body)
        assert missing.status_code == 400 and "?now=SECONDS" in missing.text
        back = post("/route", 30.0, json=body)
        assert back.status_code == 400 and "before the last time" in back.text
        assert post("/route", float("nan"), json=body).status_code == 400
    finally:
        server.stop()
        metrics.close()

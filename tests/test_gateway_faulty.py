"""Faulty pods stop drawing traffic (issue 27), through a running ``kvindex serve
--gateway`` with pods on loopback that publish real KV events (:mod:`tests.faulty_pod`):
a killed pod (its port closed), a blackholed one (connections time out), a frozen one
(reads requests, never answers) and one answering 500.

Each bad pod first holds the prompt's prefix, so the cost sends the prompt to it (the
storm users buy kvindex for: before ejection existed every request went back to it).
After the failure that marks it bad (``--eject-after`` 1), under 1% of the next
requests reach it (counted by the gateway: a pod it answered from or skipped), /route
shows it ejected with its reason, and once it is healthy again its probe succeeds and
it serves again. Its last good load stays its load throughout (``--load-stale-after``),
so nothing but the ejection keeps traffic away from it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvindex.api.testing import ServeProcess, eventually, free_port
from tests.faulty_pod import FaultyPod

pytestmark = pytest.mark.slow

MODEL = "acme/faulty"
FOLLOWING = 200  # requests sent after the pod is known bad
EJECT_BASE_S = 4.0


def prompt(seed: int) -> list[int]:
    return [1000 + seed * 7919 + i for i in range(16 * 20 + 1)]  # 20 full blocks and 1


class Cluster:
    def __init__(self, server: ServeProcess, good: list[FaultyPod], bad: FaultyPod) -> None:
        self.server, self.good, self.bad = server, good, bad
        self.http = httpx.Client(base_url=server.url, timeout=30.0)

    def complete(self, tokens: list[int], stream: bool = True) -> httpx.Response:
        body = {"model": MODEL, "prompt": tokens, "max_tokens": 1, "stream": stream}
        return self.http.post("/v1/completions", json=body)

    def reached(self, answer: httpx.Response, pod: str) -> bool:
        """Whether ``pod`` got the request: it answered, or the gateway tried it first."""
        failed = answer.headers.get("x-kvindex-failed-pods", "").split(",")
        return answer.headers.get("x-kvindex-pod") == pod or pod in failed

    def held(self, tokens: list[int], pod: str) -> int:
        """The blocks of ``tokens`` the index says ``pod`` holds (/score: no route, so no
        speculative entries left on the pod a route would choose)."""
        body = {"model": MODEL, "token_ids": tokens, "pods": [pod]}
        return self.http.post("/score", json=body).json()["pods"][0]["matched_blocks"]

    def route_row(self, tokens: list[int], pod: str) -> dict:  # type: ignore[type-arg]
        answer = self.http.post("/route", json={"model": MODEL, "token_ids": tokens})
        decision = answer.json()
        self.http.post(f"/route/{decision['route_id']}/done")
        return next(c for c in decision["candidates"] if c["pod"] == pod)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = ServeProcess(
        "--gateway", "--zmq-bind", endpoint,
        "--load-interval", "0.5", "--load-stale-after", "600",
        "--gateway-first-byte-timeout", "1", "--gateway-connect-timeout", "0.5",
        "--eject-after", "1", "--eject-base", str(EJECT_BASE_S),
        env={k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")},
    )  # fmt: skip
    pods: list[FaultyPod] = []
    try:
        server.wait_ready(30.0)
        pods = [FaultyPod(MODEL, endpoint) for _ in range(3)]
        for i, pod in enumerate(pods):
            assert pod.publisher.wait_for_subscribers(1, 10.0)
            pod.compute(prompt(100 + i))  # known to the index, its model with it
        made = Cluster(server, pods[:2], pods[2])

        def scraped() -> bool:
            rows = made.http.post("/route", json={"model": MODEL, "token_ids": prompt(0)})
            if rows.status_code != 200:
                return False
            made.http.post(f"/route/{rows.json()['route_id']}/done")
            candidates = rows.json()["candidates"]
            return len(candidates) == 3 and all(c["load"] == "known" for c in candidates)

        eventually(scraped, "three pods known and scraped")
        yield made
    finally:
        for pod in pods:
            pod.close()
        server.stop()


@pytest.mark.parametrize("fault", ["killed", "blackholed", "frozen", "http_500"])
def test_a_faulty_pod_stops_drawing_traffic_and_recovers(cluster: Cluster, fault: str) -> None:
    bad = cluster.bad.pod
    tokens = prompt(1)
    cluster.bad.compute(tokens)
    eventually(lambda: cluster.held(tokens, bad) == 20, "the bad pod's prefix indexed")
    answer = cluster.complete(tokens)
    assert answer.status_code == 200 and answer.headers["x-kvindex-pod"] == bad  # its prefix

    cluster.bad.set_mode(fault)
    marked = cluster.complete(tokens)  # the failure that marks it bad
    assert cluster.reached(marked, bad), marked.headers
    if fault == "http_500":
        assert marked.status_code == 500  # the pod's answer: nothing was retried
    else:  # nothing was sent to the client yet: the gateway retried on another pod
        assert marked.status_code == 200, marked.text
        assert marked.headers["x-kvindex-pod"] != bad
    row = cluster.route_row(tokens, bad)
    assert row["ejected"] and row["matched_blocks"] == 20, row

    received_before = cluster.bad.received
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: cluster.complete(tokens), range(FOLLOWING)))
    reached = sum(cluster.reached(a, bad) for a in answers)
    assert reached < FOLLOWING // 100, f"{reached} of {FOLLOWING} reached {fault} pod {bad}"
    assert cluster.bad.received - received_before <= reached
    assert all(a.status_code == 200 for a in answers if not cluster.reached(a, bad))

    cluster.bad.set_mode("ok")  # healthy again: the next probe finds it so
    fresh = prompt(2)  # held by it alone, so the probe's decision chooses it
    cluster.bad.compute(fresh)
    eventually(lambda: cluster.held(fresh, bad) == 20, "its new prefix indexed")

    def serves_again() -> bool:
        answer = cluster.complete(fresh)
        return answer.status_code == 200 and answer.headers["x-kvindex-pod"] == bad

    eventually(serves_again, f"the {fault} pod probed and serving again", 6 * EJECT_BASE_S)
    assert cluster.route_row(fresh, bad)["ejected"] is None


def test_a_gateway_over_http_reports_outcomes_in_route_done(cluster: Cluster) -> None:
    """``kvindex gateway --index URL`` and external gateways report a pod's failure in
    ``POST /route/{id}/done``'s optional body; a bad outcome is a 400 that releases
    nothing."""
    bad, tokens = cluster.bad.pod, prompt(3)
    decision = cluster.http.post(
        "/route", json={"model": MODEL, "token_ids": tokens, "pods": [bad]}
    ).json()
    route_id = decision["route_id"]
    refused = cluster.http.post(f"/route/{route_id}/done", json={"outcome": "sometimes"})
    assert refused.status_code == 400 and refused.json()["error"] == "invalid_request"
    done = cluster.http.post(f"/route/{route_id}/done", json={"outcome": "http_5xx"})
    assert done.status_code == 200 and done.json()["pod"] == bad
    assert "http_5xx" in cluster.route_row(tokens, bad)["ejected"]
    metrics = cluster.http.get("/metrics").text
    assert "kvindex_route_ejections_total 1.0" in metrics


def test_a_frozen_pod_is_set_aside_by_its_silent_metrics_before_a_request_waits_on_it(
    cluster: Cluster,
) -> None:
    """A non-streamed answer's status line comes with the whole answer, so no first-byte
    timeout can tell a frozen pod from a long generation; its /metrics going silent can
    (three scrapes in a row): it is ejected before any request was sent to it, and the
    non-streamed requests its prefix would draw go elsewhere at once."""
    bad = cluster.bad.pod
    tokens = prompt(3)
    cluster.bad.compute(tokens)
    eventually(lambda: cluster.held(tokens, bad) == 20, "the frozen pod's prefix indexed")
    received_before = cluster.bad.received
    cluster.bad.set_mode("frozen")
    eventually(lambda: bool(cluster.route_row(tokens, bad)["ejected"]), "frozen pod ejected")
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: cluster.complete(tokens, stream=False), range(40)))
    assert all(a.status_code == 200 for a in answers), [a.status_code for a in answers]
    assert not any(cluster.reached(a, bad) for a in answers)
    assert cluster.bad.received == received_before  # nothing was ever sent to it

"""One seed, one set of figures: kvindex-route through a real ``kvindex serve`` run
twice gives the same answers, because the simulator drives kvindex's clock
(``--clock external``) and seeds its tie-breaks (``--route-seed``)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pytest

from bench.sim.cluster import ClusterSpec
from bench.sim.lag import LagModel
from bench.sim.results import RunResult
from bench.sim.runner import RunSpec, run
from bench.sim.workloads import ChatSpec, prepare
from kvindex.indexer.keys import BlockHasher, HashConfig
from kvindex.scoring.route.decision import Router


def figures(result: RunResult) -> dict[str, object]:
    """What a run reports, less its wall time: every request's TTFT in completion
    order, where the requests went and why, and what they reused."""
    assert result.index is not None
    return {
        "ttfts": result.ttfts,
        "e2es": result.e2es,
        "routed_per_pod": result.routed_per_pod,
        "hit_ratio": result.hit_ratio,
        "reasons": result.index["route_reasons"],
        "refusals": result.index["route_refusals"],
        "preemptions": result.preemptions,
    }


@pytest.mark.timeout(60)
def test_kvindex_route_gives_the_same_figures_for_a_seed() -> None:
    """Chat sessions over 3 pods: ties at the start (every pod empty and idle), session
    homes, speculative entries and the in-flight ledger all enter the decisions; the
    same seed must reproduce every TTFT and every pod's share."""
    spec = ChatSpec(
        users=10,
        turns=3,
        system_tokens=48,
        user_tokens=40,
        output_tokens=24,
        think_s=1.0,
        sessions_per_s=4.0,
    )
    prepared = prepare(spec.build(5, "chat"), BlockHasher(HashConfig(block_size=16)))
    cluster = ClusterSpec(pods=3, blocks_per_pod=128, block_size=16).for_run(3)
    runs = [
        run(prepared, RunSpec("tiny", "kvindex-route", cluster, seed=5, lag=LagModel(0.0)))
        for _ in range(2)
    ]
    first, second = (figures(r) for r in runs)
    assert first["refusals"] == 0 and sum(first["routed_per_pod"]) == len(prepared.requests)
    assert first == second


@pytest.mark.timeout(90)
def test_another_scraper_of_the_pods_changes_no_figure() -> None:
    """Another kvindex on the host scraping the same pod addresses (another run of the
    suite) GETs the pods' /metrics pages between this kvindex's scrapes; the figures
    must still be the seed's, as without it."""
    spec = ChatSpec(
        users=6,
        turns=3,
        system_tokens=48,
        user_tokens=40,
        output_tokens=24,
        think_s=1.0,
        sessions_per_s=4.0,
    )
    prepared = prepare(spec.build(7, "chat"), BlockHasher(HashConfig(block_size=16)))
    cluster = ClusterSpec(pods=3, blocks_per_pod=128, block_size=16).for_run(os.getpid() % 60_000)
    quiet = run(prepared, RunSpec("tiny", "kvindex-route", cluster, seed=7, lag=LagModel(0.0)))
    urls = [f"http://{pod}/metrics" for pod in cluster.pod_ids()]
    other = subprocess.Popen([sys.executable, "-c", _SCRAPE_FOREVER, *urls])
    try:
        busy = run(prepared, RunSpec("tiny", "kvindex-route", cluster, seed=7, lag=LagModel(0.0)))
    finally:
        other.kill()
        other.wait()
    assert figures(busy) == figures(quiet)


#: Another scraper: GET every URL given about every 2 ms, each on a connection of its
#: own that it keeps, whatever answers (the pods' servers come and go).
_SCRAPE_FOREVER = """
import http.client, sys, threading, time, urllib.parse

def scrape(url):
    where = urllib.parse.urlsplit(url)
    while True:
        try:
            connection = http.client.HTTPConnection(where.hostname, where.port, timeout=5)
            while True:
                connection.request("GET", where.path)
                connection.getresponse().read()
                time.sleep(0.002)
        except OSError:
            time.sleep(0.01)

for url in sys.argv[1:]:
    threading.Thread(target=scrape, args=(url,), daemon=True).start()
threading.Event().wait()
"""


def test_the_router_breaks_ties_with_its_seeded_rng() -> None:
    """Equal costs: the choice is ``random.Random(seed).choice`` over the tied pods,
    draw for draw."""
    pods = ["a", "b", "c", "d"]
    costs, loads, usable = [1.0] * 4, [0.0] * 4, [0] * 4
    router = Router(seed=42)
    chosen = [router.choose(pods, costs, loads, usable, [0, 1, 2, 3], None)[0] for _ in range(50)]
    reference = random.Random(42)
    assert chosen == [reference.choice(range(4)) for _ in range(50)]
    assert len(set(chosen)) > 1  # a tie-break, not a fixed pick

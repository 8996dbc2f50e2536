"""Live load per pod: vLLM metrics pages scraped over real HTTP on loopback, staleness,
scrape failures, and the in-flight ledger.

The pages served are what vLLM 0.33's own PrometheusStatLogger exposes (captured with
tests/fixtures/metrics/capture_vllm_metrics.py); tests change only the sample values of
the three scheduler gauges, so names, labels, types and the ~900 other lines are vLLM's.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvindex.events.ingest.testing import wait_until
from kvindex.scoring.load import LoadView, PodLoad, Unknown
from kvindex.scoring.load_metrics import (
    MAX_REQUESTS,
    MetricsError,
    parse_engine_loads,
    parse_start_time,
)
from kvindex.scoring.route.inflight import InFlight, InFlightLedger

METRICS = Path(__file__).parent / "fixtures" / "metrics"
DP2 = (METRICS / "vllm-0.33-dp2-busy.txt").read_text()
DP1_IDLE = (METRICS / "vllm-0.33-dp1-idle.txt").read_text()


def with_values(page: str, metric: str, engine: str, value: float | str) -> str:
    """``page`` with the sample of ``metric`` for ``engine`` set to ``value`` (a string
    is written as it is: ``+Inf``, ``NaN``, ``1e30``)."""
    text = value if isinstance(value, str) else repr(float(value))
    pattern = re.compile(rf'^({re.escape(metric)}\{{engine="{engine}",[^}}]*\}}) \S+$', re.M)
    changed, count = pattern.subn(rf"\g<1> {text}", page)
    assert count == 1, f"{metric} engine {engine} not in page"
    return changed


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class MetricsServer:
    """A real HTTP server on loopback answering GET /metrics with a settable page,
    status and delay."""

    def __init__(self, page: str) -> None:
        self.page, self.status, self.delay_s = page, 200, 0.0
        self.requests = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.requests += 1
                if owner.delay_s:
                    time.sleep(owner.delay_s)
                body = owner.page.encode()
                self.send_response(owner.status if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                # the scraper gave up on a slow page (its timeout): expected
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.pod = f"127.0.0.1:{self.server.server_address[1]}"
        # polled every 50 ms (the default 0.5 s is what each close() would wait)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers() -> Iterator[list[MetricsServer]]:
    made = [MetricsServer(DP2), MetricsServer(DP1_IDLE)]
    yield made
    for server in made:
        server.close()


def test_vllm_pages_parse_to_per_engine_and_pod_totals() -> None:
    engines = parse_engine_loads(DP2)
    assert sorted(engines) == ["0", "1"]
    assert (engines["0"].running, engines["0"].waiting, engines["0"].kv_usage) == (3, 2, 0.25)
    assert (engines["1"].running, engines["1"].waiting, engines["1"].kv_usage) == (5, 0, 0.75)
    idle = parse_engine_loads(DP1_IDLE)
    assert list(idle) == ["0"] and (idle["0"].running, idle["0"].waiting) == (0, 0)


def test_older_kv_gauge_name_is_read_when_the_new_one_is_absent() -> None:
    old = DP1_IDLE.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    old = with_values(old, "vllm:gpu_cache_usage_perc", "0", 0.4)
    assert parse_engine_loads(old)["0"].kv_usage == 0.4


def test_requests_are_summed_over_model_label_sets() -> None:
    second = DP1_IDLE.replace('model_name="Qwen/Qwen3-8B"', 'model_name="other"')
    running = with_values(second, "vllm:num_requests_running", "0", 4)
    both = with_values(DP1_IDLE, "vllm:num_requests_running", "0", 3) + "\n".join(
        line for line in running.splitlines() if line.startswith("vllm:num_requests_running{")
    )
    assert parse_engine_loads(both + "\n")["0"].running == 7


#: An SGLang 0.5.23 page's scheduler gauges (names and labels from its
#: ``observability/metrics_collector.py``), two data-parallel ranks and two TP ranks of
#: rank 1 exporting the same figures.
SGLANG_DP2 = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 4.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="1"} 1.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
sglang:num_queue_reqs{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.5
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.125
"""  # noqa: E501


def test_sglang_pages_parse_per_data_parallel_rank_without_counting_tp_ranks_twice() -> None:
    engines = parse_engine_loads(SGLANG_DP2)
    assert {e: (x.running, x.waiting, x.kv_usage) for e, x in engines.items()} == {
        "0": (4, 2, 0.5),
        "1": (1, 0, 0.125),
    }
    single = SGLANG_DP2.replace('dp_rank="1",', 'dp_rank="0",').replace('dp_rank="0",', "")
    assert list(parse_engine_loads(single)) == ["0"]


@pytest.mark.parametrize(
    ("page", "needle"),
    [
        ("<html>not metrics</html>", "Prometheus"),
        ("# TYPE node_load1 gauge\nnode_load1 0.5\n", "vllm:num_requests_running"),
        (with_values(DP1_IDLE, "vllm:num_requests_waiting", "0", -1), "impossible"),
    ],
)
def test_pages_without_a_vllm_load_are_refused(page: str, needle: str) -> None:
    with pytest.raises(MetricsError, match=needle):
        parse_engine_loads(page)


IMPOSSIBLE = ["1e30", "+Inf", "NaN", "-5", str(MAX_REQUESTS + 1)]


@pytest.mark.parametrize("metric", ["vllm:num_requests_running", "vllm:num_requests_waiting"])
@pytest.mark.parametrize("value", IMPOSSIBLE)
def test_request_counts_that_no_pod_has_are_refused(metric: str, value: str) -> None:
    """Issue 26: ``+Inf`` escaped the parser as int(inf)'s OverflowError, 1e30 reached
    the route loop as an int past 64 bits."""
    with pytest.raises(MetricsError, match="impossible"):
        parse_engine_loads(with_values(DP1_IDLE, metric, "0", value))


@pytest.mark.parametrize("value", ["1.5", "+Inf", "NaN", "-0.1"])
def test_kv_usage_that_is_no_fraction_is_refused(value: str) -> None:
    with pytest.raises(MetricsError, match="impossible"):
        parse_engine_loads(with_values(DP1_IDLE, "vllm:kv_cache_usage_perc", "0", value))


def test_request_counts_are_bounded_over_the_page_too() -> None:
    half = MAX_REQUESTS // 2 + 1  # each engine's figure possible, the pod's sum not
    page = with_values(DP2, "vllm:num_requests_waiting", "0", half)
    with pytest.raises(MetricsError, match="sums to more than"):
        parse_engine_loads(with_values(page, "vllm:num_requests_waiting", "1", half))


@pytest.mark.parametrize("value", IMPOSSIBLE)
def test_a_bad_page_is_its_pods_scrape_error_alone(servers, value: str) -> None:
    """One round over three pods, one serving an impossible figure: the others are
    scraped, the bad one counted (bad_metrics) and its earlier good load dropped."""
    busy, idle = servers
    bad = MetricsServer(DP1_IDLE)
    view = LoadView(interval_s=1.0, timeout_s=2.0)
    view.set_pods([busy.pod, bad.pod, idle.pod])
    try:
        view.scrape_once()
        assert isinstance(view.snapshot([bad.pod])[bad.pod], PodLoad)
        bad.page = with_values(DP1_IDLE, "vllm:num_requests_running", "0", value)
        view.scrape_once()
        loads = view.snapshot([busy.pod, bad.pod, idle.pod])
    finally:
        view.stop()
        bad.close()
    assert isinstance(loads[busy.pod], PodLoad) and isinstance(loads[idle.pod], PodLoad)
    assert loads[bad.pod].reason == "not_scraped" and "impossible" in loads[bad.pod].last_error
    assert view.scrape_errors() == {bad.pod: {"bad_metrics": 1}}


def test_scrape_reports_each_pods_load_and_in_flight(servers) -> None:
    busy, idle = servers
    view = LoadView(interval_s=1.0, timeout_s=2.0)
    view.set_pods([busy.pod, idle.pod])
    ledger = InFlightLedger()  # the routing state's, beside the view
    ledger.begin(idle.pod, "r1", prompt_blocks=12, ttl_s=60)
    try:
        view.scrape_once()
        loads = view.snapshot([busy.pod, idle.pod])
    finally:
        view.stop()
    b, i = loads[busy.pod], loads[idle.pod]
    assert isinstance(b, PodLoad) and isinstance(i, PodLoad)
    assert (b.running, b.waiting) == (8, 2)
    assert b.kv_usage == pytest.approx(0.5) and b.kv_usage_max == 0.75
    assert sorted(b.engines) == ["0", "1"]
    assert (i.running, i.waiting, i.kv_usage) == (0, 0, 0.0)
    assert ledger.all() == {idle.pod: InFlight(1, 12, 1)}
    assert (b.started, i.started) == (1796122018.96, 1796122209.32)


def test_a_pod_whose_last_good_scrape_is_old_is_unknown_not_idle(servers) -> None:
    busy, _ = servers
    clock = FakeClock()
    view = LoadView(interval_s=1.0, timeout_s=2.0, stale_after_s=3.0, clock=clock)
    view.set_pods([busy.pod])
    try:
        view.scrape_once()
        assert isinstance(view.snapshot([busy.pod])[busy.pod], PodLoad)
        busy.status = 503
        view.scrape_once()
        clock.now += 2.0  # a failed round: the last good figures are still fresh enough
        still = view.snapshot([busy.pod])[busy.pod]
        assert isinstance(still, PodLoad) and view.age(still) == 2.0
        clock.now += 1.5
        view.scrape_once()
        stale = view.snapshot([busy.pod])[busy.pod]
    finally:
        view.stop()
    assert isinstance(stale, Unknown) and stale.reason == "stale" and stale.age_s == 3.5
    assert "HTTP 503" in (stale.last_error or "")
    assert view.scrape_errors()[busy.pod] == {"http_status": 2}


def test_unreachable_slow_and_garbage_pods_are_unknown_and_counted(servers) -> None:
    slow, garbage = servers
    slow.delay_s = 4.0
    garbage.page = "this is not a metrics page {"
    closed = MetricsServer(DP1_IDLE)
    closed.close()  # nothing listens on its port any more
    view = LoadView(interval_s=1.0, timeout_s=1.5)
    pods = [slow.pod, garbage.pod, closed.pod, "127.0.0.1:9"]
    view.set_pods(pods)
    try:
        view.scrape_once()
        loads = view.snapshot([*pods, "127.0.0.1:1"])
    finally:
        view.stop()
    assert all(isinstance(load, Unknown) for load in loads.values())
    assert loads["127.0.0.1:1"].reason == "not_scraped" and loads["127.0.0.1:1"].last_error is None
    errors = view.scrape_errors()
    assert errors[slow.pod] == {"timeout": 1}
    assert errors[garbage.pod] == {"bad_metrics": 1}
    assert errors[closed.pod] == {"connect": 1} and errors["127.0.0.1:9"] == {"connect": 1}


def test_background_scraping_follows_the_pods_and_forgets_removed_ones(servers) -> None:
    busy, idle = servers
    # staleness far off: on a loaded machine a round can take longer than a few intervals
    view = LoadView(interval_s=0.05, timeout_s=1.0, stale_after_s=60.0)
    view.set_pods([busy.pod])
    view.start()
    try:
        assert wait_until(lambda: isinstance(view.snapshot([busy.pod])[busy.pod], PodLoad), 5.0)
        busy.page = with_values(DP2, "vllm:num_requests_waiting", "1", 40)
        assert wait_until(
            lambda: getattr(view.snapshot([busy.pod])[busy.pod], "waiting", 0) == 42, 5.0
        )
        view.set_pods([idle.pod])
        assert wait_until(lambda: isinstance(view.snapshot([idle.pod])[idle.pod], PodLoad), 5.0)
        assert wait_until(lambda: isinstance(view.snapshot([busy.pod])[busy.pod], Unknown), 5.0)
    finally:
        view.stop()
    assert view.snapshot([busy.pod])[busy.pod].reason == "not_scraped"


def test_the_pods_process_start_time_is_read_from_its_page() -> None:
    """vLLM 0.33 serves prometheus_client's default registry, process collector included
    (the captured pages); a page without it, or with nonsense, gives None."""
    assert parse_start_time(DP1_IDLE) == 1796122209.32
    assert parse_start_time(DP2) == 1796122018.96
    assert parse_start_time("process_start_time_seconds 12.5\n") == 12.5
    bare = with_values(DP1_IDLE, "vllm:num_requests_running", "0", 1)
    bare = "\n".join(line for line in bare.splitlines() if "process_start" not in line)
    assert parse_start_time(bare) is None
    assert parse_start_time("process_start_time_seconds NaN\n") is None
    assert parse_start_time("process_start_time_seconds_total 3\n") is None


def test_ledger_counts_until_done_or_ttl() -> None:
    clock = FakeClock()
    ledger = InFlightLedger(clock)
    ledger.begin("a", "r1", 10, ttl_s=2.0)
    ledger.begin("a", "r2", 5, ttl_s=2.0)
    ledger.begin("b", "r3", 7, ttl_s=30.0)
    assert ledger.of("a") == InFlight(2, 15, 2) and ledger.of("b") == InFlight(1, 7, 1)
    assert ledger.done("r1") == "a" and ledger.done("r1") is None
    assert ledger.of("a") == InFlight(1, 5, 1)
    clock.now += 2.0
    assert ledger.of("a") == InFlight() and ledger.expired_total == 1
    assert ledger.done("r2") is None  # expired: the gateway's late done is harmless
    assert ledger.all() == {"b": InFlight(1, 7, 1)} and len(ledger) == 1


def test_ledger_releases_a_routes_prefill_at_its_first_token() -> None:
    """Predicted prefill tokens count as queued until the first token; the request
    itself counts until done. A second report, or one after done, changes nothing."""
    clock = FakeClock()
    ledger = InFlightLedger(clock)
    ledger.begin("a", "r1", 10, ttl_s=5.0, prefill_tokens=4000)
    ledger.begin("a", "r2", 3, ttl_s=5.0, prefill_tokens=50)
    assert ledger.of("a") == InFlight(2, 13, 2, 4050)
    assert ledger.first_token("r1") == "a" and ledger.first_token("r1") == "a"
    assert ledger.of("a") == InFlight(2, 13, 1, 50)
    assert ledger.done("r1") == "a"
    assert ledger.of("a") == InFlight(1, 3, 1, 50)
    assert ledger.done("r2") == "a" and ledger.first_token("r2") is None
    ledger.begin("a", "r3", 3, ttl_s=1.0, prefill_tokens=70)
    clock.now += 1.0  # expiry releases the prefill share too
    assert ledger.of("a") == InFlight() and ledger.first_token("r3") is None


def test_ledger_moves_a_retried_route_and_ignores_its_old_expiry() -> None:
    clock = FakeClock()
    ledger = InFlightLedger(clock)
    ledger.begin("a", "r1", 4, ttl_s=1.0)
    clock.now += 0.5
    ledger.begin("b", "r1", 4, ttl_s=1.0)  # retried on another pod
    assert ledger.all() == {"b": InFlight(1, 4, 1)}
    clock.now += 0.6  # the first begin's deadline passed; the route lives on
    assert ledger.all() == {"b": InFlight(1, 4, 1)} and ledger.expired_total == 0
    clock.now += 0.5
    assert ledger.all() == {} and ledger.expired_total == 1


def test_ledger_refuses_nonsense() -> None:
    ledger = InFlightLedger()
    with pytest.raises(ValueError):
        ledger.begin("a", "r", 1, ttl_s=0)
    with pytest.raises(ValueError):
        ledger.begin("a", "r", -1, ttl_s=1)
    with pytest.raises(ValueError):
        ledger.begin("a", "r", 1, ttl_s=1, prefill_tokens=-1)


def test_ledger_stays_consistent_under_concurrent_use() -> None:
    ledger = InFlightLedger()
    pods = [f"pod{i}" for i in range(4)]

    def work(worker: int) -> None:
        for i in range(2000):
            route = f"{worker}-{i}"
            ledger.begin(pods[i % 4], route, 3, ttl_s=60)
            if i % 2 == 0:
                assert ledger.done(route) == pods[i % 4]

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(not t.is_alive() for t in threads)
    counts = ledger.all()
    assert sum(c.requests for c in counts.values()) == 8 * 1000 == len(ledger)
    # odd i are left open: i % 4 == 1 on pod1, i % 4 == 3 on pod3, 500 each per worker
    assert counts == {"pod1": InFlight(4000, 12000, 4000), "pod3": InFlight(4000, 12000, 4000)}

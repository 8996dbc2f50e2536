"""What ``/route`` exports on ``/metrics``: decisions by reason, the speculative entries'
lifecycle, each pod's scrape errors, load source and staleness, pushed loads (SGLang's
load topic), in-flight routes, and each stream's event lag. Read at scrape time from the
objects that hold the numbers (the routing state, the load view, the speculative index,
the lag tracker), which hold no registry themselves."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvindex.scoring.load import LoadView
    from kvindex.scoring.route.event_lag import EventLag
    from kvindex.scoring.route.inflight import InFlightLedger
    from kvindex.scoring.route.outlier import OutlierDetector
    from kvindex.scoring.route.routing import Routing
    from kvindex.scoring.route.speculative import SpeculativeIndex


class RouteCollector(Collector):
    """What /route decided: decisions by reason, P/D outcomes and saturated decisions,
    read at scrape time from :class:`~kvindex.scoring.route.routing.Routing`'s counts."""

    def __init__(self, routing: Routing) -> None:
        self._routing = routing

    def collect(self) -> Iterator[CounterMetricFamily]:
        routing = self._routing
        decisions = CounterMetricFamily(
            "kvindex_route_decisions",
            "Routing decisions by reason: prefix, load, "
            "fallback_backend_down, fallback_unknown_model, fallback_tokenizer_unavailable, "
            "fallback_multimodal, fallback_untokenizable, "
            "session (a prompt that could not be scored, sent to its session's pod), "
            "least_bad (no pod admissible, the cheapest chosen), no_capacity (answered 429).",
            labels=["reason"],
        )
        for reason, count in routing.decision_counts().items():
            decisions.add_metric([str(reason)], count)
        yield decisions
        prefill = CounterMetricFamily(
            "kvindex_route_prefill_decisions",
            "P/D routes by outcome: remote (a prefill pod chosen) or local (the uncached "
            "part is under --pd-threshold, or the prefill pod is the decode pod).",
            labels=["outcome"],
        )
        for outcome, count in routing.prefill_counts().items():
            prefill.add_metric([outcome], count)
        yield prefill
        saturated = CounterMetricFamily(
            "kvindex_route_saturated",
            "Routing decisions taken while no candidate with known load had KV-cache room "
            "(usage at most --max-kv-usage): every candidate was admitted and the cost chose.",
        )
        saturated.add_metric([], routing.saturated_count())
        yield saturated


class LoadCollector(Collector):
    """The load view's scrape failures, pushes, sources and staleness, the in-flight
    ledger per pod and the ejections, read at scrape time."""

    def __init__(self, view: LoadView, ledger: InFlightLedger, outliers: OutlierDetector) -> None:
        self._view = view
        self._ledger = ledger
        self._outliers = outliers

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        from kvindex.scoring.load import PodLoad, Unknown

        errors = CounterMetricFamily(
            "kvindex_load_scrape_errors",
            "Failed scrapes of a pod's vLLM /metrics, by kind (connect, timeout, "
            "http_status, too_large, bad_metrics).",
            labels=["pod", "kind"],
        )
        for pod, kinds in sorted(self._view.scrape_errors().items()):
            for kind, count in sorted(kinds.items()):
                errors.add_metric([pod, kind], count)
        yield errors
        known = GaugeMetricFamily(
            "kvindex_load_known",
            "1 when the pod's load comes from a fresh scrape or push, 0 when it is unknown "
            "(never scraped, or stale) and /route costs it as busy.",
            labels=["pod"],
        )
        source = GaugeMetricFamily(
            "kvindex_load_source",
            "1 for where /route reads the pod's load now: scrape (its /metrics) or push "
            "(SGLang's load topic, used while fresh); absent while the load is unknown.",
            labels=["pod", "source"],
        )
        age = GaugeMetricFamily(
            "kvindex_load_age_seconds",
            "Seconds since the figures /route reads for the pod were taken (its last good "
            "scrape, or its oldest rank's last push; absent before the first one); past "
            "--load-stale-after (3 load intervals) the pod's load is unknown.",
            labels=["pod"],
        )
        for pod, load in sorted(self._view.snapshot(self._view.pods).items()):
            known.add_metric([pod], 0.0 if isinstance(load, Unknown) else 1.0)
            if isinstance(load, PodLoad):
                source.add_metric([pod, load.source], 1.0)
            seconds = self._view.age(load) if isinstance(load, PodLoad) else load.age_s
            if seconds is not None:
                age.add_metric([pod], seconds)
        yield known
        yield source
        yield age
        pushes = self._view.pushes
        if pushes is not None:
            received = CounterMetricFamily(
                "kvindex_load_pushes",
                "LoadStat messages applied from the pod's load topic (SGLang).",
                labels=["pod"],
            )
            for pod, count in sorted(pushes.received().items()):
                received.add_metric([pod], count)
            yield received
            push_errors = CounterMetricFamily(
                "kvindex_load_push_errors",
                "Load topic messages and /server_info answers kvindex could not use, by "
                "reason (invalid_load, bad_frame, invalid_server_info, "
                "server_info_unreachable).",
                labels=["pod", "reason"],
            )
            for pod, kinds in sorted(pushes.errors().items()):
                for kind, count in sorted(kinds.items()):
                    push_errors.add_metric([pod, kind], count)
            yield push_errors
            ranks = GaugeMetricFamily(
                "kvindex_load_push_ranks",
                "Load sockets (data-parallel ranks) followed per pod, as its /server_info "
                "advertises them; 0: it advertises none (its load is scraped only).",
                labels=["pod"],
            )
            for pod, count in sorted(pushes.advertised().items()):
                ranks.add_metric([pod], count)
            yield ranks
        flying = GaugeMetricFamily(
            "kvindex_route_in_flight",
            "Requests /route sent to the pod (or its data-parallel rank, pod/dpN) that are "
            "not done (nor past --route-ttl).",
            labels=["pod"],
        )
        for pod, count in sorted(self._ledger.all().items()):
            flying.add_metric([pod], count.requests)
        yield flying
        outliers = self._outliers
        ejections = CounterMetricFamily(
            "kvindex_route_ejections",
            "Pods ejected from routing after failures reported for them (connect errors, "
            "timeouts, 5xx; --eject-after), each ejection once.",
        )
        ejections.add_metric([], outliers.ejections)
        yield ejections
        ejected = GaugeMetricFamily(
            "kvindex_route_pods_ejected",
            "Pods ejected now, or waiting for their probe's answer after an ejection.",
        )
        ejected.add_metric([], outliers.ejected_now())
        yield ejected


class SpeculativeCollector(Collector):
    """The speculative entries' lifecycle (:mod:`kvindex.scoring.route.speculative`)."""

    def __init__(self, index: SpeculativeIndex) -> None:
        self._index = index

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        outcomes = CounterMetricFamily(
            "kvindex_route_speculative_entries",
            "Speculative entries (a routed prompt's blocks counted on its pod until its "
            "events arrive) by event: added; and when each ends, confirmed (a later query "
            "found the blocks in the index), superseded (routed there again), expired "
            "(its TTL ran out first), evicted (the size bound).",
            labels=["event"],
        )
        for event, count in self._index.outcomes().items():
            outcomes.add_metric([event], count)
        yield outcomes
        live = GaugeMetricFamily(
            "kvindex_route_speculative_live",
            "Speculative entries and blocks held now.",
            labels=["unit"],
        )
        live.add_metric(["entries"], len(self._index))
        live.add_metric(["blocks"], self._index.blocks())
        yield live


class EventLagCollector(Collector):
    """Each stream's recent event lag (:mod:`kvindex.scoring.route.event_lag`)."""

    def __init__(self, lag: EventLag) -> None:
        self._lag = lag

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(
            "kvindex_event_lag_last_seconds",
            "The event lag of the stream's last applied batch (streams quiet for 10 s are "
            "left out); /route treats a pod above --max-event-lag as stale.",
            labels=["pod"],
        )
        for member, seconds in sorted(self._lag.current().items()):
            gauge.add_metric([member], seconds)
        yield gauge

"""The gateway's own metrics: what happened to each request, how often a pod had to be
replaced, what failed upstream, and how long the gateway itself held a request.

``kvindex serve --gateway`` registers them in the service's registry (one ``/metrics``
for both); ``kvindex gateway`` alone serves its own ``/metrics``.
"""

from __future__ import annotations

from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Histogram

# The gateway's budget is 1 ms; its buckets resolve around that.
_ADDED_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0)


class Outcome(StrEnum):
    """How a gateway request ended (``kvindex_gateway_requests_total{outcome}``)."""

    OK = "ok"  # the pod answered 2xx and it was relayed
    POD_ERROR = "pod_error"  # the pod answered an error status (retold in OpenAI's shape)
    INVALID_REQUEST = "invalid_request"  # the body is not an OpenAI request (400)
    NO_CAPACITY = "no_capacity"  # /route: no pod admissible (429)
    ROUTE_REFUSED = "route_refused"  # /route refused otherwise, or the index is down
    UNREACHABLE = "unreachable"  # every pod tried failed before answering (502)
    POD_FAILED = "pod_failed"  # the pod's answer broke off (502, or mid-relay)
    CLIENT_LEFT = "client_left"  # the client disconnected mid-answer


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvindex_gateway_requests",
            "Gateway requests (/v1/completions, /v1/chat/completions) by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.route_decisions = Counter(
            "kvindex_gateway_route_decisions",
            "Gateway requests sent to a pod, by the reason of the decision that chose it "
            "(the x-kvindex-route-reason header): prefix, load, least_bad, or a fallback "
            "such as fallback_tokenizer_unavailable (routed by load alone). One per request, "
            "the last decision if connecting failed; kvindex_route_decisions counts every "
            "decision, /route's callers' included.",
            ["reason"],
            registry=registry,
        )
        self.retries = Counter(
            "kvindex_gateway_retries",
            "Requests sent to another pod because connecting to the chosen one failed "
            "before any answer (one per retry).",
            registry=registry,
        )
        self.upstream_errors = Counter(
            "kvindex_gateway_upstream_errors",
            "Pod failures seen by the gateway: connect (no answer; retried elsewhere), "
            "broken (the answer broke off), prefill (a P/D prefill leg failed).",
            ["kind"],
            registry=registry,
        )
        self.prefill = Counter(
            "kvindex_gateway_prefill",
            "P/D requests by how the prompt was prefilled: remote (on the prefill pod, KV "
            "pulled by the decode pod), sidecar (the decode pod's routing sidecar was told "
            "the prefill pod), failed (the decode pod prefilled it itself).",
            ["outcome"],
            registry=registry,
        )
        self.added_seconds = Histogram(
            "kvindex_gateway_added_seconds",
            "The gateway's own time per request: before the request is written to its "
            "pod (reading, tokenizing, routing, connecting; a P/D prefill leg, pod time, "
            "excluded), plus from the pod's last byte to the client's last byte. The pod's "
            "time in between (its generation) is excluded.",
            buckets=_ADDED_BUCKETS,
            registry=registry,
        )
        self.route_seconds = Histogram(
            "kvindex_gateway_route_seconds",
            "Time the gateway waited for /route's decision, part of "
            "kvindex_gateway_added_seconds (in-process: the decision itself; kvindex "
            "gateway --index: the round trip to the index).",
            buckets=_ADDED_BUCKETS,
            registry=registry,
        )
        # Bound once: the hot path pays one add per request, no label lookup.
        self._by_outcome = {o: self.requests.labels(o.value) for o in Outcome}
        self._by_reason: dict[str, Counter] = {}
        self._errors = {k: self.upstream_errors.labels(k) for k in ("connect", "broken", "prefill")}
        for outcome in ("remote", "sidecar", "failed"):  # exported at 0 from the start
            self.prefill.labels(outcome)

    def ended(self, outcome: Outcome) -> None:
        self._by_outcome[outcome].inc()

    def routed(self, reason: str) -> None:
        child = self._by_reason.get(reason)
        if child is None:  # labels() takes a lock and builds a key: once per reason
            child = self._by_reason[reason] = self.route_decisions.labels(reason)
        child.inc()

    def upstream_error(self, kind: str, count: int = 1) -> None:
        if count:
            self._errors[kind].inc(count)

"""The OpenAPI entry of ``POST /route`` (api/http/hot_openapi.py) describes the cost model, and
its example is one /route could answer: it decodes into the request and answer types,
and every candidate's cost terms are what the cost model gives for its inputs."""

from __future__ import annotations

import msgspec
from fastapi.testclient import TestClient

from kvindex.api.http.app import create_app
from kvindex.api.http.hot_openapi import ROUTE_REQUEST_EXAMPLE, ROUTE_RESPONSE_EXAMPLE
from kvindex.api.http.schemas import RouteRequest, RouteResponse
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from kvindex.scoring.route.cost import CostWeights, PodInputs, pod_costs


def test_the_route_operation_has_the_cost_model_and_an_example() -> None:
    service = Service(from_flags(model="m"))
    try:
        with TestClient(create_app(service, manage_lifecycle=False)) as client:
            route = client.get("/openapi.json").json()["paths"]["/route"]["post"]
    finally:
        service.stop()
    assert "cost = 2 * u/P + 1 * Q/P + 1 * R * u/P + 1 * kv_usage" in route["description"]
    assert "route_weights" in route["description"]
    body = route["requestBody"]["content"]["application/json"]
    assert body["example"] == ROUTE_REQUEST_EXAMPLE
    answer = route["responses"]["200"]["content"]["application/json"]
    assert answer["example"] == ROUTE_RESPONSE_EXAMPLE


def test_the_route_example_is_an_answer_the_cost_model_gives() -> None:
    msgspec.convert(ROUTE_REQUEST_EXAMPLE, RouteRequest)
    answer = msgspec.convert(ROUTE_RESPONSE_EXAMPLE, RouteResponse)
    assert answer.prompt_blocks == len(ROUTE_REQUEST_EXAMPLE["block_hashes"])
    inputs = [  # GPU blocks: the tier-weighted count is the count; nothing is waiting, so
        # how many in-flight routes are still prefilling does not enter the cost
        PodInputs(
            c.pod,
            c.matched_blocks,
            c.matched_blocks,
            c.running,
            c.waiting,
            c.kv_usage,
            c.in_flight,
            0,
            c.queued_tokens,
        )
        for c in answer.candidates
    ]
    assert all(c.waiting == 0 for c in answer.candidates)
    terms = pod_costs(inputs, answer.prompt_tokens, answer.block_size, CostWeights())
    for row, cost in zip(answer.candidates, terms, strict=True):
        assert row.usable_blocks == cost.usable_blocks
        assert row.uncached_blocks == cost.uncached_blocks
        got = (row.prefix_cost, row.queue_cost, row.decode_cost, row.kv_cost)
        assert got == (cost.prefix, cost.queue, cost.decode, cost.kv)
        assert row.cost == cost.total
    assert answer.pod == min(answer.candidates, key=lambda c: c.cost).pod

"""The OpenAPI path items of ``/score``, ``/route`` and ``/route/{route_id}/done``, which
are not FastAPI routes (``api/hot_path.py``): generated from the same msgspec types as
the bodies are decoded with, and added to FastAPI's document by ``api/app.py``."""

from __future__ import annotations

from typing import Any

from kvindex.api.errors import JSON, error_responses
from kvindex.api.schemas import (
    ErrorBody,
    RouteDone,
    RouteRequest,
    RouteResponse,
    ScoreRequest,
    ScoreResponse,
    ok_response,
    openapi_schema,
)
from kvindex.api.score_inputs import binary_parameters, request_body

ROUTE_DESCRIPTION = """\
The pod with the lowest **cost** wins (`scoring/route_cost.py`):

`cost = 2 * uncached_fraction + 1 * q/4 + 1 * kv_usage`

* `uncached_fraction`: the prompt's blocks the pod must prefill, over the prompt's blocks.
  A hit covers at most `prompt_tokens - 1` tokens (vLLM always computes the last one);
  CPU or storage blocks count by their tier weight; `speculative_blocks` (recent routes
  to the pod its events have not confirmed yet) count as cached GPU blocks.
* `q`: the pod's scraped waiting queue plus the requests kvindex routed there that are
  not done (`POST /route/{route_id}/done`, or `--route-ttl`).
* `kv_usage`: the pod's KV-cache usage, mean over its engines.

The weights 2 : 1 : 1 are llm-d's default scorer weights: a prefix hit wins at equal
load; a busy prefix pod loses to an idle cold one once its queue and cache cost more than
the prefill it saves. The queue term is linear (4 requests cost the queue weight, so a
pod 8 requests busier costs as much as a full prefix miss). Set them with
`scoring: {route_weights: {prefix, queue, kv, queue_unit}}` in the config file. A pod
whose load is unknown (`load` stale or not_scraped) is costed busy: a full cache and four
more requests waiting. Equal costs are broken at random.

A pod over `--max-kv-usage` or `--max-waiting` is not admitted (`refused` says why); no
admissible pod is a 429 `no_capacity` with `Retry-After`. When the index cannot be used
for the request (a stale stream, the backend down, an unknown model, no tokenizer) the
decision is load-only and `reason` says which `fallback_*`.
"""

# The example below is checked against the cost model by tests/test_hot_openapi.py.
ROUTE_REQUEST_EXAMPLE = {
    "model": "Qwen/Qwen3-8B",
    "block_hashes": [1403909460543360175, 1643945449041937783, 3120512389542102961],
    "request_id": "req-42",
    "max_tokens": 256,
}


def _candidate(
    pod: str, matched: int, waiting: int, kv_usage: float, in_flight: int, terms: tuple
) -> dict[str, Any]:
    """One candidate row of the example; ``terms`` are its cost terms as /route answers
    them (usable, uncached, prefix, queue, kv, cost)."""
    usable, uncached, prefix, queue, kv, cost = terms
    return {
        "pod": pod, "rank": 0, "role": "both", "matched_blocks": matched,
        "speculative_blocks": 0, "usable_blocks": usable, "uncached_blocks": uncached,
        "load": "known", "running": 2, "waiting": waiting, "kv_usage": kv_usage,
        "in_flight": in_flight, "prefix_cost": prefix, "queue_cost": queue, "kv_cost": kv,
        "cost": cost, "admitted": True, "refused": None,
    }  # fmt: skip


ROUTE_RESPONSE_EXAMPLE = {
    "route_id": "req-42",
    "pod": "127.0.0.2:8000",
    "reason": "prefix",
    "model": "Qwen/Qwen3-8B",
    "block_size": 16,
    "prompt_tokens": 48,
    "prompt_blocks": 3,
    "candidates": [
        _candidate("127.0.0.2:8000", 2, 1, 0.25, 1, (2, 1.0, 2 / 3, 0.5, 0.25, 2 / 3 + 0.75)),
        _candidate("127.0.0.3:8000", 0, 0, 0.1, 0, (0, 3.0, 2.0, 0.0, 0.1, 2.1)),
    ],
    "warnings": [],
    "rank": 0,
    "prefill_pod": None,
    "prefill_rank": None,
    "prefill_reason": None,
    "decode_pod": None,
}


def openapi_paths() -> tuple[dict[str, Any], dict[str, Any]]:
    """The OpenAPI path items of the three hot paths, and the schema components they
    refer to; FastAPI's document adds them to its own."""
    (score_in, score_out, route_in, route_out, done, error), components = openapi_schema(
        ScoreRequest, ScoreResponse, RouteRequest, RouteResponse, RouteDone, ErrorBody
    )

    def described(text: str) -> dict[str, Any]:
        return {"description": text, "content": {JSON: {"schema": error}}}

    everywhere = 429  # --max-in-flight applies to every route but the probes
    score = {
        "summary": "Score a prompt: each pod's longest cached prefix, best first",
        "description": "A 404 `unknown_model` right after a deploy means no pod has "
        "published events for the model yet: fall back to default balancing, as for a 503.",
        "operationId": "score_score_post",
        "requestBody": request_body(score_in),
        "parameters": binary_parameters(ScoreRequest),
        "responses": {
            "200": ok_response("Scores", score_out),
            **error_responses(error, 400, 404, 408, 413, 415, 503, everywhere),
        },
    }
    route_body = request_body(route_in)
    route_body["content"][JSON]["example"] = ROUTE_REQUEST_EXAMPLE
    decision = ok_response("Decision", route_out)
    decision["content"][JSON]["example"] = ROUTE_RESPONSE_EXAMPLE
    route = {
        "summary": "Choose the pod that should serve a prompt now: cached prefix against load",
        "description": ROUTE_DESCRIPTION,
        "operationId": "route_route_post",
        "requestBody": route_body,
        "parameters": binary_parameters(RouteRequest),
        "responses": {
            "200": decision,
            **error_responses(error, 400, 408, 413, 415),
            "429": described(
                "no_capacity: no pod admissible (KV cache or queue over the limit), see "
                "Retry-After; or too many requests in flight (--max-in-flight)"
            ),
            "503": described("no_pods: no pods given and none known"),
        },
    }
    route_id = "The route_id /route answered"
    route_done = {
        "summary": "The routed request finished: stop counting it against its pod",
        "operationId": "route_done_route__route_id__done_post",
        "parameters": [
            {
                "name": "route_id",
                "in": "path",
                "required": True,
                "schema": {"type": "string", "description": route_id, "title": "Route Id"},
                "description": route_id,
            }
        ],
        "responses": {
            "200": ok_response("Released", done),
            "404": described("Unknown route id (never routed, already done, or expired)"),
        },
    }
    paths = {
        "/score": {"post": score},
        "/route": {"post": route},
        "/route/{route_id}/done": {"post": route_done},
    }
    return paths, components

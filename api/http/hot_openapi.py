"""The OpenAPI path items of ``/score``, ``/route``, ``/route/{route_id}/first-token`` and
``/route/{route_id}/done``, which are not FastAPI routes (``api/http/hot_path.py``): generated
from the same msgspec types as the bodies are decoded with, and added to FastAPI's
document by ``api/http/app.py``."""

from __future__ import annotations

from typing import Any

from kvindex.api.http.errors import JSON, error_responses
from kvindex.api.http.schemas import (
    ErrorBody,
    RouteDone,
    RouteOutcome,
    RouteRequest,
    RouteResponse,
    ScoreRequest,
    ScoreResponse,
    ok_response,
    openapi_schema,
)
from kvindex.api.http.score_inputs import binary_parameters, request_body

ROUTE_DESCRIPTION = """\
The candidates are the pods kvindex knows (configured, discovered or publishing KV
events); with `pods` given, those of them it knows: a named pod it does not know is left
out with a `warnings` line and never contacted.

The pod with the lowest **cost** wins (`scoring/route/cost.py`): the latency the request
adds there, its own and what it inflicts, in units of this prompt's full prefill:

`cost = 2 * u/P + 1 * Q/P + 1 * R * u/P + 1 * kv_usage`

* `P`: the prompt's tokens; `u`: those the pod must compute past its cached prefix. A hit
  covers at most `P - 1` tokens (vLLM always computes the last one); CPU or storage
  blocks count by their tier weight; `speculative_blocks` (recent routes to the pod its
  events have not confirmed yet) count as cached GPU blocks. Weight 2: the request's
  own time, and as much again of the pod's capacity, which later requests wait for.
  (`prefix_cost`)
* `Q`: prefill tokens queued on the pod ahead of it: the uncached tokens of the requests
  kvindex routed there whose first token was not reported yet (`queued_tokens`;
  `POST /route/{route_id}/first-token`, else until done), plus one prompt of this size
  per scraped waiting request kvindex did not route. (`queue_cost`)
* `R`: requests on the pod (scraped running + waiting, or `in_flight` if more), plus
  the sessions between turns whose last request finished there (`sessions`: found by
  the next request's prompt extending the last one's; times the share of sessions seen
  to come back): each decode step waits while a prefill shares the engine's steps, so
  `R * u` is the stall the request causes. It keeps a long shared prefix (an agent's
  tool preamble) from drawing every new session onto one busy pod, while a session's
  next turn, whose `u` is small, stays with its cache. (`decode_cost`)
* `kv_usage`: the pod's KV-cache usage, mean over its engines: a full cache costs one
  prefill of the prompt. (`kv_cost`)

Set the weights with `scoring: {route_weights: {prefix, queue, decode, kv}}` in the
config file (e.g. a lower `decode` when TTFT matters more than inter-token latency). A
pod whose load is unknown (`load` stale or not_scraped) is costed busy: a full cache,
one request running and one prompt queued beyond its in-flight routes. A pod whose
`process_start_time_seconds` is newer than its last KV events restarted unheard: its
index entries are ignored (`warnings`). Equal costs are broken at random.

A pod whose index entries are in doubt says why in its row's `doubt`, and only its own
prefix credit changes: none for `hash_mismatch` and `gapped` (its entries may claim
blocks its engine does not hold), its matched blocks for the others (`lagging`,
`incomplete`, `restored`, `unheard`, ...: what it is known to hold is real). Its load
counts, and the other pods' prefixes decide as usual.

A pod over `--max-kv-usage` or `--max-waiting` is not admitted (`refused` says why); no
admissible pod is a 429 `no_capacity` with `Retry-After`. When the index cannot be used
for the request (the backend down, an unknown model, no tokenizer) the
decision is load-only (`u = P` on every pod) and `reason` says which `fallback_*`.
"""

# The example below is checked against the cost model by tests/test_hot_openapi.py.
ROUTE_REQUEST_EXAMPLE = {
    "model": "Qwen/Qwen3-8B",
    "block_hashes": [1403909460543360175, 1643945449041937783, 3120512389542102961],
    "request_id": "req-42",
    "max_tokens": 256,
}
_P = 48  # the example prompt's tokens: 3 blocks of 16


def _candidate(
    pod: str,
    matched: int,
    running: int,
    kv_usage: float,
    in_flight: int,
    queued: int,
    doubt: str | None = None,
) -> dict[str, Any]:
    """One candidate row of the example (no requests waiting), its cost terms computed as
    ``pod_costs`` computes them: the same float operations in the same order."""
    usable = min(matched, (_P - 1) // 16)
    own = _P - usable * 16  # u
    per_token = 1.0 / _P
    prefix, queue = 2.0 * per_token * own, per_token * queued
    decode, kv = per_token * max(running, in_flight) * own, kv_usage
    return {
        "pod": pod, "rank": 0, "role": "both", "matched_blocks": matched,
        "speculative_blocks": 0, "usable_blocks": usable, "uncached_blocks": 3.0 - usable,
        "load": "known", "running": running, "waiting": 0, "kv_usage": kv_usage,
        "in_flight": in_flight, "sessions": 0.0, "queued_tokens": queued, "prefix_cost": prefix,
        "queue_cost": queue, "decode_cost": decode, "kv_cost": kv,
        "cost": prefix + queue + decode + kv, "admitted": True, "refused": None,
        "stream_state": doubt, "doubt": doubt,
    }  # fmt: skip


ROUTE_RESPONSE_EXAMPLE = {
    "route_id": "req-42",
    "pod": "127.0.0.2:8000",
    "reason": "prefix",
    "model": "Qwen/Qwen3-8B",
    "block_size": 16,
    "prompt_tokens": _P,
    "prompt_blocks": 3,
    "candidates": [
        _candidate("127.0.0.2:8000", 2, 1, 0.1, 1, 16),
        _candidate("127.0.0.3:8000", 0, 0, 0.2, 0, 0),
        # Its history before some seq is missing: what it matches still counts.
        _candidate("127.0.0.4:8000", 1, 0, 0.3, 0, 0, doubt="incomplete"),
    ],
    "warnings": ["pod 127.0.0.4:8000: stream 127.0.0.4:8000 incomplete"],
    "rank": 0,
    "prefill_pod": None,
    "prefill_rank": None,
    "prefill_reason": None,
    "decode_pod": None,
    "future_prefill_tokens": 0.0,
}


def openapi_paths() -> tuple[dict[str, Any], dict[str, Any]]:
    """The OpenAPI path items of the three hot paths, and the schema components they
    refer to; FastAPI's document adds them to its own."""
    (score_in, score_out, route_in, route_out, done, outcome, error), components = (
        openapi_schema(
            ScoreRequest, ScoreResponse, RouteRequest, RouteResponse, RouteDone, RouteOutcome,
            ErrorBody,
        )
    )  # fmt: skip

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
                "no_capacity: no pod admissible (every one over --max-waiting), see "
                "Retry-After; or too many requests in flight (--max-in-flight)"
            ),
            "503": described(
                "no_pods: no pods given and none known, or none of the pods named is known"
            ),
        },
    }
    route_id = "The route_id /route answered"
    route_done = {
        "summary": "The routed request finished: stop counting it against its pod",
        "operationId": "route_done_route__route_id__done_post",
        "description": "An optional JSON body reports how the pod answered "
        '(`{"outcome": "http_5xx"}`): failures eject the pod from routing for a while.',
        "requestBody": {"required": False, "content": {JSON: {"schema": outcome}}},
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
    route_first = {
        "summary": "The routed request's first token is out: stop counting its prefill as "
        "queued on its pod",
        "description": "Optional: a gateway that sees the answer begin (a streamed "
        "response's first event) reports it, so the queue term of later decisions counts "
        "only prefills not yet done; without it a request's prefill counts until done.",
        "operationId": "route_first_token_route__route_id__first_token_post",
        "parameters": route_done["parameters"],
        "responses": {
            "200": ok_response("Prefill released", done),
            "404": described("Unknown route id (never routed, already done, or expired)"),
        },
    }
    paths = {
        "/score": {"post": score},
        "/route": {"post": route},
        "/route/{route_id}/first-token": {"post": route_first},
        "/route/{route_id}/done": {"post": route_done},
    }
    return paths, components

"""The gateway's OpenAI paths as OpenAPI path items: added to kvindex's document under
``kvindex serve --gateway``, and served alone by ``kvindex gateway`` at
``/openapi.json``. The bodies are OpenAI's (the pod validates them), so the request and
answer schemas are open objects; the errors are OpenAI's shape, with the statuses the
gateway itself answers."""

from __future__ import annotations

from typing import Any

JSON = "application/json"

#: What the gateway serves under /v1, as its 404s and 405s name it.
SUPPORTED = "POST /v1/completions, POST /v1/chat/completions and GET /v1/models"

OPENAI_ERROR = {
    "type": "object",
    "title": "OpenAIError",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string", "description": "kvindex's error code, e.g. no_pods"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer", "description": "the HTTP status"},
            },
        }
    },
}

_ERRORS = {
    400: "invalid_request: the body is not an OpenAI request the gateway can route "
    "(a pod's own 4xx keeps its status and message)",
    408: "request_timeout: the body did not arrive within --body-timeout",
    413: "too_large: the body is over the size limit (--max-body-bytes)",
    429: "no_capacity: no pod admissible now (every one over --max-waiting), see "
    "Retry-After; or too_many_requests: more requests in flight than --max-in-flight",
    502: "pods_unreachable: no candidate pod accepted the connection; pod_failed: the "
    "pod failed the request",
    503: "no_pods: no pod is known for the model (none configured, discovered or "
    "indexed): start a pod or name it with --pod; retry after a deploy",
}


def _error(text: str) -> dict[str, Any]:
    return {"description": text, "content": {JSON: {"schema": OPENAI_ERROR}}}


def _proxied(summary: str, streamed: bool) -> dict[str, Any]:
    answer: dict[str, Any] = {JSON: {"schema": {"type": "object"}}}
    if streamed:
        answer["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "tags": ["gateway"],
        "summary": summary,
        "description": "The request is routed by /route and forwarded unchanged to the "
        "chosen vLLM pod; its answer is relayed as the pod sent it (streamed when the "
        "request asks). Headers: x-kvindex-pod, x-kvindex-route-reason.",
        "requestBody": {"required": True, "content": {JSON: {"schema": {"type": "object"}}}},
        "responses": {
            "200": {"description": "The pod's answer", "content": answer},
            **{str(status): _error(text) for status, text in _ERRORS.items()},
        },
    }


def gateway_paths() -> dict[str, Any]:
    """The OpenAPI path items of the gateway's /v1 routes."""
    return {
        "/v1/completions": {"post": _proxied("OpenAI completions, routed to a pod", True)},
        "/v1/chat/completions": {
            "post": _proxied("OpenAI chat completions, routed to a pod", True)
        },
        "/v1/models": {
            "get": {
                "tags": ["gateway"],
                "summary": "The models the known pods serve (OpenAI's list)",
                "responses": {
                    "200": {
                        "description": "OpenAI's model list",
                        "content": {JSON: {"schema": {"type": "object"}}},
                    },
                    "503": _error("index_unreachable: the kvindex index does not answer"),
                },
            }
        },
    }


def gateway_document(version: str) -> dict[str, Any]:
    """``kvindex gateway``'s own OpenAPI document."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvindex gateway", "version": version},
        "paths": {
            **gateway_paths(),
            "/health": {
                "get": {
                    "summary": "The gateway and the kvindex it routes with answer",
                    "responses": {
                        "200": {"description": "Healthy"},
                        "503": _error("index_unreachable: the kvindex index does not answer"),
                    },
                }
            },
        },
    }

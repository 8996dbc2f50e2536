"""HTTP bodies, as msgspec types: the decoder is the validator, and the OpenAPI schema at
``/docs`` is generated from the same types, so the contract gateways code against and
the code that enforces it cannot drift apart."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvindex.scoring.scorer import PodScore

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """``POST /score``: exactly one of ``token_ids``, ``prompt``, ``messages``.

    With ``messages``, the chat fields below render the prompt as vLLM's chat completions
    endpoint does with the same fields and defaults (vLLM 0.33): send what the client
    sends vLLM, or the score is for a different prompt."""

    model: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    token_ids: list[TokenId] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    pods: list[str] | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ScoreResponse(msgspec.Struct):
    model: str
    block_size: int
    prompt_tokens: int
    prompt_blocks: int
    pods: list[PodScore]
    warnings: Annotated[
        list[str],
        msgspec.Meta(
            description="One line per pod whose entries are not known to be exact, "
            "naming the pod and the reason (stream gapped, incomplete or restored and "
            "unverified; block hashes not matching). Empty when every candidate is trusted."
        ),
    ] = []


class ErrorBody(msgspec.Struct):
    error: str  # a stable code: invalid_request, unknown_model, tokenizer_unavailable, ...
    detail: str


class PurgeResponse(msgspec.Struct):
    pod: str
    members: list[str]
    entries_removed: int


def openapi_schema(*types: type) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """JSON schemas for ``types`` with their shared components, for FastAPI's OpenAPI."""
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    return list(schemas), components

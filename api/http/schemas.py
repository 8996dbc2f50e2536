"""HTTP bodies, as msgspec types: the decoder is the validator, and the OpenAPI schema at
``/docs`` is generated from the same types, so the contract gateways code against and
the code that enforces it cannot drift apart."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from kvindex.events.wire.sessions import MAX_SESSION_ID_CHARS
from kvindex.scoring.route.outlier import Outcome
from kvindex.scoring.scorer import PodScore

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
# msgspec cannot bound an int past int64, so the range of an int hash is checked in
# api/http/score_inputs.py; the schema still says it.
BlockHash = (
    Annotated[int, msgspec.Meta(extra_json_schema={"minimum": -(2**63), "maximum": 2**64 - 1})]
    | Annotated[
        str,
        msgspec.Meta(
            pattern="^(0[xX])?[0-9a-fA-F]{1,64}$",
            description="Hex: the uint64 itself (up to 16 digits), or a digest of up "
            "to 32 bytes whose last 8 bytes (big-endian) are what vLLM publishes.",
        ),
    ]
)


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class MmFeatureSpec(msgspec.Struct, forbid_unknown_fields=True):
    """One multimodal item of a `token_ids` prompt, as vLLM's `MultiModalFeatureSpec`
    has it: the item's `identifier` and its placeholder range (`mm_position`)."""

    identifier: Annotated[
        str,
        msgspec.Meta(min_length=1, max_length=1024),
        _doc(
            "vLLM's identifier of the item (the hash of its processed media, with the "
            "LoRA prefix where vLLM adds one), as the engine computed it."
        ),
    ]
    offset: Annotated[
        int, msgspec.Meta(ge=0), _doc("First token position of the item's placeholder.")
    ]
    length: Annotated[
        int, msgspec.Meta(ge=1), _doc("Number of placeholder tokens the item covers.")
    ]


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /score`: the model and exactly one of `token_ids`, `prompt`, `messages`,
    `block_hashes`.

    With `messages`, the chat fields below render the prompt as vLLM's chat completions
    endpoint does with the same fields and defaults (vLLM 0.33): send what the client
    sends vLLM, or the score is for a different prompt."""

    model: Annotated[
        str,
        msgspec.Meta(min_length=1, max_length=512),
        _doc("The model name the pods serve (as in their events' topic or --model)."),
    ]
    token_ids: Annotated[
        list[TokenId] | None, _doc("The prompt as token ids (no tokenizer needed; fastest).")
    ] = None
    prompt: Annotated[
        str | None, _doc("The prompt as text; needs the model's tokenizer (--model-config).")
    ] = None
    messages: Annotated[
        list[dict[str, Any]] | None,
        _doc("Chat messages, rendered with the model's chat template, then tokenized."),
    ] = None
    block_hashes: Annotated[
        list[BlockHash] | None,
        _doc(
            "The prompt as the engine's block hashes of its full blocks, block 0 first "
            "(uint64 ints or hex strings, as the engines publish them in BlockStored): "
            "looked up as they are, nothing hashed. For models keyed by engine hashes "
            "(--key-mode engine, the default), and models with SGLang pods (engines: "
            "[sglang], whose published ids may be negative int64s: each names its block "
            "on every pod of the model); lora_name and cache_salt do not apply (the "
            "hashes already include them). prompt_tokens is then blocks x block_size."
        ),
    ] = None
    pods: Annotated[
        list[str] | None,
        _doc("Candidate pods (ip:port); the answer lists exactly these, matched or not."),
    ] = None
    lora_name: Annotated[str | None, _doc("LoRA adapter the request will use.")] = None
    cache_salt: Annotated[str | None, _doc("vLLM cache_salt of the request, if any.")] = None
    mm_features: Annotated[
        list[MmFeatureSpec] | None,
        _doc(
            "token_ids only: the prompt's multimodal items (images, audio, video), each "
            "an identifier and the placeholder tokens it covers; they enter the block "
            "keys as vLLM >= 0.31 hashes them. Ranges lie within the prompt and do not "
            "overlap."
        ),
    ] = None
    add_generation_prompt: Annotated[
        bool, _doc("messages only: as vLLM's chat completions field (default true).")
    ] = True
    continue_final_message: Annotated[
        bool, _doc("messages only: as vLLM's chat completions field (default false).")
    ] = False
    tools: Annotated[
        list[dict[str, Any]] | None, _doc("messages only: tools passed to the chat template.")
    ] = None
    documents: Annotated[
        list[dict[str, Any]] | None,
        _doc("messages only: documents passed to the chat template."),
    ] = None
    chat_template_kwargs: Annotated[
        dict[str, Any] | None, _doc("messages only: extra chat template variables.")
    ] = None


class ScoreResponse(msgspec.Struct):
    """Each pod's longest consecutive cached prefix of the prompt, best first."""

    model: Annotated[str, _doc("The model scored for, as asked.")]
    block_size: Annotated[int, _doc("The model's KV block size in tokens.")]
    prompt_tokens: Annotated[int, _doc("Tokens in the prompt (after rendering and tokenizing).")]
    prompt_blocks: Annotated[int, _doc("Full blocks in the prompt (the most a pod can match).")]
    pods: Annotated[
        list[PodScore],
        _doc("Pods holding a prefix of the prompt, best first; with `pods` given, exactly those."),
    ]
    warnings: Annotated[
        list[str],
        msgspec.Meta(
            description="One line per pod whose entries are not known to be exact, "
            "naming the pod and the reason (stream gapped, incomplete or restored and "
            "unverified; block hashes not matching). Empty when every candidate is trusted."
        ),
    ] = []


#: The largest ``max_tokens`` /route takes. The longest contexts models serve are ~10M
#: tokens; a count past 2^31 is no request's, and would only inflate the blocks its route
#: holds in the ledger. Past it is a 400, not a clamp: the client's number is wrong.
MAX_OUTPUT_TOKENS = 2**31 - 1


class RouteRequest(ScoreRequest, forbid_unknown_fields=True):
    """POST /route: the /score body, plus the request's id and expected output."""

    request_id: (
        Annotated[
            str,
            msgspec.Meta(
                min_length=1,
                max_length=256,
                description="Becomes the route_id (a fresh one when absent); routing the "
                "same id again moves it, as a retry on another pod does.",
            ),
        ]
        | None
    ) = None
    max_tokens: (
        Annotated[
            int,
            msgspec.Meta(
                ge=0,
                le=MAX_OUTPUT_TOKENS,
                description="Expected output tokens, counted in the blocks the route holds.",
            ),
        ]
        | None
    ) = None
    role: Annotated[
        Literal["prefill", "decode"] | None,
        _doc(
            "P/D: choose only among pods of this role (and role both). Absent: when some "
            "candidate has a role, the answer names a decode_pod and a prefill_pod."
        ),
    ] = None
    session_id: Annotated[
        Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SESSION_ID_CHARS)] | None,
        _doc(
            f"The client's session id (1 to {MAX_SESSION_ID_CHARS} characters), as vLLM reads "
            "it: body session_id, header X-Session-ID, vllm_xargs.session_id. Where the "
            "prompt cannot be scored (fallback_multimodal, fallback_untokenizable, "
            "fallback_tokenizer_unavailable), the request goes to the pod that computed the "
            "session's latest turn (reason session) when that pod is a candidate with known "
            "load, not ejected, credited its entries (not gapped or hash_mismatch) and "
            "admitted; it also claims the session's home. It never outweighs a prefix."
        ),
    ] = None


class RouteCandidate(msgspec.Struct, gc=False):
    """One candidate pod: what its index match and its load cost (lower is better)."""

    # gc=False: only scalars, so no cycles; /route builds one per candidate per request,
    # and untracked structs neither cost the collector's bookkeeping nor trigger it.

    pod: Annotated[str, _doc("The pod id (ip:port).")]
    rank: Annotated[int, _doc("The data-parallel rank (engine) of the pod this row costs.")]
    role: Annotated[str, _doc("prefill, decode or both (P/D)")]
    matched_blocks: Annotated[int, _doc("The pod's cached prefix in blocks, as /score says.")]
    speculative_blocks: Annotated[
        int,
        _doc(
            "Blocks past matched_blocks that recent routes sent here and the pod's events "
            "have not confirmed yet (--speculative-ttl); the cost counts them as cached."
        ),
    ]
    usable_blocks: Annotated[
        int, _doc("Of those, what vLLM can reuse (at most prompt_tokens - 1 tokens).")
    ]
    uncached_blocks: Annotated[
        float, _doc("Blocks to prefill, the cached ones weighted by their tier.")
    ]
    load: Annotated[
        str,
        msgspec.Meta(
            description="known, stale or not_scraped (unknown: costed busy), or pending "
            "(to be scraped, first scrape not tried: costed as one waiting request and an "
            "empty cache)"
        ),
    ]
    running: Annotated[
        int | None, _doc("Requests running on the pod (scraped or pushed; null: unknown).")
    ]
    waiting: Annotated[
        int | None, _doc("Requests waiting on the pod (scraped or pushed; null: unknown).")
    ]
    kv_usage: Annotated[
        float | None, _doc("The pod's KV-cache usage 0..1, mean over its engines (null: unknown).")
    ]
    in_flight: Annotated[int, _doc("Requests kvindex routed here that are not done yet.")]
    sessions: Annotated[
        float,
        _doc(
            "Sessions between turns whose last request finished here (their next one "
            "will come back), times the share of sessions seen to come back: counted "
            "with running and waiting in decode_cost."
        ),
    ]
    queued_tokens: Annotated[
        int,
        _doc(
            "Predicted prefill tokens of the requests kvindex routed here whose first token "
            "was not reported yet (POST /route/{route_id}/first-token, or done)."
        ),
    ]
    prefix_cost: Annotated[
        float, _doc("Weighted own-prefill term: the prompt's uncached tokens / its tokens.")
    ]
    queue_cost: Annotated[
        float,
        _doc(
            "Weighted queue term: prefill tokens queued ahead (queued_tokens, plus one "
            "prompt per waiting request kvindex did not route) / the prompt's tokens."
        ),
    ]
    decode_cost: Annotated[
        float,
        _doc(
            "Weighted decode term: requests on the pod (running + waiting, or in_flight "
            "if more, plus sessions) x (the prompt's uncached tokens + "
            "future_prefill_tokens) / its tokens - the decodes its session's prefills "
            "would stall."
        ),
    ]
    kv_cost: Annotated[float, _doc("Weighted KV-usage term of the cost.")]
    cost: Annotated[float, _doc("The sum of the four terms; lower is better.")]
    admitted: Annotated[bool, _doc("False when the pod is over --max-kv-usage or --max-waiting.")]
    refused: Annotated[str | None, _doc("Why the pod was not admitted.")] = None
    stream_state: Annotated[
        str | None,
        _doc(
            "The pod's event stream state when it is not live, as /index/pods says "
            "(unheard: not heard from since kvindex started, restored, incomplete, "
            "gapped, replaying, ...); null: live, or no stream here."
        ),
    ] = None
    doubt: Annotated[
        str | None,
        _doc(
            "Why the pod's index entries are in doubt, null when they are not: "
            "hash_mismatch or gapped (its matched_blocks are not credited: 0 here and "
            "in the cost), or lagging (events later than --max-event-lag), incomplete, "
            "restored, unheard, replaying, verifying or resync (its matched blocks, a "
            "lower bound of its cache, still count). Other pods' prefixes decide as usual."
        ),
    ] = None
    ejected: Annotated[
        str | None,
        _doc(
            "Why the pod is set aside after failures reported for it (ejected, or probing: "
            "one request sent to it after its ejection, its answer awaited); it is chosen "
            "only when every admitted candidate is. Null: not set aside."
        ),
    ] = None


class RouteResponse(msgspec.Struct):
    """The chosen pod, why, and every candidate's cost."""

    route_id: Annotated[
        str, _doc("Names the routed request: POST /route/{route_id}/done when it finishes.")
    ]
    pod: Annotated[str, _doc("Where to send the request (under P/D: the decode pod).")]
    reason: Annotated[
        str,
        msgspec.Meta(
            description="prefix, load, least_bad, fallback_backend_down, "
            "fallback_unknown_model, fallback_tokenizer_unavailable, fallback_multimodal, "
            "fallback_untokenizable or session (a prompt that could not be scored sent to "
            "the pod of its session_id) (a doubted candidate changes no decision's reason: "
            "its row's doubt says why)"
        ),
    ]
    model: Annotated[str, _doc("The model routed for, as asked.")]
    block_size: Annotated[int, _doc("The model's KV block size in tokens.")]
    prompt_tokens: Annotated[int, _doc("Tokens in the prompt.")]
    prompt_blocks: Annotated[int, _doc("Full blocks in the prompt.")]
    candidates: Annotated[
        list[RouteCandidate], _doc("Every candidate pod, in the order considered, with its cost.")
    ]
    warnings: Annotated[
        list[str], _doc("Pods whose index entries are not known to be exact, and why.")
    ] = []
    rank: Annotated[int, _doc("The pod's data-parallel rank (engine) to use; 0 without DP.")] = 0
    prefill_pod: Annotated[
        str | None,
        _doc("P/D: the pod to prefill the prompt on; null when the decode pod prefills it."),
    ] = None
    prefill_rank: Annotated[
        int | None, _doc("P/D: the prefill pod's data-parallel rank; null without P/D.")
    ] = None
    prefill_reason: Annotated[
        str | None,
        _doc("P/D: why the prefill pod was chosen (prefix, load, ...), or why none was."),
    ] = None
    decode_pod: Annotated[str | None, _doc("P/D: the decode pod (= pod); null without P/D.")] = None
    future_prefill_tokens: Annotated[
        float,
        _doc(
            "The prefill tokens this request's session is expected to bring in its later "
            "turns (returning share / (1 - share) x the mean uncached tokens of a turn that "
            "continued a session), priced where a session starts: 0 for a request that "
            "continues one, and under P/D. F in each candidate's decode_cost."
        ),
    ] = 0.0


class RouteOutcome(msgspec.Struct, forbid_unknown_fields=True):
    """The optional body of POST /route/{route_id}/done: how the pod answered."""

    outcome: Annotated[
        Outcome | None,
        _doc(
            "ok (the pod answered, 4xx included), connect_error (refused, reset, closed "
            "without a status line), timeout (no connection or no status line in time), "
            "http_5xx, or broken (the answer broke off): failures eject the pod from "
            "routing for a while (--eject-after, --eject-base). Null: not reported."
        ),
    ] = None


class RouteDone(msgspec.Struct):
    """A released route."""

    route_id: Annotated[str, _doc("The route released.")]
    pod: Annotated[str, _doc("The pod it no longer counts against.")]


class ErrorBody(msgspec.Struct):
    """Every refusal: a stable machine-readable code and a sentence that says what to fix."""

    error: Annotated[
        str, _doc("Stable code: invalid_request, unknown_model, backend_unavailable, ...")
    ]
    detail: Annotated[str, _doc("What went wrong and which field or setting to change.")]


class PurgeResponse(msgspec.Struct):
    """What an operator purge removed."""

    pod: Annotated[str, _doc("The pod purged.")]
    members: Annotated[list[str], _doc("The pod and its data-parallel ranks.")]
    entries_removed: Annotated[int, _doc("Index entries (block, member) removed.")]


def ok_response(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI response whose JSON body has ``schema``."""
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def openapi_schema(*types: type) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """JSON schemas for ``types`` with their shared components, for FastAPI's OpenAPI."""
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    return list(schemas), components

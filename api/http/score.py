"""``POST /score`` without HTTP: a decoded request in, the answer out.

The prompt helpers here (tokens, candidate pods) are shared with ``/route``
(``api/http/route.py``); the HTTP side, body reading and error answers, is in
``api/http/hot_path.py``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from kvindex.api.http.json_tokens import decode_prompt
from kvindex.api.http.schemas import ScoreRequest, ScoreResponse
from kvindex.api.http.score_inputs import (
    hashed_keys,
    mm_features_of,
    prompt_form,
    require_known_model,
)
from kvindex.events.errors import ClientError, KvindexError, TooLarge
from kvindex.events.wire.identity import member_pod, normalize_pod
from kvindex.scoring.prompt.chat_template import MultimodalContent, Untokenizable
from kvindex.scoring.prompt.conversation import refuse_media
from kvindex.scoring.prompt.tokenize import ChatOptions
from kvindex.scoring.route.speculative import annotate
from kvindex.scoring.scorer import ScoreResult

if TYPE_CHECKING:
    from kvindex.api.serve.service import Service

# Chat messages are a few levels deep (content parts, tool calls); a deeper body is an
# attack on the decoder or the template, not a prompt.
MAX_MESSAGE_DEPTH = 32

_score_decoder = msgspec.json.Decoder(ScoreRequest)


class UntokenizablePrompt(ClientError):
    """The messages hold what kvindex cannot tokenize though the engine may serve it:
    multimodal content (``multimodal``), a content part of an unknown type, a template
    that fails under kvindex's rendering. /score cannot score it (400); /route routes it
    by load."""

    def __init__(self, detail: str, *, multimodal: bool) -> None:
        super().__init__(detail)
        self.multimodal = multimodal


def decode_score(body: bytes) -> ScoreRequest:
    """A JSON ``/score`` body, every decode failure a 400."""
    return decode_prompt(_score_decoder, body)


async def score_request(service: Service, req: ScoreRequest, started: float) -> ScoreResponse:
    """Each pod's cached prefix of ``req``'s prompt, best first, recorded in the score
    metrics as one request that began at ``started`` (``time.perf_counter()``). The
    index work runs under ``service.index_work`` (its deadline and cap). Raises
    ClientError (400), NotFound (404, unknown model), Unavailable (503)."""
    index = await service.index_work.run(score_index, service, req)
    return score_answer(service, req, index, started)


def score_inline(service: Service, req: ScoreRequest, started: float) -> ScoreResponse:
    """:func:`score_request` with the index work on the caller, for an index whose work
    never waits (``service.index_work.inline``, the memory backend): no coroutine, no
    await, as the HTTP lane in ``api/http/hot_lane.py`` answers from its parser callback."""
    return score_answer(service, req, score_index(service, req), started)


def score_answer(
    service: Service,
    req: ScoreRequest,
    index: tuple[ScoreResult, list[str] | None],
    started: float,
) -> ScoreResponse:
    """The answer from what the index said (:func:`score_index`), recorded in the score
    metrics; the part of /score that only reads memory, on the event loop."""
    result, candidates = index
    annotate(result, service.speculative, candidates)  # apart from the confirmed counts
    warnings = [*result.warnings, *service.directory.warnings(req.model, candidates)]
    states = service.directory.stream_states()
    if states:
        for pod in result.pods:
            pod.stream_state = states.get(pod.pod) or states.get(member_pod(pod.pod))
    response = ScoreResponse(
        result.model,
        result.block_size,
        result.prompt_tokens,
        result.prompt_blocks,
        result.pods,
        warnings,
    )
    service.metrics.score_done(result, time.perf_counter() - started, bool(warnings))
    return response


def score_index(service: Service, req: ScoreRequest) -> tuple[ScoreResult, list[str] | None]:
    """What the index says about ``req``, and its candidate pods: the part of /score that
    may wait on the backend or the tokenizer, so it runs under ``service.index_work``
    (thread-safe: it reads caches and the backend, and writes only memos)."""
    limits = service.settings.http
    serving_port = service.settings.events.serving_port
    if req.block_hashes is not None:
        keys = hashed_keys(service, req, limits.max_prompt_tokens)
        candidates = candidate_pods(req.pods, serving_port, limits.max_pods)
        return service.scorer.score_keys(req.model, keys, candidates=candidates), candidates
    tokens = tokens_of(service, req, limits.max_prompt_tokens, limits.max_prompt_chars)
    candidates = candidate_pods(req.pods, serving_port, limits.max_pods)
    result = service.scorer.score(
        req.model,
        tokens,
        lora_name=req.lora_name,
        cache_salt=req.cache_salt,
        mm_features=mm_features_of(req, len(tokens)),
        candidates=candidates,
    )
    return result, candidates


def tokens_of(service: Service, req: ScoreRequest, max_tokens: int, max_chars: int) -> list[int]:
    if prompt_form(req) == "block_hashes":
        raise ClientError("block_hashes are looked up as they are; they have no tokens")
    require_known_model(service, req.model)
    if req.messages is None and _chat_fields_given(req):
        raise ClientError(
            "add_generation_prompt, continue_final_message, tools, documents and "
            "chat_template_kwargs apply to messages only"
        )
    if req.mm_features is not None and req.token_ids is None:
        raise ClientError(
            "mm_features apply to token_ids only: their offsets are token positions of "
            "the prompt as the engine received it"
        )
    tokens = req.token_ids if req.token_ids is not None else _tokenize(service, req, max_chars)
    if not tokens:
        raise ClientError("the prompt is empty")
    if len(tokens) > max_tokens:
        raise ClientError(
            f"prompt has {len(tokens)} tokens, more than the limit of {max_tokens} "
            "(--max-prompt-tokens)"
        )
    return tokens


def _tokenize(service: Service, req: ScoreRequest, max_chars: int) -> list[int]:
    if req.prompt is not None:
        size = len(req.prompt)
    else:
        if any(not isinstance(m.get("role"), str) for m in req.messages or []):
            raise ClientError("every message needs a string 'role'")
        parts = [
            part
            for part in (req.messages, req.tools, req.documents, req.chat_template_kwargs)
            if part is not None
        ]
        if _depth(parts) > MAX_MESSAGE_DEPTH:
            raise ClientError(
                f"messages (or tools, documents) are nested more than {MAX_MESSAGE_DEPTH} "
                "levels deep"
            )
        try:  # before the size: media make a request multimodal, whatever their size
            refuse_media(req.messages or [])
        except MultimodalContent as exc:
            raise UntokenizablePrompt(str(exc), multimodal=True) from None
        size = sum(len(msgspec.json.encode(part)) for part in parts)
    if size > max_chars:
        raise ClientError(
            f"prompt text has {size} characters, more than the limit of {max_chars} "
            "(--max-prompt-chars)"
        )
    tokenizer = service.tokenizers.get(req.model)  # TokenizerUnavailable: 503
    try:
        if req.prompt is not None:
            return tokenizer.encode_prompt(req.prompt)
        return tokenizer.encode_chat(
            req.messages or [],
            ChatOptions(
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
                documents=req.documents,
                chat_template_kwargs=req.chat_template_kwargs,
            ),
        )
    except KvindexError:  # TokenizerUnavailable (503), our own client errors (400)
        raise
    except Untokenizable as exc:
        multimodal = isinstance(exc, MultimodalContent)
        raise UntokenizablePrompt(str(exc), multimodal=multimodal) from None
    except ValueError as exc:  # ChatTemplateError: the request's chat fields are wrong
        raise ClientError(str(exc)) from None
    except Exception as exc:  # jinja2 errors from a model's template
        raise UntokenizablePrompt(f"chat template failed: {exc}", multimodal=False) from None


def _chat_fields_given(req: ScoreRequest) -> bool:
    return (
        not req.add_generation_prompt
        or req.continue_final_message
        or req.tools is not None
        or req.documents is not None
        or req.chat_template_kwargs is not None
    )


def _depth(value: Any) -> int:
    """Nesting depth of decoded JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if deepest > MAX_MESSAGE_DEPTH:
            return deepest
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        )
        stack.extend((child, level + 1) for child in children)
    return deepest


def candidate_pods(pods: list[str] | None, serving_port: int, max_pods: int) -> list[str] | None:
    if pods is None:
        return None
    if not pods:
        raise ClientError("pods, when given, must name at least one pod")
    if len(pods) > max_pods:
        raise TooLarge(
            f"pods names {len(pods)} candidates, more than the limit of {max_pods} (--max-pods)"
        )
    return [pod_id(p, serving_port) for p in pods]


def pod_id(pod: str, serving_port: int) -> str:
    """``pod`` as the index names it (ip:port); IdentityError is a ClientError: 400."""
    return normalize_pod(pod, serving_port)

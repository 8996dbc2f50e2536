"""An OpenAI request body, read for routing: the model, the prompt as the tokens vLLM
will compute, and the expected output length.

Only the fields routing needs are decoded (unknown ones are ignored: the body is
forwarded to the pod byte for byte, and the pod validates it). The prompt becomes token
ids here, with the model's own tokenizer and chat template rendered as vLLM 0.33 renders
them (:class:`kvindex.scoring.prompt.tokenize.ModelTokenizer`, the code behind ``/score``'s
``prompt`` and ``messages``). Without a tokenizer for the model, the text itself goes to
``/route``, which tokenizes it if the index has one, or falls back to load-only routing.
So do messages kvindex cannot tokenize (multimodal content, with its media cut out;
a template failing): ``/route`` routes them by load (``fallback_multimodal``,
``fallback_untokenizable``), and the pod gets the client's body untouched. The client's
session id, read as vLLM reads it (:func:`session_of`), goes to ``/route`` with them: a
turn whose prompt cannot be scored then goes back to the pod that computed its session's
last turn.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import msgspec

from kvindex.api.http.schemas import MAX_OUTPUT_TOKENS, RouteRequest, TokenId
from kvindex.api.serve.settings import Settings
from kvindex.events.errors import ClientError, KvindexError
from kvindex.events.wire.sessions import MAX_SESSION_ID_CHARS
from kvindex.scoring.prompt.conversation import without_media
from kvindex.scoring.prompt.tokenize import ChatOptions, TokenizerRegistry

log = logging.getLogger(__name__)


class Endpoint(StrEnum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class CompletionBody(msgspec.Struct):
    """``POST /v1/completions``, the fields routing reads. A batch (a list of prompts)
    is routed by its first prompt."""

    model: str
    prompt: str | list[Any]  # text, token ids, or a batch of either
    max_tokens: int | None = None
    cache_salt: str | None = None
    stream: bool | None = None  # a streamed answer's head comes before any work
    # vLLM's session id fields, read as they come: the pod validates them, not the gateway
    session_id: Any = None
    vllm_xargs: Any = None


class SingleCompletion(msgspec.Struct):
    """``POST /v1/completions`` in the common case, decoded as what it is: one prompt,
    text or token ids, the ids checked while decoding (not in a second pass over 8,192
    of them). Anything else (a batch, bad ids) is read as :class:`CompletionBody`."""

    model: str
    prompt: list[TokenId] | str
    max_tokens: int | None = None
    cache_salt: str | None = None
    stream: bool | None = None  # a streamed answer's head comes before any work
    # vLLM's session id fields, read as they come: the pod validates them, not the gateway
    session_id: Any = None
    vllm_xargs: Any = None


class ChatBody(msgspec.Struct):
    """``POST /v1/chat/completions``, the fields routing reads, with vLLM's defaults."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: str | None = None
    stream: bool | None = None  # a streamed answer's head comes before any work
    # vLLM's session id fields, read as they come: the pod validates them, not the gateway
    session_id: Any = None
    vllm_xargs: Any = None


def expected_output(max_tokens: int | None) -> int | None:
    """The body's ``max_tokens`` as /route's estimate of the output, clamped to
    0..MAX_OUTPUT_TOKENS: the gateway forwards the body as it is and the pod refuses a
    count it cannot serve, so an absurd one must not fail the routing first (/route
    itself answers it with a 400)."""
    if max_tokens is None:
        return None
    return min(max(max_tokens, 0), MAX_OUTPUT_TOKENS)


_decoders: dict[Endpoint, msgspec.json.Decoder[Any]] = {
    Endpoint.COMPLETIONS: msgspec.json.Decoder(CompletionBody),
    Endpoint.CHAT: msgspec.json.Decoder(ChatBody),
}


_single = msgspec.json.Decoder(SingleCompletion)
_TOKEN_IDS = list[TokenId]  # made once: a typing alias per call costs its hashing


Body = SingleCompletion | CompletionBody | ChatBody


def read_body(endpoint: Endpoint, body: bytes) -> Body:
    """The body's routing fields; ClientError (400) when it is not a request at all."""
    if endpoint is Endpoint.COMPLETIONS:
        try:
            return _single.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            pass  # a batch, or not a request: said precisely below
    try:
        return _decoders[endpoint].decode(body)
    except msgspec.ValidationError as exc:
        raise ClientError(f"{endpoint}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ClientError(f"body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise ClientError("body is nested too deeply", code="invalid_json") from None


def lora_adapters(settings: Settings) -> dict[str, str]:
    """Adapter name -> base model, from the config file's ``loras:`` per model. An
    adapter two models both list is left out (which base it means is not known), as is
    one named like a configured model."""
    claims: dict[str, set[str]] = {}
    for base, entry in settings.models.items():
        for name in entry.loras:
            claims.setdefault(name, set()).add(base)
    return {
        name: next(iter(bases))
        for name, bases in claims.items()
        if len(bases) == 1 and name not in settings.models
    }


#: The header vLLM 0.33 reads a session id from (``SESSION_ID_HEADER``).
SESSION_ID_HEADER = b"x-session-id"


def session_of(body: Body, header: bytes | None) -> str | None:
    """The request's session id as vLLM 0.33 takes it
    (``GenerateBaseServing._get_session_id``): the body's ``session_id``, else the
    ``X-Session-ID`` header, else ``vllm_xargs.session_id``, the first that is a non-empty
    string. None when there is none, or when it is longer than ``/route`` takes (the
    request is then routed without it; the pod still gets it)."""
    session: Any = body.session_id if isinstance(body.session_id, str) else None
    if not session and header:
        session = header.decode("latin-1")  # as the ASGI server decodes header values
    if not session and isinstance(body.vllm_xargs, dict):
        session = body.vllm_xargs.get("session_id")
    if not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_ID_CHARS:
        return None
    return session


class RouteRequests:
    """Builds the ``/route`` request for an OpenAI body, tokenizing with ``tokenizers``
    (the index's own registry when the gateway runs inside ``kvindex serve``).

    ``adapters`` maps a LoRA adapter's name to its base model (the config file's
    ``loras:`` per model): vLLM serves an adapter under its own name as ``model``, and
    caches its blocks under the base model with the adapter in the block keys, so such a
    request is routed as the base model with ``lora_name`` (and tokenized with the base
    model's tokenizer). A name that is also a configured model stays that model."""

    def __init__(
        self, tokenizers: TokenizerRegistry, adapters: Mapping[str, str] | None = None
    ) -> None:
        self.tokenizers = tokenizers
        self.adapters = dict(adapters or {})

    def build(self, parsed: Body, request_id: str, session_id: str | None = None) -> RouteRequest:
        """The ``/route`` request for ``parsed``, under ``request_id``, for the client's
        ``session_id`` (:func:`session_of`)."""
        if isinstance(parsed, ChatBody):
            request = self._chat(parsed, request_id)
        else:
            request = self._completion(parsed, request_id)
        if session_id is not None:
            request.session_id = session_id
        base = self.adapters.get(request.model)
        if base is not None:
            return msgspec.structs.replace(request, model=base, lora_name=request.model)
        return request

    def _model(self, model: str) -> str:
        """The model whose tokenizer renders ``model``'s prompts (an adapter's base)."""
        return self.adapters.get(model, model)

    def _completion(self, body: SingleCompletion | CompletionBody, request_id: str) -> RouteRequest:
        prompt: Any = body.prompt
        if isinstance(prompt, list) and not prompt:
            raise ClientError("prompt is an empty list")
        if isinstance(body, CompletionBody) and isinstance(prompt, list):  # not yet checked
            if isinstance(prompt[0], str | list):  # a batch
                prompt = prompt[0]
            if isinstance(prompt, list):
                try:  # in C: a Python loop over a long prompt's ids eats the budget
                    prompt = msgspec.convert(prompt, _TOKEN_IDS)
                except msgspec.ValidationError:
                    raise ClientError(
                        "prompt must be text, token ids, or a list of either"
                    ) from None
        if isinstance(prompt, list):  # token ids: vLLM computes them as they are
            tokens: list[int] | None = prompt
        else:
            tokens = self._tokens(self._model(body.model), lambda t: t.encode_prompt(prompt))
        return RouteRequest(
            model=body.model,
            token_ids=tokens,
            prompt=None if tokens is not None else prompt,
            request_id=request_id,
            max_tokens=expected_output(body.max_tokens),
            cache_salt=body.cache_salt,
        )

    def _chat(self, body: ChatBody, request_id: str) -> RouteRequest:
        options = ChatOptions(
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=body.tools,
            documents=body.documents,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        common: dict[str, Any] = {
            "model": body.model,
            "request_id": request_id,
            "max_tokens": expected_output(body.max_completion_tokens or body.max_tokens),
            "cache_salt": body.cache_salt,
        }
        tokens = self._tokens(
            self._model(body.model), lambda t: t.encode_chat(body.messages, options)
        )
        if tokens is not None:
            return RouteRequest(token_ids=tokens, **common)
        # Not tokenized here (no tokenizer, multimodal content, a template failing):
        # /route tokenizes the text or routes by load and says why in its reason.
        return RouteRequest(
            messages=without_media(body.messages),
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=body.tools,
            documents=body.documents,
            chat_template_kwargs=body.chat_template_kwargs,
            **common,
        )

    def _tokens(self, model: str, encode: Any) -> list[int] | None:
        """The prompt's token ids, or None to let ``/route`` read the text (no tokenizer
        here, or the template refused: the index then says why, or falls back)."""
        try:
            tokens = encode(self.tokenizers.get(model))
        except KvindexError:  # TokenizerUnavailable, or a request the template refuses
            return None
        except Exception as exc:  # a model's template failing on these messages
            log.debug("gateway: model %s: cannot render locally: %s", model, exc)
            return None
        return tokens or None

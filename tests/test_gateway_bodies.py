"""What the gateway reads from an OpenAI body to route it, and the headers it adds for the
pod: pure functions, no sockets (the end-to-end behaviour is in test_gateway.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvindex.api.gateway.bodies import (
    Endpoint,
    RouteRequests,
    lora_adapters,
    read_body,
    session_of,
)
from kvindex.api.gateway.headers import first_header
from kvindex.api.gateway.upstream import _rank_header
from kvindex.api.http.schemas import MAX_OUTPUT_TOKENS, RouteCandidate, RouteResponse
from kvindex.api.serve.settings import Settings
from kvindex.events.errors import ClientError
from kvindex.scoring.prompt.tokenize import ChatOptions, TokenizerRegistry
from tests.chat_models import model_directory

MESSAGES = [{"role": "user", "content": "Hello! What is a KV cache?"}]


def build(endpoint: Endpoint, body: bytes, tokenizers: TokenizerRegistry | None = None):
    requests = RouteRequests(tokenizers or TokenizerRegistry())
    return requests.build(read_body(endpoint, body), "rid")


def test_token_id_prompts_and_batches_route_by_their_first_prompt() -> None:
    route = build(
        Endpoint.COMPLETIONS, b'{"model": "m", "prompt": [[5, 6, 7], [1]], "max_tokens": 9}'
    )
    assert (route.token_ids, route.prompt, route.max_tokens, route.request_id) == (
        [5, 6, 7],
        None,
        9,
        "rid",
    )
    assert build(Endpoint.COMPLETIONS, b'{"model": "m", "prompt": ["a b", "c"]}').prompt == "a b"


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": []}',
        b'{"model": "m", "prompt": [1, -2]}',
        b'{"model": "m", "prompt": [1, true]}',
        b'{"model": "m"}',
        b'{"model": "m", "messages": "hi"}',
        b"not json",
    ],
)
def test_bodies_that_cannot_be_routed_are_client_errors(body: bytes) -> None:
    endpoint = Endpoint.CHAT if b"messages" in body else Endpoint.COMPLETIONS
    with pytest.raises(ClientError):
        build(endpoint, body)


@pytest.mark.parametrize(
    ("given", "estimate"),
    [(2**63, MAX_OUTPUT_TOKENS), (2**70, MAX_OUTPUT_TOKENS), (-5, 0), (64, 64)],
)
def test_the_output_estimate_is_clamped_and_the_body_left_to_the_pod(
    given: int, estimate: int
) -> None:
    """Issue 26, item 2: the gateway forwards the body as it is (the pod refuses a
    max_tokens it cannot serve); /route's estimate of the output is clamped, so an
    absurd count cannot fail the routing (a negative one made the ledger raise)."""
    bodies = [
        (Endpoint.COMPLETIONS, f'{{"model": "m", "prompt": [1, 2], "max_tokens": {given}}}'),
        (Endpoint.CHAT, f'{{"model": "m", "messages": [], "max_tokens": {given}}}'),
        (Endpoint.CHAT, f'{{"model": "m", "messages": [], "max_completion_tokens": {given}}}'),
    ]
    for endpoint, body in bodies:
        assert build(endpoint, body.encode()).max_tokens == estimate


def test_without_a_tokenizer_the_text_and_chat_fields_go_to_route() -> None:
    body = (
        b'{"model": "nobody/has-this", "messages": [{"role": "user", "content": "hi"}],'
        b' "max_completion_tokens": 4, "chat_template_kwargs": {"x": 1}, "cache_salt": "s"}'
    )
    route = build(Endpoint.CHAT, body)
    assert route.token_ids is None and route.messages == [{"role": "user", "content": "hi"}]
    assert (route.max_tokens, route.chat_template_kwargs, route.cache_salt) == (4, {"x": 1}, "s")


def test_media_go_to_route_as_their_type_alone(tmp_path: Path) -> None:
    """A chat with an image, with or without a tokenizer: /route reads the messages (and
    routes them by load), without the image's bytes."""
    tokenizers = TokenizerRegistry({"oss": str(model_directory("gpt-oss", tmp_path))})
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4096}}
    text = {"type": "text", "text": "What is this?"}
    message = {"role": "user", "content": [text, image], "name": "u"}
    body = msgspec.json.encode({"model": "oss", "messages": [message]})
    for registry in (tokenizers, None):
        route = build(Endpoint.CHAT, body, registry)
        assert route.token_ids is None
        assert route.messages == [{**message, "content": [text, {"type": "image_url"}]}]


def test_with_a_tokenizer_the_gateway_sends_the_tokens_vllm_will_compute(tmp_path: Path) -> None:
    directory = model_directory("gpt-oss", tmp_path)
    tokenizers = TokenizerRegistry({"oss": str(directory)})
    body = (
        b'{"model": "oss", "messages": [{"role": "user", "content": "Hello! What is a KV cache?"}]}'
    )
    route = build(Endpoint.CHAT, body, tokenizers)
    assert route.token_ids == tokenizers.get("oss").encode_chat(MESSAGES, ChatOptions())
    text = build(Endpoint.COMPLETIONS, b'{"model": "oss", "prompt": "Hello!"}', tokenizers)
    assert text.token_ids == tokenizers.get("oss").encode_prompt("Hello!")


def candidate(pod: str, rank: int) -> RouteCandidate:
    return RouteCandidate(
        pod,
        rank,
        "both",
        0,
        0,
        0,
        0.0,
        "known",
        0,
        0,
        0.0,
        0,
        0.0,
        0,
        0.0,
        0.0,
        0.0,
        0.0,
        0.0,
        True,
    )


def test_the_rank_header_names_the_engine_only_for_data_parallel_pods() -> None:
    def decision(rank: int, *rows: RouteCandidate) -> RouteResponse:
        return RouteResponse("r", "a:1", "prefix", "m", 16, 32, 2, list(rows), [], rank=rank)

    dp = decision(1, candidate("a:1", 0), candidate("a:1", 1), candidate("b:1", 0))
    # Headers as the ASGI scope holds them: bytes, names in lower case.
    assert _rank_header([(b"x", b"y")], dp) == [(b"x-data-parallel-rank", b"1")]
    assert _rank_header([(b"x-data-parallel-rank", b"0")], dp) == []
    plain = decision(0, candidate("a:1", 0), candidate("b:1", 0))
    assert _rank_header([], plain) == []
    # Under P/D the prefill leg names the prefill pod's own rank.
    pd = decision(0, candidate("a:1", 0), candidate("p:1", 0), candidate("p:1", 1))
    pd.prefill_pod, pd.prefill_rank = "p:1", 1
    assert _rank_header([], pd) == []
    assert _rank_header([], pd, prefill=True) == [(b"x-data-parallel-rank", b"1")]


def test_a_lora_adapter_named_as_model_is_routed_as_its_base_model(tmp_path: Path) -> None:
    """vLLM serves an adapter under its own name; its blocks are cached under the base
    model with the adapter in the block keys. So /route gets the base model and
    lora_name, and the prompt is tokenized with the base model's tokenizer."""
    settings = msgspec.convert(
        {
            "models": {
                "oss": {"loras": {"sql": "/adapters/sql", "both": "/a"}},
                "other": {"loras": {"both": "/b"}},  # an adapter of two bases: unknown
            }
        },
        Settings,
    )
    adapters = lora_adapters(settings)
    assert adapters == {"sql": "oss"}
    directory = model_directory("gpt-oss", tmp_path)
    tokenizers = TokenizerRegistry({"oss": str(directory)})
    requests = RouteRequests(tokenizers, adapters)
    route = requests.build(
        read_body(Endpoint.COMPLETIONS, b'{"model": "sql", "prompt": "Hi"}'), "r"
    )
    assert (route.model, route.lora_name) == ("oss", "sql")
    assert route.token_ids == tokenizers.get("oss").encode_prompt("Hi")
    chat = (
        b'{"model": "sql", "messages": [{"role": "user", "content": "Hello! What is a KV cache?"}]}'
    )
    route = requests.build(read_body(Endpoint.CHAT, chat), "r")
    assert (route.model, route.lora_name) == ("oss", "sql")
    assert route.token_ids == tokenizers.get("oss").encode_chat(MESSAGES, ChatOptions())
    plain = requests.build(
        read_body(Endpoint.COMPLETIONS, b'{"model": "oss", "prompt": "Hi"}'), "r"
    )
    assert (plain.model, plain.lora_name) == ("oss", None)


@pytest.mark.parametrize(
    ("fields", "header", "expected"),
    [
        ({"session_id": "body"}, b"header", "body"),  # vLLM: the body's field first,
        ({"session_id": ""}, b"header", "header"),  # then the header,
        ({"vllm_xargs": {"session_id": "xargs"}}, None, "xargs"),  # then vllm_xargs
        ({"session_id": 7, "vllm_xargs": {"session_id": "xargs"}}, b"", "xargs"),
        ({"vllm_xargs": {"session_id": 7}}, None, None),
        ({"vllm_xargs": "not a map"}, None, None),
        ({}, None, None),
        ({"session_id": "s" * 257}, b"header", None),  # longer than /route takes: none
    ],
)
def test_the_session_id_is_read_as_vllm_reads_it(
    fields: dict, header: bytes | None, expected: str | None
) -> None:
    for endpoint, base in (
        (Endpoint.CHAT, {"model": "m", "messages": MESSAGES}),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]}),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": [[1, 2], [3]]}),  # a batch
    ):
        parsed = read_body(endpoint, msgspec.json.encode({**base, **fields}))
        session = session_of(parsed, header)
        assert session == expected
        assert RouteRequests(TokenizerRegistry()).build(parsed, "r", session).session_id == (
            expected
        )


def test_the_first_session_header_counts() -> None:
    headers = [(b"x-session-id", b"first"), (b"x-session-id", b"second")]
    assert first_header(headers, b"x-session-id") == b"first"
    assert first_header(headers, b"x-other") is None

"""Chat prompts render to exactly the text and tokens transformers renders (the reference
vLLM 0.33 calls), on the chat templates of real model families.

The templates and tokenizer configs under tests/fixtures/tokenizers/ are the published
files (see tests/fixtures/tokenizers/README.md). Their tokenizer.json files (tens of MB)
are not shipped: each test builds a small one with the same tokenizer class, special and
added tokens at the published ids, so transformers' ``AutoTokenizer`` and kvindex load
the same directory and must agree token for token.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvindex.scoring.prompt.chat_template import ChatTemplateError
from kvindex.scoring.prompt.conversation import (
    conversation,
    detect_content_format,
    vllm_tools,
)
from kvindex.scoring.prompt.tokenize import ChatOptions, ModelTokenizer
from tests.chat_models import FAMILIES, model_directory
from tests.support.reference import transformers

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Wetter für eine Stadt <heute> & morgen",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": 'Stadt, z. B. "Zürich"'},
                "unit": {"type": "string", "enum": ["c", "f"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"unit": "c", "city": "Zürich <&>"}'},
}

CASES: list[tuple[str, list[dict[str, Any]], ChatOptions]] = [
    ("one user turn", [{"role": "user", "content": "Hello!"}], ChatOptions()),
    (
        "system prompt",
        [
            {"role": "system", "content": "You are terse. Answer in one line."},
            {"role": "user", "content": "What is a KV cache?"},
        ],
        ChatOptions(),
    ),
    (
        "multi-turn",
        [
            {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "Seven."},
            {"role": "user", "content": "Another one?"},
            {"role": "assistant", "content": "Eleven."},
            {"role": "user", "content": "  padded with spaces  "},
        ],
        ChatOptions(),
    ),
    (
        "non-ASCII",
        [{"role": "user", "content": "héllo 你好 🚀 Привет — ½ ß"}],
        ChatOptions(),
    ),
    (
        "markup characters",
        [{"role": "user", "content": "<script>alert('x') & \"y\"</script> a > b < c"}],
        ChatOptions(),
    ),
    (
        "content parts",
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}],
            }
        ],
        ChatOptions(),
    ),
    (
        "no generation prompt",
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        ChatOptions(add_generation_prompt=False),
    ),
    (
        "continue final message",
        [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2,"}],
        ChatOptions(add_generation_prompt=False, continue_final_message=True),
    ),
    (
        "assistant thinking kept in content",
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nsimple\n</think>\n\n4"},
            {"role": "user", "content": "3+3?"},
        ],
        ChatOptions(),
    ),
    (
        "assistant reasoning field",
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning": "Add them."},
            {"role": "user", "content": "and 3+3?"},
        ],
        ChatOptions(),
    ),
    (
        "reasoning effort and identity kwargs",
        [{"role": "user", "content": "Think hard."}],
        ChatOptions(
            chat_template_kwargs={
                "reasoning_effort": "high",
                "model_identity": "You are kvbot <v1> & co.",
                "enable_thinking": False,
            }
        ),
    ),
    (
        "tools offered",
        [{"role": "user", "content": "Weather in Zürich?"}],
        ChatOptions(tools=[WEATHER_TOOL]),
    ),
    (
        "tool call round trip",
        [
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "note": "<hot>"}'},
        ],
        ChatOptions(tools=[WEATHER_TOOL]),
    ),
    (
        "developer message",
        [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
        ],
        ChatOptions(),
    ),
    (
        "documents",
        [{"role": "user", "content": "Summarise."}],
        ChatOptions(documents=[{"title": "Doc <1>", "text": "Body & text"}]),
    ),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, Any, ModelTokenizer]:
    directory = model_directory(request.param, tmp_path_factory.mktemp(request.param))
    reference = transformers().AutoTokenizer.from_pretrained(str(directory))
    return request.param, reference, ModelTokenizer(request.param, directory)


def _reference(reference: Any, messages, options: ChatOptions, tokenize: bool):
    """What vLLM 0.33 hands transformers: its rebuilt conversation and tools, the
    request's fields and chat_template_kwargs."""
    tools = vllm_tools(options.tools) if options.tools is not None else None
    template = reference.get_chat_template(None, tools)
    chat = conversation(messages, detect_content_format(template), template)
    return reference.apply_chat_template(
        chat,
        tools=tools,
        documents=options.documents,
        add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message,
        tokenize=tokenize,
        return_dict=False,
        **(options.chat_template_kwargs or {}),
    )


@pytest.mark.parametrize(("name", "messages", "options"), CASES, ids=[c[0] for c in CASES])
def test_rendered_text_and_tokens_match_transformers(family, name, messages, options) -> None:
    _, reference, ours = family
    try:
        expected_text = _reference(reference, messages, options, tokenize=False)
    except Exception as exc:  # the template refuses this conversation: so must we
        with pytest.raises(ChatTemplateError):
            ours.render_chat(messages, options)
        assert str(exc)  # the reference said why
        return
    assert ours.render_chat(messages, options) == expected_text
    expected_ids = _reference(reference, messages, options, tokenize=True)
    assert ours.encode_chat(messages, options) == expected_ids
    assert len(expected_ids) > 1


def test_every_family_renders_most_cases(family) -> None:
    """Refusals are compared above; make sure each family really renders, not refuses."""
    _, _, ours = family
    rendered = 0
    for _, messages, options in CASES:
        try:
            ours.render_chat(messages, options)
            rendered += 1
        except ChatTemplateError:
            pass
    assert rendered >= len(CASES) // 2


def test_markup_and_non_ascii_reach_the_prompt_unescaped(family) -> None:
    _, _, ours = family
    text = "<b>Zürich & 你好</b>"
    rendered = ours.render_chat([{"role": "user", "content": text}])
    assert text in rendered

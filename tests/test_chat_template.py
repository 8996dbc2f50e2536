"""The Jinja environment behaves as transformers' own, feature by feature, checked against
transformers' renderer on small templates; and model directories load their templates
with transformers' precedence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvindex.scoring.prompt.chat_template import (
    ChatTemplateError,
    Untokenizable,
    load_chat_templates,
    render,
)
from tests.support.reference import render_jinja_template

MESSAGES = [
    {"role": "system", "content": "Sé <breve> & claro"},
    {"role": "user", "content": "你好 \"quoted\" 'single'"},
    {"role": "assistant", "content": "ok", "meta": {"z": 1, "a": [2, {"y": None}]}},
    {"role": "user", "content": "last"},
]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": "<&>"}}}]

TEMPLATES = {
    "tojson plain": "{% for m in messages %}{{ m | tojson }}\n{% endfor %}",
    "tojson options": "{{ messages[2] | tojson(indent=2) }}|{{ messages | tojson(sort_keys=true) }}"
    "|{{ tools | tojson(separators=(',', ':')) }}|{{ messages[1] | tojson(ensure_ascii=true) }}",
    "break and continue": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}"
    "{% endif %}{% if m.role == 'assistant' %}{% break %}{% endif %}[{{ m.content }}]{% endfor %}",
    "trim and lstrip blocks": "{% for m in messages %}\n    {% if m.role %}\n<{{ m.role }}>\n"
    "    {% endif %}\n{% endfor %}",
    "generation block": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "strftime_now": "{{ strftime_now('%Y') }}",
    "special tokens and kwargs": "{{ bos_token }}{{ eos_token }}{{ custom | default('none') }}"
    "{{ add_generation_prompt }}{{ documents | tojson }}",
    "namespace and filters": "{% set ns = namespace(n=0) %}{% for m in messages %}"
    "{% set ns.n = ns.n + m.content | length %}{% endfor %}{{ ns.n }}"
    "{{ messages | map(attribute='role') | join(',') }}{{ messages[0].content | trim | upper }}",
}


def reference(template: str, **kwargs) -> str:
    rendered, _ = render_jinja_template(conversations=[MESSAGES], chat_template=template, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_features_render_as_transformers_renders_them(name: str) -> None:
    template = TEMPLATES[name]
    kwargs = dict(
        tools=TOOLS,
        documents=[{"title": "t", "text": "<x>"}],
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
    )
    if name == "special tokens and kwargs":
        kwargs["custom"] = "ünïcode"
    expected = reference(template, **kwargs)
    special = {"bos_token": kwargs.pop("bos_token"), "eos_token": kwargs.pop("eos_token")}
    assert render(template, MESSAGES, special_tokens=special, **kwargs) == expected
    assert expected  # the feature rendered something


def test_tojson_keeps_markup_non_ascii_and_key_order() -> None:
    out = render("{{ messages[2] | tojson }}", MESSAGES)
    assert out == json.dumps(MESSAGES[2], ensure_ascii=False)
    assert render("{{ messages[0].content | tojson }}", MESSAGES) == '"Sé <breve> & claro"'


def test_raise_exception_and_broken_templates_are_chat_template_errors() -> None:
    # The template's own failures: the engine decides on such a request (/route and the
    # gateway route it by load), not kvindex's rendering.
    with pytest.raises(Untokenizable, match="no system"):
        render("{{ raise_exception('no system') }}", MESSAGES)
    with pytest.raises(Untokenizable, match="compile"):
        render("{% for %}", MESSAGES)
    with pytest.raises(Untokenizable, match="failed"):
        render("{{ messages[0].content + 1 }}", MESSAGES)
    with pytest.raises(ChatTemplateError, match="empty") as refused:
        render("x", [])
    assert not isinstance(refused.value, Untokenizable)  # the request's own fault


def test_the_sandbox_still_guards_the_host() -> None:
    with pytest.raises(ChatTemplateError):
        render("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", MESSAGES)
    with pytest.raises(ChatTemplateError):
        render("{% set _ = messages.append(1) %}", MESSAGES)  # immutable sandbox


def test_continue_final_message_cuts_after_the_final_text() -> None:
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    chat = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2,"}]
    expected, _ = render_jinja_template(
        conversations=[chat], chat_template=template, continue_final_message=True
    )
    assert render(template, chat, continue_final_message=True) == expected[0]
    assert expected[0].endswith("<assistant>1, 2,")
    with pytest.raises(ChatTemplateError):
        render(template, chat, continue_final_message=True, add_generation_prompt=True)


def write(directory: Path, name: str, text: str) -> None:
    (directory / name).parent.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text, encoding="utf-8")


def test_templates_load_with_transformers_precedence(tmp_path: Path) -> None:
    config = {
        "chat_template": "from config",
        "bos_token": {"content": "<s>", "__type": "AddedToken"},
        "eos_token": "</s>",
        "unk_token": None,
    }
    write(tmp_path, "tokenizer_config.json", json.dumps(config))
    write(tmp_path, "special_tokens_map.json", json.dumps({"pad_token": "<pad>"}))
    assert load_chat_templates(tmp_path).select(None) == "from config"
    write(tmp_path, "chat_template.jinja", "from jinja file")
    write(tmp_path, "additional_chat_templates/tool_use.jinja", "tool template")
    templates = load_chat_templates(tmp_path)
    assert templates.select(None) == "from jinja file"
    assert templates.select([{"type": "function"}]) == "tool template"
    assert templates.special_tokens == {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
    }


def test_named_templates_in_the_config(tmp_path: Path) -> None:
    named = [{"name": "default", "template": "d"}, {"name": "tool_use", "template": "t"}]
    write(tmp_path, "tokenizer_config.json", json.dumps({"chat_template": named}))
    templates = load_chat_templates(tmp_path)
    assert (templates.select(None), templates.select([])) == ("d", "t")
    write(tmp_path, "tokenizer_config.json", json.dumps({"chat_template": named[1:]}))
    with pytest.raises(ChatTemplateError, match="default"):
        load_chat_templates(tmp_path).select(None)
    write(tmp_path, "tokenizer_config.json", json.dumps({"eos_token": "</s>"}))
    assert load_chat_templates(tmp_path) is None

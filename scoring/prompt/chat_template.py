"""Chat templates rendered exactly as transformers renders them, without transformers.

vLLM renders a chat request with ``tokenizer.apply_chat_template``; any difference in
the text (an escaped ``<``, a re-ordered JSON key, a missing global) changes the tokens,
and a cached prompt then scores as a miss with no error. So the Jinja environment is a
copy of transformers' own (``_compile_jinja_template``, transformers 5.16-5.20, the range
vLLM 0.33 requires): a sandboxed environment with ``trim_blocks``, ``lstrip_blocks``,
loop controls and a ``{% generation %}`` tag; a ``tojson`` that neither escapes nor sorts
keys; the globals ``raise_exception`` and ``strftime_now``; the tokenizer's special
tokens overridden by the request's keyword arguments. transformers is the reference the
tests compare against, never imported at run time.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES (5.20): the names its
# ``special_tokens_map`` hands every template.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# transformers appends this to the final message for ``continue_final_message`` and cuts
# the rendered text there (5.20).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The template or its inputs refused the conversation; the message says why."""


class Untokenizable(ChatTemplateError):
    """kvindex cannot compute the engine's tokens for a conversation the engine may well
    serve: a content part it does not render, or the model's template failing under
    kvindex's rendering. A router routes such a request without its prefix; it is not
    the request's fault."""


class MultimodalContent(Untokenizable):
    """The conversation holds multimodal content (images, audio, video, files,
    embeddings). The engine turns each item into placeholder tokens made by the model's
    processor and hashes the blocks over them with the item's hash in ``extra_keys``,
    so no text rendering gives their block keys."""


@dataclass(frozen=True, slots=True)
class ChatTemplates:
    """A model's chat templates as transformers loads them from its directory.

    ``named`` holds every template by name; a single template is named ``default``.
    """

    named: Mapping[str, str]
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    def select(self, tools: object | None) -> str:
        """The template transformers' ``get_chat_template`` picks: ``tool_use`` when
        tools are given and the model has one, else ``default``."""
        if tools is not None and "tool_use" in self.named:
            return self.named["tool_use"]
        if "default" in self.named:
            return self.named["default"]
        raise ChatTemplateError(
            "this model has several chat templates and none named 'default' "
            f"({', '.join(sorted(self.named))})"
        )


def load_chat_templates(directory: Path) -> ChatTemplates | None:
    """The chat templates in a model directory, or None when it has none.

    Precedence as in transformers 5.20: ``chat_template.jinja`` is the default template
    and wins over ``chat_template`` in ``tokenizer_config.json``; every
    ``additional_chat_templates/<name>.jinja`` adds a named one.
    """
    config: dict[str, Any] = {}
    config_path = directory / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    named: dict[str, str] = {}
    source = config.get("chat_template")
    if isinstance(source, str) and source:
        named["default"] = source
    elif isinstance(source, list):  # [{"name": "default", "template": "..."}, ...]
        for entry in source:
            if isinstance(entry, dict) and isinstance(entry.get("template"), str):
                named[str(entry.get("name"))] = entry["template"]
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        named["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = directory / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            named[path.stem] = path.read_text(encoding="utf-8")
    if not named:
        return None
    return ChatTemplates(named, _special_tokens(directory, config))


def _special_tokens(directory: Path, config: Mapping[str, Any]) -> dict[str, str]:
    values: dict[str, Any] = {}
    map_path = directory / "special_tokens_map.json"
    if map_path.is_file():
        values.update(json.loads(map_path.read_text(encoding="utf-8")))
    for name in SPECIAL_TOKEN_NAMES:
        if name in config:
            values[name] = config[name]
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(values.get(name))
        if text is not None:
            out[name] = text
    return out


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "__type": "AddedToken", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    special_tokens: Mapping[str, str] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    **kwargs: Any,
) -> str:
    """``template`` rendered over ``messages`` as ``apply_chat_template(tokenize=False)``
    renders it (transformers 5.20), including ``continue_final_message``."""
    if not messages:
        raise ChatTemplateError("cannot render an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be true"
        )
    if documents is not None and any(not isinstance(d, Mapping) for d in documents):
        raise ChatTemplateError("documents must be a list of objects")
    chat = [dict(m) for m in messages]
    final_text = ""
    if continue_final_message:
        final_text = _tag_final_message(chat, template)
    compiled = _compile(template)
    variables = {**(special_tokens or {}), **kwargs}
    try:
        text = compiled.render(
            messages=chat,
            tools=list(tools) if tools is not None else None,
            documents=list(documents) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except ChatTemplateError:
        raise
    except Exception as exc:  # jinja2 errors, and whatever a template's own code raises
        raise Untokenizable(f"chat template failed: {exc}") from None
    if continue_final_message:
        text = _cut_at_tag(text, final_text)
    return text


def _tag_final_message(chat: list[dict[str, Any]], template: str) -> str:
    final = chat[-1].get("content")
    if final is None:
        raise ChatTemplateError(
            'continue_final_message is set but the final message has no "content"'
        )
    if "content" not in template:
        raise ChatTemplateError("continue_final_message needs a template that reads 'content'")
    if isinstance(final, list):
        parts = [dict(p) if isinstance(p, Mapping) else p for p in final]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                final_text = part["text"]
                part["text"] = part["text"] + _CONTINUE_TAG
                chat[-1]["content"] = parts
                return final_text
        raise ChatTemplateError("continue_final_message: the final message has no text to continue")
    chat[-1]["content"] = final + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in text or tag not in text:
        raise ChatTemplateError(
            "continue_final_message: the chat template dropped part of the final message"
        )
    at = text.rindex(tag)
    if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()


_compiled: dict[str, Any] = {}
_compiled_lock = threading.Lock()
_COMPILED_MAX = 64  # requests cannot bring templates, so this holds the models' few


def _compile(template: str) -> Any:
    found = _compiled.get(template)
    if found is not None:
        return found
    with _compiled_lock:
        found = _compiled.get(template)
        if found is None:
            try:
                found = environment().from_string(template)
            except Exception as exc:  # a template that does not parse
                raise Untokenizable(f"chat template does not compile: {exc}") from None
            if len(_compiled) >= _COMPILED_MAX:
                _compiled.clear()
            _compiled[template] = found
        return found


def environment() -> Any:
    """A fresh Jinja environment configured as transformers configures its own."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks; rendering it only emits the body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    # The engine renders the same template, but kvindex's rendering of the messages may
    # differ from the engine's in what the template checks: the engine decides.
    raise Untokenizable(f"chat template refused the messages: {message}")


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)

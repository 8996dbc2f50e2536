"""OpenAI chat messages turned into the conversation vLLM hands its chat template.

vLLM 0.33 rebuilds each message before rendering (``vllm/renderers/chat_utils/
chat_message.py``, ``vllm/renderers/hf.py``), and the prompt depends on every step; these
are the steps for text conversations, as pure functions: content parts joined with
``"\n"``, or kept as text parts when the template loops over ``content`` (the "openai"
content format, read from the template's syntax tree); only the fields vLLM keeps per
role; tool-call ``arguments`` parsed from JSON strings; ``developer`` messages merged
into the first ``system`` one when the template never names that role; tools dumped as
vLLM's request model dumps them. Multimodal parts raise MultimodalContent, unknown part
types Untokenizable: kvindex cannot compute such a conversation's blocks, so ``/route``
and the gateway route it by load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvindex.scoring.prompt.chat_template import (
    ChatTemplateError,
    ContentFormat,
    MultimodalContent,
    Untokenizable,
)

# Content part types vLLM 0.33 reads as text, and the key each keeps its text under.
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# Content part types that carry media (OpenAI's, vLLM's own, the Responses API's).
_MEDIA_PARTS = frozenset(
    {
        "image_url", "input_image", "image_embeds", "image_pil", "image", "input_audio",
        "audio_url", "audio_embeds", "audio", "video_url", "video_embeds", "video", "file",
        "input_file",
    }
)  # fmt: skip
# Fields of OpenAI content parts; anything else on a text part is passed through to an
# "openai" format template, as vLLM does.
_KNOWN_PART_FIELDS = frozenset(
    {
        "type", "text", "refusal", "thinking", "image_url", "input_audio", "audio_url",
        "video_url", "image_embeds", "audio_embeds", "video_embeds", "image_pil", "uuid",
        "data", "file", "detail", "name", "signature",
    }
)  # fmt: skip
# System text parts starting with this Claude Code attribution line lose that line:
# its value changes every request (vLLM 0.33 strips it to keep prefixes cacheable).
_BILLING_HEADER = "x-anthropic-billing-header"


def conversation(
    messages: Sequence[Mapping[str, Any]], content_format: ContentFormat, template: str
) -> list[dict[str, Any]]:
    """``messages`` as vLLM 0.33 hands them to ``template``."""
    out = [_message(m, content_format) for m in messages]
    for message in out:
        _parse_tool_call_arguments(message)
    if any(m["role"] == "developer" for m in out) and not _mentions_developer(template):
        out = _developer_as_system(out)
    return out


def _message(message: Mapping[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    role = message.get("role")
    if not isinstance(role, str):
        raise ChatTemplateError("every message needs a string 'role'")
    content = message.get("content")
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise ChatTemplateError(f"a {role} message's content must be a string or a list of parts")
    if role == "system":
        parts = _without_billing_header(parts)
    texts = [_part(p, content_format) for p in parts]
    texts = [t for t in texts if t is not None]
    result: dict[str, Any] = {"role": role}
    if content_format == "openai":
        result["content"] = texts
    else:
        result["content"] = "\n".join(texts)
    reasoning = message.get("reasoning")
    if role == "assistant":
        if message.get("tool_calls") is not None:
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise ChatTemplateError("assistant tool_calls must be a list")
            result["tool_calls"] = [dict(c) if isinstance(c, Mapping) else c for c in calls]
        if reasoning is not None:
            result["reasoning"] = reasoning
            result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(result["content"], list):
            result["content"] = "\n".join(p["text"] for p in result["content"])
    if isinstance(message.get("name"), str):
        result["name"] = message["name"]
    if isinstance(message.get("task"), str):
        result["task"] = message["task"]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def without_media(messages: Sequence[Any]) -> list[Any]:
    """``messages`` with each media part cut down to its ``type``: all that routing reads
    of it (that it is there), without its payload (a ``data:`` URL may be megabytes)."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(_is_media(p) for p in content):
            parts = [{"type": p["type"]} if _is_media(p) else p for p in content]
            message = {**message, "content": parts}
        out.append(message)
    return out


def refuse_media(messages: Sequence[Any]) -> None:
    """MultimodalContent for the first media part in ``messages``: what a request holding
    one is, whatever else it holds, and found without a tokenizer or rendering."""
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        for part in content if isinstance(content, list) else ():
            if _is_media(part):
                raise _multimodal(part["type"])


def _multimodal(kind: str) -> MultimodalContent:
    return MultimodalContent(
        f"content part of type {kind!r} is multimodal: kvindex cannot compute the blocks "
        "of such a prompt (the engine's processor makes the media's tokens and hashes the "
        "media into their blocks); route it with /route or the gateway, which route it by "
        "load (reason fallback_multimodal)"
    )


def _is_media(part: Any) -> bool:
    kind = part.get("type") if isinstance(part, Mapping) else None
    return isinstance(kind, str) and kind in _MEDIA_PARTS


def _part(part: Any, content_format: ContentFormat) -> Any:
    if isinstance(part, str):
        return {"type": "text", "text": part} if content_format == "openai" else part
    if not isinstance(part, Mapping):
        raise ChatTemplateError("a content part must be a string or an object")
    kind = part.get("type")
    key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if key is None and _is_media(part):
        raise _multimodal(kind)
    if key is None:
        raise Untokenizable(
            f"content part of type {kind!r} is not supported: kvindex scores text "
            "conversations (text, input_text, output_text, refusal, thinking parts)"
        )
    text = part.get(key)
    if text is None:
        return None  # vLLM skips text parts without text
    if not isinstance(text, str):
        raise ChatTemplateError(f"a {kind} part's {key!r} must be a string")
    if content_format == "string":
        return text
    wrapped: dict[str, Any] = {"type": "text", "text": text}
    wrapped.update({k: v for k, v in part.items() if k not in _KNOWN_PART_FIELDS})
    return wrapped


def _without_billing_header(parts: list[Any]) -> list[Any]:
    out = []
    for part in parts:
        text = part if isinstance(part, str) else None
        if isinstance(part, Mapping) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _parse_tool_call_arguments(message: dict[str, Any]) -> None:
    if message["role"] != "assistant" or "tool_calls" not in message:
        return
    calls = message["tool_calls"]
    if not calls:
        del message["tool_calls"]
        return
    parsed_calls = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, Mapping) or call.get("type", "function") != "function":
            raise ChatTemplateError("assistant tool_calls must be objects of type 'function'")
        function = dict(function)
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
        elif isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except json.JSONDecodeError:
                decoded = None  # vLLM coerces malformed history to {} to keep it usable
            function["arguments"] = decoded if isinstance(decoded, dict) else {}
        elif not isinstance(arguments, Mapping):
            function["arguments"] = {}
        parsed_calls.append({**call, "function": function})
    message["tool_calls"] = parsed_calls


def _mentions_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    converted = []
    for message in messages:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        converted.append(message)
    systems: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or i > 0 or bool(systems)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, Mapping) else p
                for p in content
                if isinstance(p, str) or (isinstance(p, Mapping) and "text" in p)
            )
        if content:
            systems.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(systems)}, *others]


def vllm_tools(tools: Sequence[Any]) -> list[dict[str, Any]]:
    """``tools`` as vLLM 0.33's ``ChatCompletionToolsParam.model_dump()`` hands them to the
    template: unknown fields dropped, absent ``description``/``parameters`` as null,
    ``strict`` and ``defer_loading`` only when set."""
    out = []
    for tool in tools:
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            raise ChatTemplateError("each tool must be an object with a 'function' object")
        if tool.get("type", "function") != "function":
            raise ChatTemplateError("only tools of type 'function' are supported")
        function = tool["function"]
        if not isinstance(function.get("name"), str):
            raise ChatTemplateError("each tool function needs a string 'name'")
        defer = function.get("defer_loading")
        if defer is None:
            defer = tool.get("defer_loading")
        dumped: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        if function.get("strict") is not None:
            dumped["strict"] = function["strict"]
        if defer is not None:
            dumped["defer_loading"] = defer
        entry: dict[str, Any] = {"type": "function", "function": dumped}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        out.append(entry)
    return out


def detect_content_format(template: str) -> ContentFormat:
    """The content format vLLM 0.33 picks for ``template``: "openai" when the template
    loops over a message's ``content`` (it expects a list of parts), else "string".

    vLLM answers this from the template's syntax tree, by these rules, applied here to
    the same tree: the names that hold the message list (``messages``, and whatever is
    ``set`` from it, sliced or filtered, including ``namespace`` attributes); the loop
    variables over those lists (the messages); then "openai" if any ``for`` iterates a
    message's ``content``, a macro parameter that a call fills with a message's
    ``content``, or, outside macros, a variable named ``content``.
    """
    import jinja2.nodes as n

    from kvindex.scoring.prompt.chat_template import environment

    try:
        tree = environment().parse(template)
    except Exception:
        return "string"
    message_lists = _aliases(tree, "messages")
    messages = set()
    for loop in tree.find_all(n.For):
        if isinstance(loop.target, n.Name) and any(
            _access(loop.iter, name) for name in message_lists
        ):
            messages.add(loop.target.name)

    def reads_content(node: Any) -> bool:
        return any(_access(node, name, "content") for name in messages)

    in_macros: set[int] = set()
    for macro in tree.find_all(n.Macro):
        params = [arg.name for arg in macro.args]
        content_params = set()
        for call in tree.find_all(n.Call):
            if not (isinstance(call.node, n.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and reads_content(arg):
                    content_params.add(params[i])
            for keyword in call.kwargs:
                if keyword.key in params and reads_content(keyword.value):
                    content_params.add(keyword.key)
        for loop in macro.find_all(n.For):
            in_macros.add(id(loop))
            if isinstance(loop.iter, n.Name) and loop.iter.name in content_params:
                return "openai"
    for loop in tree.find_all(n.For):
        if reads_content(loop.iter):
            return "openai"
        outside_macros = id(loop) not in in_macros
        if outside_macros and isinstance(loop.iter, n.Name) and loop.iter.name == "content":
            return "openai"
    return "string"


def _aliases(tree: Any, root: str) -> set[str]:
    """``root`` and every name assigned from it (``x = root[1:]``, ``ns.x = root``,
    ``ns = namespace(x=root)``), transitively; namespace attributes as ``ns.x``."""
    import jinja2.nodes as n

    found = {root}
    pending = [root]
    while pending:
        current = pending.pop()
        for assign in tree.find_all(n.Assign):
            target, value = assign.target, assign.node
            new: list[str] = []
            if isinstance(target, n.Name) and _access(value, current):
                new.append(target.name)
            if (
                isinstance(target, n.Name)
                and isinstance(value, n.Call)
                and isinstance(value.node, n.Name)
                and value.node.name == "namespace"
            ):
                new += [f"{target.name}.{k.key}" for k in value.kwargs if _access(k.value, current)]
            elif isinstance(target, n.NSRef) and _access(value, current):
                new.append(f"{target.name}.{target.attr}")
            for name in new:
                if name not in found:
                    found.add(name)
                    pending.append(name)
    return found


def _is_name(node: Any, name: str) -> bool:
    """``node`` reads variable ``name``; a dotted name ``ns.x`` is an attribute read."""
    import jinja2.nodes as n

    if isinstance(node, n.Name):
        return node.ctx == "load" and node.name == name
    if isinstance(node, n.Getattr) and "." in name:
        base, _, attr = name.rpartition(".")
        return node.attr == attr and _is_name(node.node, base)
    return False


def _access(node: Any, name: str, key: str | None = None) -> bool:
    """``node`` reads ``name`` (or its ``key`` item/attribute), possibly filtered, tested
    or sliced: ``messages[1:] | reverse`` reads ``messages``."""
    import jinja2.nodes as n

    if isinstance(node, n.Filter) and node.node is not None:
        return _access(node.node, name, key)
    if isinstance(node, n.Test):
        return _access(node.node, name, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _access(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, n.Getitem):
        return isinstance(node.arg, n.Const) and node.arg.value == key and _is_name(node.node, name)
    if isinstance(node, n.Getattr):
        return node.attr == key and _is_name(node.node, name)
    return False

"""Runs under a Python with vLLM installed: vLLM's own conversation rebuild and content
format detection for the cases in a JSON file, written as JSON for
tests/test_conversation_vllm.py to compare with kvindex's.

Input: {"templates": {name: source}, "cases": {name: messages}}.
Output: {"formats": {name: format}, "conversations": {"template|case|format": result}},
where a result is the rebuilt message list, or {"error": text} when vLLM refuses.
"""

import json
import sys
import types

from vllm.renderers.chat_utils.chat_message import parse_chat_messages
from vllm.renderers.hf import (
    _consolidate_system_messages,
    _convert_developer_to_system,
    _detect_content_format,
    _detect_developer_role_support,
)

# parse_chat_messages reads only these model settings for text-only conversations.
model_config = types.SimpleNamespace(
    multimodal_config=None,
    enable_prompt_embeds=False,
    is_multimodal_model=False,
    hf_config=types.SimpleNamespace(model_type="text"),
    model="text-model",
    allowed_local_media_path="",
    allowed_media_domains=None,
)
with open(sys.argv[1], encoding="utf-8") as request_file:
    request = json.load(request_file)
formats, conversations = {}, {}
for template_name, template in request["templates"].items():
    formats[template_name] = _detect_content_format(template, default="string")
    for case_name, messages in request["cases"].items():
        for content_format in ("string", "openai"):
            key = f"{template_name}|{case_name}|{content_format}"
            try:
                fresh = json.loads(json.dumps(messages))  # vLLM edits tool calls in place
                conversation, _, _ = parse_chat_messages(fresh, model_config, content_format)
                if any(m["role"] == "developer" for m in conversation) and not (
                    _detect_developer_role_support(template)
                ):
                    conversation = _consolidate_system_messages(
                        _convert_developer_to_system(conversation)
                    )
                conversations[key] = conversation
            except Exception as exc:  # vLLM refuses this conversation
                conversations[key] = {"error": f"{type(exc).__name__}: {exc}"}
json.dump({"formats": formats, "conversations": conversations}, sys.stdout, ensure_ascii=False)

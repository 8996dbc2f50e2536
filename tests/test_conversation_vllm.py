"""kvindex rebuilds chat messages exactly as vLLM 0.33 does, checked against vLLM's own
code: every case here goes through vLLM's ``parse_chat_messages`` and content-format
detection in a Python that has vLLM (``$KVTEST_VLLM_PYTHON``, else the checkout's ``.venv-vllm``),
and the results must be equal, key order included. Skipped where no vLLM is installed.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvindex.scoring.prompt.chat_template import ChatTemplateError, load_chat_templates
from kvindex.scoring.prompt.conversation import conversation, detect_content_format
from tests.chat_models import FAMILIES, FIXTURES
from tests.support.vllm import vllm_python

# vLLM's own code runs in a subprocess: seconds each, outside the everyday subset.
pytestmark = pytest.mark.slow

CASES: dict[str, list[dict[str, Any]]] = {
    "plain turns": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u <&>"},
        {"role": "assistant", "content": "a"},
    ],
    "content parts": [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                "a plain string part",
                {"type": "input_text", "text": "b"},
                {"type": "output_text", "text": "c"},
            ],
        }
    ],
    "refusal, thinking and empty parts": [
        {
            "role": "assistant",
            "content": [
                {"type": "refusal", "refusal": "no"},
                {"type": "thinking", "thinking": "hmm"},
                {"type": "text", "text": None},
            ],
        }
    ],
    "content null and absent": [
        {"role": "user", "content": None},
        {"role": "assistant"},
    ],
    "tool results as parts": [
        {"role": "tool", "tool_call_id": "t1", "content": [{"type": "text", "text": "x"}, "y"]},
        {"role": "tool", "content": "plain"},
    ],
    "tool call arguments": [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "[1,2]"}},
                {"id": "2", "type": "function", "function": {"name": "g", "arguments": "bad"}},
                {"id": "3", "type": "function", "function": {"name": "h", "arguments": {"z": 1}}},
                {"id": "4", "type": "function", "function": {"name": "i"}},
                {"id": "5", "function": {"name": "j", "arguments": '{"b": 1, "a": "ü<"}'}},
                {"id": "6", "type": "function", "function": {"name": "k", "arguments": ""}},
            ],
        }
    ],
    "empty and null tool calls": [
        {"role": "assistant", "content": "x", "tool_calls": []},
        {"role": "assistant", "content": "y", "tool_calls": None},
    ],
    "reasoning": [
        {"role": "assistant", "content": "4", "reasoning": "add", "reasoning_content": "dropped"},
        {"role": "user", "content": "q", "reasoning": "ignored for users"},
    ],
    "names, tasks and unknown fields": [
        {"role": "user", "content": "x", "name": "bob", "task": "t", "foo": 1},
        {"role": "user", "content": "y", "name": 3},
    ],
    "developer messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": [{"type": "text", "text": "d1"}, "d2"], "tools": [1]},
        {"role": "developer", "content": "d3"},
    ],
    "developer only": [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}],
    "billing header": [
        {"role": "system", "content": "x-anthropic-billing-header: cch=1\nreal system"},
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header"}]},
        {"role": "user", "content": "x-anthropic-billing-header stays for users"},
    ],
}

TEMPLATES = {
    "string": "{% for m in messages %}{{ m.content }}{% endfor %}",
    "developer aware": "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}"
    "{{ m.content }}{% endfor %}",
    "loops over parts": "{% for message in messages %}{% for part in message['content'] %}"
    "{{ part.text }}{% endfor %}{% endfor %}",
    "sliced alias": "{% set rest = messages[1:] %}{% for m in rest %}"
    "{% for p in m.content | list %}{{ p }}{% endfor %}{% endfor %}",
    "namespace alias": "{% set ns = namespace(rest=messages) %}{% for m in ns.rest %}"
    "{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
    "macro parameter": "{% macro r(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ r(m.content) }}{% endfor %}",
    "macro keyword": "{% macro r(x, c=none) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ r(1, c=m['content']) }}{% endfor %}",
    "name content": "{% for m in messages %}{% set content = m.content %}"
    "{% for p in content %}{{ p }}{% endfor %}{% endfor %}",
    "set from content": "{% for m in messages %}{% set c = m.content %}"
    "{% for p in c %}{{ p }}{% endfor %}{% endfor %}",
    "content only in an unrelated macro": "{% macro r(content) %}{% for p in content %}{{ p }}"
    "{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.other) }}{% endfor %}",
    "reversed and sliced": "{% for m in messages | reverse %}{% for p in m['content'][1:] %}"
    "{{ p }}{% endfor %}{% endfor %}",
}
for family in FAMILIES:
    TEMPLATES[f"fixture {family}"] = load_chat_templates(FIXTURES / family).select(None)


def _vllm_results(tmp_path: Path) -> dict[str, Any]:
    python = vllm_python()
    if python is None or not Path(python).is_file():
        pytest.skip(f"no vLLM Python at {python} (set KVTEST_VLLM_PYTHON)")
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"templates": TEMPLATES, "cases": CASES}), encoding="utf-8")
    script = Path(__file__).parent / "vllm_side" / "conversation.py"
    done = subprocess.run(
        [python, str(script), str(request)], capture_output=True, timeout=240, text=True
    )
    if done.returncode != 0 and "Error: No module named" in done.stderr:
        pytest.skip(f"vLLM does not import under {python}: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_conversations_and_content_formats_match_vllm(tmp_path: Path) -> None:
    theirs = _vllm_results(tmp_path)
    for name, template in TEMPLATES.items():
        assert detect_content_format(template) == theirs["formats"][name], name
        for case, messages in CASES.items():
            for content_format in ("string", "openai"):
                expected = theirs["conversations"][f"{name}|{case}|{content_format}"]
                try:
                    ours = conversation(copy.deepcopy(messages), content_format, template)
                except ChatTemplateError as exc:
                    assert "error" in expected, (name, case, content_format, str(exc))
                    continue
                assert not (isinstance(expected, dict) and "error" in expected), expected
                # equal as JSON text: the same keys in the same order, as templates see them
                assert json.dumps(ours, ensure_ascii=False) == json.dumps(
                    expected, ensure_ascii=False
                ), (name, case, content_format)

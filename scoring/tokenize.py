"""Prompt text and chat messages to token ids, with the model's own tokenizer.

Gateways often have only text. A score is only right if the text becomes exactly the
tokens the engine will see, so kvindex uses the model's own ``tokenizer.json`` (the
``tokenizers`` library, the optional ``tokenize`` extra) and renders chat messages with
the model's own chat template from ``tokenizer_config.json`` (jinja2), the way vLLM
does: a completion prompt is encoded with special tokens added, a rendered chat prompt
without (its template already holds them).

Nothing is downloaded at run time: a tokenizer comes from a configured local directory,
or from the local Hugging Face cache (``$HF_HUB_CACHE`` or ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``) when the model name is a hub id.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TokenizerUnavailable(LookupError):
    """No tokenizer can be loaded for a model; the message says what to set."""


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str


class ModelTokenizer:
    """One model's tokenizer and chat template."""

    def __init__(self, model: str, directory: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - depends on the install
            raise TokenizerUnavailable(
                "text prompts need the optional tokenizer support: pip install 'kvindex[tokenize]'"
            ) from None
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerUnavailable(f"model {model!r}: no tokenizer.json in {directory}")
        self.model = model
        self.directory = directory
        self._tokenizer = Tokenizer.from_file(str(path))
        self._template = _load_chat_template(directory)
        self._compiled: Any = None

    def encode_prompt(self, prompt: str) -> list[int]:
        return self._tokenizer.encode(prompt, add_special_tokens=True).ids

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        text = self.render_chat(messages)
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if self._template is None:
            raise TokenizerUnavailable(
                f"model {self.model!r}: tokenizer_config.json in {self.directory} has no "
                "chat_template; send token_ids or prompt instead of messages"
            )
        if self._compiled is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._compiled = env.from_string(self._template.source)
        return self._compiled.render(
            messages=list(messages),
            add_generation_prompt=True,
            bos_token=self._template.bos_token,
            eos_token=self._template.eos_token,
        )


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template refused the messages: {message}")


def _load_chat_template(directory: Path) -> ChatTemplate | None:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if not source and (directory / "chat_template.jinja").is_file():
        source = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(
        source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    )


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else ""


def hub_cache_dirs() -> list[Path]:
    """Where a local Hugging Face cache may live, most specific first."""
    out = []
    if os.environ.get("HF_HUB_CACHE"):
        out.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        out.append(Path(os.environ["HF_HOME"]) / "hub")
    out.append(Path.home() / ".cache" / "huggingface" / "hub")
    return out


def find_in_hub_cache(model: str) -> Path | None:
    """The newest cached snapshot of hub id ``model`` that holds a tokenizer.json."""
    if "/" not in model:
        return None
    folder = "models--" + model.replace("/", "--")
    for cache in hub_cache_dirs():
        snapshots = cache / folder / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = cache / folder / "refs" / "main"
        if ref.is_file():
            pinned = snapshots / ref.read_text().strip()
            if (pinned / "tokenizer.json").is_file():
                return pinned
        candidates = sorted(
            (p for p in snapshots.iterdir() if (p / "tokenizer.json").is_file()),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        if candidates:
            return candidates[0]
    return None


class TokenizerRegistry:
    """Loads each model's tokenizer once, on first use, from its configured directory or
    the local hub cache."""

    def __init__(self, directories: Mapping[str, str] | None = None) -> None:
        self._directories = dict(directories or {})
        self._loaded: dict[str, ModelTokenizer] = {}
        self._lock = threading.Lock()

    def get(self, model: str) -> ModelTokenizer:
        tokenizer = self._loaded.get(model)
        if tokenizer is not None:
            return tokenizer
        with self._lock:
            tokenizer = self._loaded.get(model)
            if tokenizer is None:
                tokenizer = ModelTokenizer(model, self._directory_for(model))
                self._loaded[model] = tokenizer
            return tokenizer

    def _directory_for(self, model: str) -> Path:
        configured = self._directories.get(model)
        if configured:
            directory = Path(configured).expanduser()
            if not directory.is_dir():
                raise TokenizerUnavailable(
                    f"model {model!r}: tokenizer directory {directory} does not exist; fix "
                    "`tokenizer` for this model in the model config"
                )
            return directory
        cached = find_in_hub_cache(model)
        if cached is None:
            raise TokenizerUnavailable(
                f"no tokenizer for model {model!r}: set `tokenizer: <dir with tokenizer.json>` "
                "for it in the model config (--model-config), or place it in the local "
                "Hugging Face cache; kvindex never downloads at run time. Sending token_ids "
                "needs no tokenizer."
            )
        return cached

"""Prompt text and chat messages to token ids, with the model's own tokenizer.

A score is only right if the text becomes exactly the tokens the engine will see, so
kvindex uses the model's own ``tokenizer.json`` (the ``tokenizers`` library, the optional
``tokenize`` extra) and renders chat messages as vLLM 0.33 does (:mod:`.conversation`,
:mod:`.chat_template`). A completion prompt is encoded with special tokens added, a
rendered chat prompt without (its template holds them). Nothing is downloaded at run
time: a tokenizer comes from a configured local directory, or from the local Hugging
Face cache when the model name is a hub id.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvindex.events.errors import Unavailable
from kvindex.scoring.prompt.chat_template import (
    ChatTemplateError,
    ContentFormat,
    load_chat_templates,
    render,
)
from kvindex.scoring.prompt.conversation import conversation, detect_content_format, vllm_tools


class TokenizerUnavailable(Unavailable, LookupError):
    """No tokenizer can be loaded for a model; the message says what to set."""

    code = "tokenizer_unavailable"


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a chat request asks vLLM to render its messages (vLLM 0.33's chat completion
    fields of the same names, with the same defaults)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Sequence[Mapping[str, Any]] | None = None
    documents: Sequence[Mapping[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None


# Keywords vLLM 0.33 refuses in chat_template_kwargs (it picks the template and
# tokenizes itself), plus the conversation, which the request gives as `messages`.
_RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "messages", "conversation"})


class ModelTokenizer:
    """One model's tokenizer and chat templates."""

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
        self._templates = load_chat_templates(directory)
        self._formats: dict[str, ContentFormat] = {}

    def encode_prompt(self, prompt: str) -> list[int]:
        return self._tokenizer.encode(prompt, add_special_tokens=True).ids

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], options: ChatOptions | None = None
    ) -> list[int]:
        """The token ids vLLM feeds the engine for this chat request: the rendered text
        encoded without added special tokens (the template holds them)."""
        text = self.render_chat(messages, options)
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], options: ChatOptions | None = None
    ) -> str:
        """The prompt text vLLM 0.33 renders for ``messages``; raises ChatTemplateError
        when the request or the template refuses."""
        options = options or ChatOptions()
        if self._templates is None:
            raise TokenizerUnavailable(
                f"model {self.model!r}: {self.directory} has no chat template "
                "(tokenizer_config.json chat_template or chat_template.jinja); send "
                "token_ids or prompt instead of messages"
            )
        kwargs = dict(options.chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        # The request's own fields win over the same names in chat_template_kwargs.
        kwargs.pop("add_generation_prompt", None)
        kwargs.pop("continue_final_message", None)
        tools = kwargs.pop("tools", None)
        if options.tools is not None:  # vLLM rebuilds the request's tools, not these
            tools = vllm_tools(options.tools)
        documents = kwargs.pop("documents", None)
        if options.documents is not None:
            documents = options.documents
        template = self._templates.select(tools)
        content_format = self._formats.get(template)
        if content_format is None:
            content_format = self._formats[template] = detect_content_format(template)
        chat = conversation(messages, content_format, template)
        return render(
            template,
            chat,
            special_tokens=self._templates.special_tokens,
            tools=tools,
            documents=documents,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **kwargs,
        )


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

    def unusable(self, models: Sequence[str]) -> dict[str, str]:
        """Each of ``models`` whose tokenizer does not load, with why. Loads the others,
        so a service checking its configured models at startup also warms them."""
        problems = {}
        for model in models:
            try:
                self.get(model)
            except TokenizerUnavailable as exc:
                problems[model] = exc.detail
            except Exception as exc:  # a tokenizer.json the tokenizers library refuses
                problems[model] = f"model {model!r}: its tokenizer.json does not load: {exc}"
        return problems

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

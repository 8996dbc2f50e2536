"""Model directories for chat tests: a published tokenizer config and chat template from
tests/fixtures/tokenizers/ plus a small tokenizer.json built to match it (the published
ones are tens of MB; see that folder's README)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
FAMILIES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())

# Text a byte-level vocabulary is trained on, so common words become single tokens.
_CORPUS = [
    "Hello! What is a KV cache? You are terse. Answer in one line.",
    "Name a prime. Seven. Another one? Eleven. Count: 1, 2, 3",
    "héllo 你好 🚀 Привет — ½ ß Zürich Wetter für eine Stadt",
    '<script>alert(\'x\') & "y"</script> a > b < c {"city": "Zürich"}',
    "system user assistant tool developer reasoning analysis final commentary",
]


def model_directory(family: str, parent: Path) -> Path:
    """A copy of fixture ``family`` under ``parent`` with a tokenizer.json."""
    directory = parent / family
    shutil.copytree(FIXTURES / family, directory)
    _build_tokenizer_json(directory)
    return directory


def _added_tokens(config: dict[str, Any]) -> dict[int, str]:
    decoder = config.get("added_tokens_decoder", {})
    tokens = {int(i): entry["content"] for i, entry in decoder.items()}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value not in tokens.values():
            tokens[max(tokens, default=-1) + 1] = value
    return tokens


def _build_tokenizer_json(directory: Path) -> None:
    """A small tokenizer.json of the config's own tokenizer class, as a real checkpoint's
    would be: the class's pipeline, the special tokens at their published ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = _added_tokens(config)
    class_name = config.get("tokenizer_class", "PreTrainedTokenizerFast").removesuffix("Fast")
    if class_name in ("PreTrainedTokenizer", "TokenizersBackend"):
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=[added[i] for i in sorted(added)],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train_from_iterator(_CORPUS * 3, trainer)
        tokenizer.save(str(directory / "tokenizer.json"))
        return
    # A class that rebuilds its own pipeline (Llama, Gemma): give it a vocabulary with
    # the special tokens at their ids, every byte (byte fallback) and some characters.
    vocab = {text: i for i, text in added.items()}
    for text in [f"<0x{b:02X}>" for b in range(256)] + ["▁", *"abcdefghijklmnopqrstuvwxyz"]:
        vocab.setdefault(text, max(vocab.values(), default=-1) + 1)
    cls = tokenizer_class_from_name(class_name)
    names = {
        k: (v.get("content") if isinstance(v, dict) else v)
        for k, v in config.items()
        if k in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    options = {k: config[k] for k in ("legacy", "add_prefix_space") if k in config}
    built = cls(vocab=vocab, merges=[], **options, **{k: v for k, v in names.items() if v})
    backend = built.backend_tokenizer
    backend.add_special_tokens([AddedToken(added[i], special=True) for i in sorted(added)])
    backend.save(str(directory / "tokenizer.json"))

"""``kvindex score``: ask a running kvindex which pods hold a prompt, as a table."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any


class UsageError(Exception):
    """A command-line mistake: one line on stderr, exit status 2."""


def _token_ids(values: Sequence[Any], where: str) -> list[int]:
    ids = []
    for value in values:
        text = str(value).strip()
        if isinstance(value, bool) or not (text.isascii() and text.isdigit()):
            raise UsageError(f"{where}: {value!r} is not a token id (a number >= 0)")
        ids.append(int(text))
    return ids


def _read_tokens(args: argparse.Namespace) -> dict[str, Any]:
    if args.tokens is not None:
        return {"token_ids": _token_ids(args.tokens.replace(",", " ").split(), "--tokens")}
    try:
        if args.token_file is not None:
            with open(args.token_file, encoding="utf-8") as handle:
                text = handle.read()
            if text.lstrip().startswith("["):
                data = json.loads(text)
            else:
                data = text.replace(",", " ").split()
            return {"token_ids": _token_ids(data, args.token_file)}
        if args.prompt is not None:
            return {"prompt": args.prompt}
        with open(args.messages_file, encoding="utf-8") as handle:
            return {"messages": json.load(handle)}
    except OSError as exc:
        raise UsageError(f"cannot read {exc.filename}: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(
            f"{args.token_file or args.messages_file} is not valid JSON: {exc}"
        ) from None


def run_score(args: argparse.Namespace) -> int:
    import msgspec

    from kvindex.api.client import Client, KvindexClientError, Unreachable

    body: dict[str, Any] = {"model": args.model, **_read_tokens(args)}
    if args.pod:
        body["pods"] = args.pod
    if args.lora_name:
        body["lora_name"] = args.lora_name
    if args.cache_salt:
        body["cache_salt"] = args.cache_salt
    try:
        with Client(args.url, timeout=args.timeout) as client:
            answer = msgspec.to_builtins(client.score(**body))
    except Unreachable as exc:
        print(f"kvindex score: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    except KvindexClientError as exc:  # ApiError: the server refused
        print(f"kvindex score: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    print(format_score_table(answer))
    return 0


def format_score_table(answer: dict[str, Any]) -> str:
    """A /score answer as a table a human reads in a terminal."""
    lines = [
        f"model {answer['model']}  block size {answer['block_size']}  prompt "
        f"{answer['prompt_tokens']} tokens = {answer['prompt_blocks']} full blocks"
    ]
    header = ("POD", "MATCHED", "TOKENS", "HIT%", "GPU", "CPU", "STORAGE", "SCORE")
    rows = [header]
    blocks = max(answer["prompt_blocks"], 1)
    for pod in answer["pods"]:
        rows.append(
            (
                pod["pod"],
                str(pod["matched_blocks"]),
                str(pod["matched_tokens"]),
                f"{100.0 * pod['matched_blocks'] / blocks:.1f}",
                str(pod["gpu_blocks"]),
                str(pod["cpu_blocks"]),
                str(pod["storage_blocks"]),
                f"{pod['score']:g}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    if len(rows) == 1:
        lines.append("(no pod holds any block of this prompt)")
    for warning in answer.get("warnings", []):
        lines.append(f"warning: {warning}")
    return "\n".join(lines)

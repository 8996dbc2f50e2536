"""``kvindex``: serve the index, query it, record and replay engine event traffic.

Every ``serve`` option can also be set as ``KVINDEX_<NAME>`` (``--zmq-bind`` is
``KVINDEX_ZMQ_BIND``; repeatable options take a comma-separated list there). A flag
beats its environment variable.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import msgspec

from kvindex.api.config import ConfigError, Settings, split_listen
from kvindex.api.version import VERSION
from kvindex.indexer.keys import ExtraKeyStyle, HashAlgo
from kvindex.indexer.models import KeyMode

log = logging.getLogger("kvindex")

_SERVE_OPTIONS: list[tuple[str, dict[str, Any]]] = [
    (
        "--listen",
        {
            "help": "HTTP address HOST:PORT (default 127.0.0.1:8080; the container image "
            "and the manifests set 0.0.0.0:8080)"
        },
    ),
    (
        "--zmq-bind",
        {
            "action": "append",
            "metavar": "ENDPOINT",
            "help": "bind a SUB socket pods' publishers connect to, e.g. tcp://*:5557 "
            "(pods publish with topic kv@<pod-ip:port>@<model>); repeatable",
        },
    ),
    (
        "--zmq-connect",
        {
            "action": "append",
            "metavar": "[POD[@MODEL]=]ENDPOINT[;replay=REPLAY]",
            "help": "connect to a pod's publisher, e.g. tcp://10.0.0.5:5557; the pod "
            "and model come from a kv@<pod>@<model> topic, else from POD@MODEL=, "
            "else from the endpoint host with --serving-port and --model; "
            "';replay=tcp://HOST:RPORT' names its replay endpoint; repeatable",
        },
    ),
    ("--topic-filter", {"help": "bind-mode topic prefix to subscribe to (default kv@)"}),
    (
        "--serving-port",
        {
            "type": int,
            "help": "pods' HTTP serving port, for addresses given without one (default 8000)",
        },
    ),
    ("--model", {"help": "model name for connect-mode pods whose topic names none"}),
    (
        "--replay-port",
        {
            "type": int,
            "help": "pods' replay port (replay_endpoint of "
            "--kv-events-config); 0 = no replay (default)",
        },
    ),
    (
        "--stream-queue",
        {
            "type": int,
            "help": "batches waiting per engine stream before the newest is dropped "
            "(and fetched again by replay); raise it if queue_overflow is counted "
            "(default 4096)",
        },
    ),
    (
        "--replay-endpoint",
        {
            "action": "append",
            "metavar": "POD=tcp://HOST:RPORT",
            "help": "one pod's own replay endpoint (its rank r uses RPORT + r); beats "
            "--replay-port, needed when engines share a host; repeatable",
        },
    ),
    (
        "--bind-allow",
        {
            "action": "append",
            "metavar": "POD|CIDR",
            "help": "bind mode: a pod (or a CIDR of pod hosts) whose topic may come from "
            "any sender address, e.g. behind NAT; others must send from their own host; "
            "repeatable",
        },
    ),
    (
        "--max-streams-per-sender",
        {
            "type": int,
            "help": "bind mode: most streams (pod, DP rank) one sender address may open "
            "(default 64)",
        },
    ),
    ("--backend", {"help": "memory (default) or redis://HOST:PORT/DB"}),
    (
        "--capacity-blocks",
        {
            "type": int,
            "help": "memory backend: most distinct blocks kept; "
            "oldest-stored evicted beyond (default unbounded)",
        },
    ),
    (
        "--snapshot",
        {
            "metavar": "PATH",
            "help": "memory backend: save the index to PATH periodically and at shutdown, "
            "restore it at start and resume every pod's stream from it (default off)",
        },
    ),
    (
        "--snapshot-interval",
        {"type": float, "metavar": "SECONDS", "help": "seconds between snapshots (default 60)"},
    ),
    (
        "--hash-algo",
        {
            "choices": [a.value for a in HashAlgo],
            "help": "pods' --prefix-caching-hash-algo (default sha256)",
        },
    ),
    ("--hash-seed", {"help": "pods' PYTHONHASHSEED, if set (default: unset)"}),
    ("--block-size", {"type": int, "help": "pods' KV block size in tokens (default 16)"}),
    (
        "--extra-key-style",
        {
            "choices": [s.value for s in ExtraKeyStyle],
            "help": "LoRA/salt hash keys: tagged for vLLM >= 0.31 (default), bare for older",
        },
    ),
    (
        "--key-mode",
        {
            "choices": [m.value for m in KeyMode],
            "help": "engine (default): index the pods' own hashes; tokens: kvindex's own "
            "chain over token ids, for pods whose hashes can't be reproduced",
        },
    ),
    ("--model-config", {"metavar": "FILE", "help": "per-model settings (YAML, JSON or TOML)"}),
    (
        "--admin-token-file",
        {
            "metavar": "FILE",
            "help": "file holding the bearer token DELETE /index/pods/{pod} needs (or set "
            "KVINDEX_ADMIN_TOKEN); without one the operator endpoints answer 403",
        },
    ),
    ("--max-prompt-tokens", {"type": int, "help": "largest prompt /score accepts (262144)"}),
    ("--max-prompt-chars", {"type": int, "help": "largest text prompt /score accepts (4000000)"}),
    ("--log-format", {"choices": ["text", "json"], "help": "log line format (default text)"}),
    ("--log-level", {"choices": ["debug", "info", "warning", "error"], "help": "default info"}),
    ("--redis-prefix", {"help": "prefix of every Redis key (default kvindex)"}),
    (
        "--replica-id",
        {"help": "redis backend: this replica's name in stream leases (default hostname:pid)"},
    ),
    (
        "--lease-ttl",
        {
            "type": int,
            "help": "redis backend: seconds before a dead replica's streams are taken over "
            "by another (default 5)",
        },
    ),
    (
        "--k8s-namespace",
        {
            "action": "append",
            "metavar": "NAMESPACE",
            "help": "discover vLLM pods in this Kubernetes namespace (repeatable); "
            "needs get/list/watch on pods there",
        },
    ),
    ("--k8s-selector", {"help": "label selector of the vLLM pods (kvindex.io/enabled=true)"}),
    (
        "--k8s-mode",
        {
            "choices": ["connect", "bind"],
            "help": "connect (default): connect to each discovered pod; bind: pods connect "
            "to --zmq-bind, discovery only names and forgets them",
        },
    ),
    (
        "--k8s-grace-seconds",
        {"type": int, "help": "forget a pod not ready for this long (default 30)"},
    ),
    ("--k8s-resync-seconds", {"type": int, "help": "full relist period (default 300)"}),
    (
        "--k8s-events-port",
        {"type": int, "help": "pods' events port without annotation/named port (5557)"},
    ),
    (
        "--k8s-replay-port",
        {"type": int, "help": "pods' replay port likewise; 0 = none (default 5558)"},
    ),
    ("--max-body-bytes", {"type": int, "help": "largest HTTP request body (16777216)"}),
    ("--max-pods", {"type": int, "help": "most candidate pods in one /score request (4096)"}),
    (
        "--max-in-flight",
        {"type": int, "help": "requests handled at once; more get 429 (default 1024)"},
    ),
    (
        "--header-timeout",
        {"type": float, "help": "seconds a client may take to send its headers (10)"},
    ),
    ("--body-timeout", {"type": float, "help": "seconds a client may take to send a body (30)"}),
    (
        "--keep-alive-timeout",
        {"type": float, "help": "seconds an idle keep-alive connection stays open (5)"},
    ),
]


_SERVE_OPTIONS += [
    (
        "--load-interval",
        {
            "type": float,
            "metavar": "SECONDS",
            "help": "/route: seconds between scrapes of every pod's vLLM /metrics (default 1); "
            "a pod not scraped for 3 intervals has unknown load",
        },
    ),
    (
        "--load-timeout",
        {"type": float, "metavar": "SECONDS", "help": "/route: one scrape's timeout (0.5)"},
    ),
    (
        "--route-ttl",
        {
            "type": float,
            "metavar": "SECONDS",
            "help": "/route: a routed request counts against its pod until "
            "POST /route/{id}/done or this many seconds (default 120)",
        },
    ),
    (
        "--max-kv-usage",
        {
            "type": float,
            "help": "/route: never choose a pod whose KV cache usage (fullest engine) is "
            "above this fraction (default 0.95)",
        },
    ),
    (
        "--max-waiting",
        {
            "type": int,
            "help": "/route: never choose a pod with more requests waiting; 0 = no limit "
            "(default)",
        },
    ),
]


def _settings_from(args: argparse.Namespace, environ: dict[str, str]) -> Settings:
    values: dict[str, Any] = {}
    for flag, spec in _SERVE_OPTIONS:
        name = flag[2:].replace("-", "_")
        value = getattr(args, name)
        if value is None:
            raw = environ.get(f"KVINDEX_{name.upper()}")
            if raw is None or raw == "":
                continue
            if spec.get("action") == "append":
                value = [part for part in raw.replace("\n", ",").split(",") if part.strip()]
            elif spec.get("type") in (int, float):
                try:
                    value = spec["type"](raw)
                except ValueError:
                    raise ConfigError(f"KVINDEX_{name.upper()}={raw!r} is not a number") from None
            else:
                value = raw
        values[name] = value
    # The token itself only from the environment (a Secret): a flag's value is
    # visible to every local user in /proc/<pid>/cmdline.
    values["admin_token"] = environ.get("KVINDEX_ADMIN_TOKEN") or None
    try:
        return msgspec.convert(values, Settings)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None


def _serve(args: argparse.Namespace) -> int:
    from kvindex.api.app import create_app
    from kvindex.api.config import check_limits
    from kvindex.api.logs import setup_logging
    from kvindex.api.server import ListenError, bind, serve
    from kvindex.api.service import Service

    if args.admin_token is not None:
        raise ConfigError(
            "--admin-token was removed: a flag's value is visible to every local user in "
            "/proc/<pid>/cmdline; set KVINDEX_ADMIN_TOKEN or --admin-token-file FILE"
        )
    environ = dict(os.environ)
    settings = _settings_from(args, environ)
    setup_logging(settings.log_format, settings.log_level)
    for name in unknown_variables(environ):
        log.warning("%s is not a kvindex setting; ignored (kvindex serve --help lists them)", name)
    check_limits(settings)
    host, port = split_listen(settings.listen)
    service = Service(settings)
    try:
        sock = bind(host, port)
    except ListenError as exc:
        raise ConfigError(f"--listen {settings.listen}: {exc}") from None
    try:
        service.start()  # before serving: a ZMQ port in use is one line, not a traceback
    except BaseException:
        sock.close()
        raise
    # The app's lifespan stops the service (final snapshot, leases released).
    serve(
        create_app(service),
        sock,
        header_timeout_s=settings.header_timeout,
        keep_alive_timeout_s=settings.keep_alive_timeout,
    )
    return 0


def environment_variables() -> list[str]:
    """Every ``KVINDEX_*`` variable ``kvindex serve`` reads."""
    names = [f"KVINDEX_{flag[2:].replace('-', '_').upper()}" for flag, _ in _SERVE_OPTIONS]
    return sorted({*names, "KVINDEX_ADMIN_TOKEN"})


# Read by other commands and by the test suite, not by serve.
_OTHER_VARIABLES = frozenset({"KVINDEX_URL", "KVINDEX_TEST_REDIS_URL"})


def unknown_variables(environ: dict[str, str]) -> list[str]:
    """``KVINDEX_*`` variables nobody reads: a misspelt one is a setting silently lost."""
    known = set(environment_variables()) | _OTHER_VARIABLES
    return sorted(n for n in environ if n.startswith("KVINDEX_") and n not in known)


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


def _score(args: argparse.Namespace) -> int:
    import httpx

    body: dict[str, Any] = {"model": args.model, **_read_tokens(args)}
    if args.pod:
        body["pods"] = args.pod
    if args.lora_name:
        body["lora_name"] = args.lora_name
    if args.cache_salt:
        body["cache_salt"] = args.cache_salt
    try:
        response = httpx.post(f"{args.url.rstrip('/')}/score", json=body, timeout=args.timeout)
    except httpx.HTTPError as exc:
        print(f"kvindex score: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    if response.status_code != 200:
        print(f"kvindex score: HTTP {response.status_code}: {response.text}", file=sys.stderr)
        return 1
    answer = response.json()
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


def _record(args: argparse.Namespace) -> int:
    from kvindex.events.capture import record

    print(f"recording {args.endpoint} to {args.file} (Ctrl-C to stop)", file=sys.stderr)
    try:
        count = record(args.endpoint, args.file, max_messages=args.count, duration_s=args.duration)
    except KeyboardInterrupt:
        return 0
    print(f"recorded {count} messages", file=sys.stderr)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from kvindex.events.capture import replay_capture

    speed = float("inf") if args.speed == 0 else args.speed
    sent = replay_capture(
        args.file, args.endpoint, speed=speed, wait_for_subscribers=args.wait_for_subscribers
    )
    print(f"published {sent} messages on {args.endpoint}", file=sys.stderr)
    return 0


class UsageError(Exception):
    """A command-line mistake: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that suggests the flag meant when one is mistyped (Python 3.11's does not)."""

    def error(self, message: str) -> NoReturn:
        unknown = re.findall(r"(--[\w-]+)", message) if "unrecognized" in message else []
        flags = _all_flags(self)
        for flag in unknown:
            close = difflib.get_close_matches(flag.split("=")[0], flags, n=1, cutoff=0.6)
            if close:
                message += f" (did you mean {close[0]}?)"
        super().error(message)


def _all_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of a parser and its subcommands (unknown flags of a subcommand
    are reported by the top-level parser)."""
    flags = []
    for action in parser._actions:
        flags += [s for s in action.option_strings if s.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags += _all_flags(sub)
    return flags


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvindex", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"kvindex {VERSION}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = commands.add_parser(
        "serve",
        help="run the index service",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="every option is also an environment variable (a flag beats it):\n  "
        + "\n  ".join(environment_variables())
        + "\nKVINDEX_ADMIN_TOKEN has no flag: a flag's value shows in /proc/<pid>/cmdline.",
    )
    for flag, spec in _SERVE_OPTIONS:
        serve.add_argument(flag, **spec)
    serve.add_argument("--admin-token", help=argparse.SUPPRESS)  # removed; says so
    serve.set_defaults(run=_serve)

    score = commands.add_parser("score", help="ask a running kvindex which pods hold a prompt")
    score.add_argument("--url", default=os.environ.get("KVINDEX_URL", "http://127.0.0.1:8080"))
    score.add_argument("--model", required=True)
    source = score.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", help="token ids, comma or space separated")
    source.add_argument(
        "--token-file", help="file of token ids (JSON list or whitespace separated)"
    )
    source.add_argument("--prompt", help="prompt text (needs the model's tokenizer on the server)")
    source.add_argument("--messages-file", help="JSON file with a list of chat messages")
    score.add_argument("--pod", action="append", help="candidate pod (repeatable)")
    score.add_argument("--lora-name")
    score.add_argument("--cache-salt")
    score.add_argument("--json", action="store_true", help="print the raw JSON answer")
    score.add_argument("--timeout", type=float, default=10.0)
    score.set_defaults(run=_score)

    rec = commands.add_parser("record", help="capture what a KV-event endpoint publishes")
    rec.add_argument("endpoint", help="e.g. tcp://10.0.0.5:5557 (tcp://*:5557 to let pods connect)")
    rec.add_argument("file")
    rec.add_argument("--count", type=int, help="stop after this many messages")
    rec.add_argument("--duration", type=float, help="stop after this many seconds")
    rec.set_defaults(run=_record)

    rep = commands.add_parser("replay", help="publish a capture again, with its original pacing")
    rep.add_argument("file")
    rep.add_argument(
        "endpoint", help="e.g. tcp://*:5557 (kvindex connects) or tcp://127.0.0.1:5557"
    )
    rep.add_argument(
        "--speed", type=float, default=1.0, help="pacing factor; 0 = as fast as possible"
    )
    rep.add_argument(
        "--wait-for-subscribers",
        type=int,
        default=1,
        help="wait for this many subscribers before sending (default 1)",
    )
    rep.set_defaults(run=_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as exc:
        print(f"kvindex: configuration error: {exc}", file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"kvindex {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

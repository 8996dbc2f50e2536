"""``kvindex``: serve the index, query it, record and replay engine event traffic, demo it.

Every ``serve`` option can also be set as ``KVINDEX_<NAME>`` (``--zmq-bind`` is
``KVINDEX_ZMQ_BIND``; repeatable options take a comma-separated list there) and in the
config file by section. A flag beats its environment variable, which beats the file.
The options are generated from the settings tree (:mod:`kvindex.api.serve.settings`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvindex.api.serve import settings_sources as settings_load
from kvindex.api.serve.cli_score import UsageError, format_score_table, run_score
from kvindex.api.serve.settings_derived import ConfigError, Settings, check_limits, split_listen
from kvindex.api.serve.settings_sources import (
    ADMIN_TOKEN_VARIABLE,
    FLAGGED,
    add_serve_flags,
    decode_settings,
    environment_variables,
)
from kvindex.api.version import VERSION, implementations

if TYPE_CHECKING:
    from kvindex.api.serve.service import Service

__all__ = ["build_parser", "format_score_table", "main", "unknown_variables"]

log = logging.getLogger("kvindex")

#: The exit status of a ``kvindex serve`` whose KV-event ingestion stopped (EX_SOFTWARE).
INGEST_STOPPED_EXIT = 70
#: How long a ``kvindex serve`` whose ingestion stopped keeps answering (503 on /healthz,
#: a warning on every /score) before it exits: long enough for a probe or a scrape under
#: way to see why, short beside a liveness probe's minute, so the orchestrator restarts
#: it about as soon as it would a crash.
EXIT_AFTER_INGEST_STOPPED_S = 10.0


def _settings_from(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """The parsed ``serve`` flags over the environment over the config file."""
    flags = {leaf.dest: getattr(args, leaf.dest, None) for leaf in FLAGGED}
    flags.pop("admin_token")  # the removed flag: refused in _serve, never a value
    return decode_settings(flags, environ)


def _serve(args: argparse.Namespace) -> int:
    from kvindex.api.http.app import create_http
    from kvindex.api.http.server import ListenError, bind, serve
    from kvindex.api.serve.logs import setup_logging
    from kvindex.api.serve.service import Service
    from kvindex.api.serve.worker_pool import ServingWorkers, check_processes

    if args.admin_token is not None:
        raise ConfigError(
            "--admin-token was removed: a flag's value is visible to every local user in "
            "/proc/<pid>/cmdline; set KVINDEX_ADMIN_TOKEN or --admin-token-file FILE"
        )
    environ = dict(os.environ)
    settings = _settings_from(args, environ)
    setup_logging(settings.log.format, settings.log.level)
    for name in unknown_variables(environ):
        log.warning("%s is not a kvindex setting; ignored (kvindex serve --help lists them)", name)
    check_limits(settings)
    host, port = split_listen(settings.http.listen)
    processes = settings.http.processes
    check_processes(processes, settings.index.backend)
    service = Service(settings)
    try:
        sock = bind(host, port, reuse_port=processes > 1)
    except ListenError as exc:
        raise ConfigError(f"--listen {settings.http.listen}: {exc}") from None
    workers = None
    sockets = [sock]
    try:
        service.start()  # before serving: a ZMQ port in use is one line, not a traceback
        if processes > 1:  # the index into shared memory, then the workers on the port
            workers = ServingWorkers(service, processes, f"{host}:{port}")
            sockets.append(workers.unix_socket())
    except BaseException:
        sock.close()
        raise
    http = create_http(service)
    app: Any = http.app
    if settings.gateway.enabled:  # the OpenAI endpoints in front of kvindex's own
        from kvindex.api.gateway.app import Gateway
        from kvindex.api.gateway.asgi import GatewayApp

        app = GatewayApp(Gateway.in_process(service), settings, inner=app)
    # A shutdown signal starts the drain (api/http/server.py): readiness fails and the
    # snapshot is written at once; then the app's lifespan stops the service (the final
    # snapshot, the leases released). The lane answers /score and /route from the
    # protocol (api/http/hot_lane.py).
    if workers is not None:
        workers.start()

    def begin_shutdown() -> None:
        service.begin_shutdown()
        if workers is not None:
            workers.shutting_down()

    stop = threading.Event()
    threading.Thread(
        target=_exit_when_ingest_stops,
        args=(service, stop),
        name="kvindex-ingest-watch",
        daemon=True,
    ).start()
    try:
        serve(
            app,
            sockets,
            header_timeout_s=settings.http.header_timeout,
            keep_alive_timeout_s=settings.http.keep_alive_timeout,
            drain_timeout_s=settings.http.drain_timeout,
            lane=http.lane,
            on_exit_signal=begin_shutdown,
            stop=stop,
        )
    finally:
        if workers is not None:
            workers.stop()
    if service.subscriber.failure is not None:
        log.error("exiting with status %d: KV-event ingestion had stopped", INGEST_STOPPED_EXIT)
        return INGEST_STOPPED_EXIT
    return 0


def _exit_when_ingest_stops(service: Service, stop: threading.Event) -> None:
    """When an ingest thread dies, shut down (gracefully) and exit non-zero.

    Exit, not restart the thread: the thread died where nothing expected an error (every
    message's own errors are caught and counted), so the state it shared with the others
    (stream table, inbox, sockets) may be half-updated, and a restarted thread would
    serve it as live. A new process starts from the snapshot or the engines' replay,
    known state; the exit status and the log line tell the orchestrator and the
    operator. Until then /healthz fails and every /score warns."""
    failure = service.subscriber.wait_for_failure()
    log.error(
        "KV-event ingestion stopped (%s): the index no longer follows the pods; /healthz "
        "answers 503 and /score warns; exiting with status %d in %.0fs so the "
        "orchestrator restarts kvindex",
        failure,
        INGEST_STOPPED_EXIT,
        EXIT_AFTER_INGEST_STOPPED_S,
    )
    time.sleep(EXIT_AFTER_INGEST_STOPPED_S)
    stop.set()  # the drain of a shutdown signal; it tells the workers too


# `kvindex gateway` takes these settings of the tree (the rest are the index's).
_GATEWAY_FLAGS = ("listen", "drain_timeout", "model_config", "log_format", "log_level")


def _gateway(args: argparse.Namespace) -> int:
    from kvindex.api.gateway.app import Gateway
    from kvindex.api.gateway.asgi import GatewayApp
    from kvindex.api.http.server import ListenError, bind, serve
    from kvindex.api.serve.logs import setup_logging

    if not args.index:
        raise UsageError("--index URL is required (or set KVINDEX_URL): the kvindex to route with")
    if not args.index.startswith(("http://", "https://")):
        raise UsageError(f"--index {args.index!r}: give the kvindex URL, e.g. http://HOST:8080")
    flags = {dest: getattr(args, dest, None) for dest in _GATEWAY_DESTS}
    settings = decode_settings(flags, dict(os.environ))
    setup_logging(settings.log.format, settings.log.level)
    check_limits(settings)
    host, port = split_listen(settings.http.listen)
    gateway = Gateway.remote(args.index, settings)
    try:
        sock = bind(host, port)
    except ListenError as exc:
        raise ConfigError(f"--listen {settings.http.listen}: {exc}") from None
    log.info("kvindex gateway on %s routing with %s", settings.http.listen, args.index)
    serve(
        GatewayApp(gateway, settings),
        sock,
        header_timeout_s=settings.http.header_timeout,
        keep_alive_timeout_s=settings.http.keep_alive_timeout,
        drain_timeout_s=settings.http.drain_timeout,
    )
    return 0


_GATEWAY_DESTS = [
    leaf.dest
    for leaf in FLAGGED
    if (leaf.dest in _GATEWAY_FLAGS or leaf.section == "gateway")
    and leaf.dest != "gateway_enabled"
    and not leaf.extra.get("env_only")
]


# Read by other commands, or by setup.py when kvindex is built, not by serve.
_OTHER_VARIABLES = frozenset({"KVINDEX_URL", "KVINDEX_PURE_PYTHON"})


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """``KVINDEX_*`` variables nobody reads: a misspelt one is a setting silently lost."""
    return settings_load.unknown_variables(environ, _OTHER_VARIABLES)


def _record(args: argparse.Namespace) -> int:
    from kvindex.events.wire.capture import record

    def recording(endpoint: str) -> None:  # the socket is up and the file open
        print(f"recording {endpoint} to {args.file} (Ctrl-C to stop)", file=sys.stderr)

    try:
        with _capture_errors(args.endpoint):
            count = record(
                args.endpoint,
                args.file,
                max_messages=args.count,
                duration_s=args.duration,
                on_ready=recording,
            )
    except KeyboardInterrupt:
        return 0
    print(f"recorded {count} messages", file=sys.stderr)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from kvindex.events.wire.capture import replay_capture

    if args.speed < 0:
        raise UsageError(f"--speed {args.speed}: give a factor > 0, or 0 for as fast as possible")
    speed = float("inf") if args.speed == 0 else args.speed
    with _capture_errors(args.endpoint):
        sent = replay_capture(
            args.file, args.endpoint, speed=speed, wait_for_subscribers=args.wait_for_subscribers
        )
    print(f"published {sent} messages on {args.endpoint}", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvindex.api.demo import Demo
    from kvindex.api.http.server import exit_cleanly

    # SIGTERM stops the demo as Ctrl-C does, before serving starts too (serve() sets
    # the same handler): the pods, the files and the service are always cleaned up.
    signal.signal(signal.SIGTERM, exit_cleanly)
    demo = Demo(args.port)
    try:
        demo.start()
        status = _serve(build_parser().parse_args(["serve", *demo.serve_flags()]))
    except KeyboardInterrupt:
        status = 0  # Ctrl-C is how a demo ends
    except ConfigError as exc:
        if str(exc).startswith("--listen"):
            raise ConfigError(f"{exc}; choose another port: kvindex demo --port PORT") from None
        raise
    finally:
        demo.close()
    if demo.failure is not None:
        return 1
    print("kvindex demo: stopped", file=sys.stderr)
    return status


@contextlib.contextmanager
def _capture_errors(endpoint: str) -> Iterator[None]:
    """A capture file that cannot be read or written, or an endpoint ZMQ refuses, as one
    line (a UsageError: exit status 2), not a traceback."""
    import zmq

    from kvindex.events.wire.capture import CaptureError

    try:
        yield
    except CaptureError as exc:
        raise UsageError(str(exc)) from None
    except zmq.ZMQError as exc:
        raise UsageError(f"endpoint {endpoint!r}: {exc}") from None
    except OSError as exc:  # the file (no such file, a directory, no permission) or a timeout
        where = f"{exc.filename}: " if exc.filename else ""
        raise UsageError(f"{where}{exc.strerror or exc}") from None


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


class _Version(argparse.Action):
    """``--version`` on one line (argparse's own wraps it at the terminal's width)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> NoReturn:
        print(f"kvindex {VERSION} ({implementations()})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvindex", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action=_Version)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = commands.add_parser(
        "serve",
        help="run the index service",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="every option is also an environment variable (a flag beats it):\n  "
        + "\n  ".join(environment_variables())
        + f"\n{ADMIN_TOKEN_VARIABLE} has no flag: a flag's value shows in /proc/<pid>/cmdline."
        + "\nThe --model-config file may set any of them by section (http, log, events, "
        + "index, k8s, scoring, gateway).",
    )
    add_serve_flags(serve)
    serve.add_argument(  # the short spelling of --gateway-enabled
        "--gateway",
        dest="gateway_enabled",
        action="store_const",
        const=True,
        help=argparse.SUPPRESS,
    )
    serve.add_argument("--admin-token", help=argparse.SUPPRESS)  # removed; says so
    serve.set_defaults(run=_serve)

    gateway = commands.add_parser(
        "gateway",
        help="an OpenAI-compatible front door that routes every request with a kvindex",
    )
    gateway.add_argument(
        "--index",
        default=os.environ.get("KVINDEX_URL"),
        metavar="URL",
        help="the kvindex to ask /route, e.g. http://kvindex:8080 (default $KVINDEX_URL)",
    )
    for leaf in FLAGGED:
        if leaf.dest in _GATEWAY_DESTS:
            gateway.add_argument(leaf.flag, **leaf.argparse_spec())
    gateway.set_defaults(run=_gateway)

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
    score.set_defaults(run=run_score)

    demo = commands.add_parser(
        "demo",
        help="kvindex with three simulated vLLM pods on loopback, and commands to try",
    )
    demo.add_argument(
        "--port", type=int, default=8080, help="kvindex's HTTP port on 127.0.0.1 (default 8080)"
    )
    demo.set_defaults(run=_demo)

    rec = commands.add_parser("record", help="capture what a KV-event endpoint publishes")
    rec.add_argument(
        "endpoint", help="e.g. tcp://127.0.0.2:5557 (tcp://*:5557 to let pods connect)"
    )
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

"""What the service derives from its settings, and the checks that refuse settings
that cannot work, each naming the flag to change.

The settings tree itself is :mod:`kvindex.api.serve.settings`; flags, variables and the
config file are decoded into it by :mod:`kvindex.api.serve.settings_sources`. Per-model settings
in the config file beat the ``index`` ones for that model.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvindex.api.serve.settings import Settings
from kvindex.events.discovery.pods import DiscoveryConfig, DiscoveryMode
from kvindex.indexer.keys import HashConfig, KeyConfigError
from kvindex.indexer.models import HASH_COMPATIBLE, Engine, KeyMode, ModelCatalog, ModelKeying

__all__ = ["ConfigError", "Settings"]


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which setting to fix."""


def admin_token(settings: Settings) -> str | None:
    """The operator token: ``KVINDEX_ADMIN_TOKEN`` or the first line of
    ``--admin-token-file`` (a Kubernetes Secret mounted as a file, say). None means the
    mutating routes are switched off."""
    http = settings.http
    if http.admin_token_file:
        try:
            text = Path(http.admin_token_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"cannot read --admin-token-file {http.admin_token_file}: {exc}"
            ) from None
        token = text.strip()
        if not token:
            raise ConfigError(f"--admin-token-file {http.admin_token_file} is empty")
        return token
    return http.admin_token or None


def check_limits(settings: Settings) -> None:
    """Refuse limits that cannot work, naming the flag."""
    http = settings.http
    for flag, value in (
        ("--max-body-bytes", http.max_body_bytes),
        ("--max-pods", http.max_pods),
        ("--max-in-flight", http.max_in_flight),
        ("--header-timeout", http.header_timeout),
        ("--body-timeout", http.body_timeout),
        ("--keep-alive-timeout", http.keep_alive_timeout),
    ):
        if value <= 0:
            raise ConfigError(f"{flag} {value}: must be positive")


def build_catalog(settings: Settings) -> ModelCatalog:
    """Per-model keying from the file's ``models``, over the ``index`` settings."""
    index = settings.index
    try:
        default = ModelKeying(
            hash=HashConfig(
                algo=index.hash_algo,
                block_size=index.block_size,
                seed=index.hash_seed,
                extra_key_style=index.extra_key_style,
            ),
            key_mode=index.key_mode,
        )
        if default.key_mode is KeyMode.ENGINE and not default.hash.reproducible:
            raise ConfigError(
                f"--hash-algo {index.hash_algo.value} without --hash-seed cannot reproduce "
                "the pods' hashes (vLLM seeds xxhash randomly per process): set PYTHONHASHSEED "
                "on every pod and --hash-seed to the same value, or use --key-mode tokens"
            )
        per_model = {}
        for name, entry in settings.models.items():
            base = default.hash
            engines = frozenset(entry.engines) or frozenset({Engine.VLLM})
            # Pods whose hashes can't be reproduced are keyed by content unless told
            key_mode = entry.key_mode or (
                KeyMode.TOKENS if engines - HASH_COMPATIBLE else default.key_mode
            )
            seed = base.seed if entry.hash_seed is msgspec.UNSET else entry.hash_seed
            per_model[name] = ModelKeying(
                hash=HashConfig(
                    algo=entry.hash_algo or base.algo,
                    block_size=entry.block_size or base.block_size,
                    seed=seed,
                    extra_key_style=entry.extra_key_style or base.extra_key_style,
                    lookahead_tokens=entry.lookahead_tokens or 0,
                ),
                key_mode=key_mode,
                loras=dict(entry.loras),
                report_mode=entry.kv_cache_report_mode,
                engines=engines,
            )
        return ModelCatalog(default, per_model)
    except KeyConfigError as exc:
        raise ConfigError(str(exc)) from None


def tokenizer_dirs(settings: Settings) -> dict[str, str]:
    return {name: entry.tokenizer for name, entry in settings.models.items() if entry.tokenizer}


def check_bind_endpoint(endpoint: str) -> None:
    """A ``--zmq-bind`` value names its transport: ``127.0.0.1:5557`` is a mistake ZMQ
    would only report as 'Invalid argument'."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        hint = f" (did you mean tcp://{endpoint}?)" if "://" not in endpoint else ""
        raise ConfigError(f"--zmq-bind {endpoint!r}: the endpoint must be tcp://HOST:PORT{hint}")


def check_tokenizer_dirs(dirs: dict[str, str]) -> None:
    """A model's ``tokenizer:`` directory must hold tokenizer.json now, not at the first
    text prompt an hour later."""
    for model, directory in dirs.items():
        if not (Path(directory) / "tokenizer.json").is_file():
            raise ConfigError(
                f"--model-config: model {model!r} has tokenizer: {directory}, which holds no "
                "tokenizer.json"
            )


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()):
        raise ConfigError(f"--listen {listen!r} must be HOST:PORT (ASCII digits)")
    return host.strip("[]") or "0.0.0.0", int(port)


def discovery_config(settings: Settings) -> DiscoveryConfig:
    """Kubernetes discovery settings from the --k8s-* flags."""
    k8s = settings.k8s
    try:
        return DiscoveryConfig(
            namespaces=tuple(k8s.namespace),
            label_selector=k8s.selector,
            mode=DiscoveryMode(k8s.mode),
            grace_s=float(k8s.grace_seconds),
            resync_s=float(k8s.resync_seconds),
            serving_port=settings.events.serving_port,
            events_port=k8s.events_port,
            replay_port=k8s.replay_port,
            model=settings.events.model,
        )
    except ValueError as exc:
        raise ConfigError(f"--k8s-*: {exc}") from None

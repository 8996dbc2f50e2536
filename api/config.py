"""Service configuration: CLI flags, ``KVINDEX_*`` environment variables, model config file.

Precedence: a flag beats its environment variable, which beats the built-in default.
Per-model settings in the model config file beat the global ones for that model.
Every structure here is a msgspec type, so a misspelt key in the model config file is
an error that names it, not a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from kvindex.events.k8s_pods import DiscoveryConfig, DiscoveryMode
from kvindex.indexer.keys import ExtraKeyStyle, HashAlgo, HashConfig, KeyConfigError
from kvindex.indexer.models import KeyMode, ModelCatalog, ModelKeying, ReportMode
from kvindex.scoring.route_cost import CostWeights
from kvindex.scoring.scorer import TierWeights


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which setting to fix."""


class ModelEntry(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One model's settings in the model config file; unset fields use the globals."""

    block_size: int | None = None
    hash_algo: HashAlgo | None = None
    hash_seed: str | msgspec.UnsetType | None = msgspec.UNSET
    extra_key_style: ExtraKeyStyle | None = None
    lookahead_tokens: int | None = None
    key_mode: KeyMode | None = None
    kv_cache_report_mode: ReportMode = ReportMode.INCREMENTAL
    tokenizer: str | None = None
    loras: dict[str, str] = {}


class TierWeightsEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    gpu: float = 1.0
    cpu: float = 0.8
    storage: float = 0.5


class RouteWeightsEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``/route``'s cost weights (:mod:`kvindex.scoring.route_cost` says why these)."""

    prefix: float = 2.0
    queue: float = 1.0
    kv: float = 1.0
    queue_half: float = 4.0


class ModelConfigFile(msgspec.Struct, forbid_unknown_fields=True):
    """The ``--model-config`` file (YAML, JSON or TOML)::

    models:
      Qwen/Qwen3-32B:
        block_size: 16
        hash_algo: sha256
        tokenizer: /models/qwen3-32b      # directory holding tokenizer.json
        loras: {sql-adapter: /adapters/sql}
    tier_weights: {gpu: 1.0, cpu: 0.8, storage: 0.5}
    route_weights: {prefix: 2.0, queue: 1.0, kv: 1.0, queue_half: 4.0}
    """

    models: dict[str, ModelEntry] = {}
    tier_weights: TierWeightsEntry = TierWeightsEntry()
    route_weights: RouteWeightsEntry = RouteWeightsEntry()


class Settings(msgspec.Struct, kw_only=True):
    """Everything ``kvindex serve`` needs, after flags, environment and defaults."""

    listen: str = "127.0.0.1:8080"
    zmq_bind: list[str] = []
    zmq_connect: list[str] = []
    topic_filter: str = "kv@"
    serving_port: int = 8000
    model: str | None = None
    replay_port: int = 0
    stream_queue: Annotated[int, msgspec.Meta(ge=1)] = 4096
    replay_endpoint: list[str] = []
    bind_allow: list[str] = []
    max_streams_per_sender: int = 64
    backend: str = "memory"
    capacity_blocks: int | None = None
    snapshot: str | None = None
    snapshot_interval: float = 60.0
    hash_algo: HashAlgo = HashAlgo.SHA256
    hash_seed: str | None = None
    block_size: int = 16
    extra_key_style: ExtraKeyStyle = ExtraKeyStyle.TAGGED
    key_mode: KeyMode = KeyMode.ENGINE
    model_config: str | None = None
    admin_token: str | None = None
    max_prompt_tokens: int = 262_144
    max_prompt_chars: int = 4_000_000
    log_format: str = "text"
    log_level: str = "info"
    redis_prefix: str = "kvindex"
    replica_id: str | None = None
    lease_ttl: int = 5
    k8s_namespace: list[str] = []
    k8s_selector: str = "kvindex.io/enabled=true"
    k8s_mode: str = "connect"
    k8s_grace_seconds: int = 30
    k8s_resync_seconds: int = 300
    k8s_events_port: int = 5557
    k8s_replay_port: int = 5558
    # HTTP hardening (issue 14): the admin token from a file (a flag's value would be
    # visible in /proc/<pid>/cmdline), and the limits a hostile client meets.
    admin_token_file: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_pods: int = 4096
    max_in_flight: int = 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    load_interval: float = 1.0
    load_timeout: float = 0.5
    route_ttl: float = 120.0
    max_kv_usage: float = 0.95
    max_waiting: int = 0


def load_model_config(path: str | None) -> ModelConfigFile:
    """Read the model config file (YAML, JSON or TOML)."""
    if not path:
        return ModelConfigFile()
    file = Path(path)
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read --model-config {path}: {exc.strerror}") from None
    suffix = file.suffix.lower()
    try:
        if suffix == ".json":
            return msgspec.json.decode(data, type=ModelConfigFile)
        if suffix == ".toml":
            return msgspec.toml.decode(data, type=ModelConfigFile)
        if suffix in (".yaml", ".yml"):
            return msgspec.yaml.decode(data, type=ModelConfigFile)
    except ImportError:
        raise ConfigError(f"{path}: YAML needs PyYAML (pip install pyyaml) or use JSON") from None
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{path} is not valid {suffix.lstrip('.').upper()}: {exc}") from None
    raise ConfigError(f"{path}: model config must end in .yaml, .yml, .json or .toml")


def admin_token(settings: Settings) -> str | None:
    """The operator token: ``KVINDEX_ADMIN_TOKEN`` or the first line of
    ``--admin-token-file`` (a Kubernetes Secret mounted as a file, say). None means the
    mutating routes are switched off."""
    if settings.admin_token_file:
        try:
            text = Path(settings.admin_token_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"cannot read --admin-token-file {settings.admin_token_file}: {exc}"
            ) from None
        token = text.strip()
        if not token:
            raise ConfigError(f"--admin-token-file {settings.admin_token_file} is empty")
        return token
    return settings.admin_token or None


def check_limits(settings: Settings) -> None:
    """Refuse limits that cannot work, naming the flag."""
    for flag, value in (
        ("--max-body-bytes", settings.max_body_bytes),
        ("--max-pods", settings.max_pods),
        ("--max-in-flight", settings.max_in_flight),
        ("--header-timeout", settings.header_timeout),
        ("--body-timeout", settings.body_timeout),
        ("--keep-alive-timeout", settings.keep_alive_timeout),
    ):
        if value <= 0:
            raise ConfigError(f"{flag} {value}: must be positive")


def build_catalog(settings: Settings, models: ModelConfigFile) -> ModelCatalog:
    """Per-model keying from the file, over the global flags."""
    try:
        default = ModelKeying(
            hash=HashConfig(
                algo=settings.hash_algo,
                block_size=settings.block_size,
                seed=settings.hash_seed,
                extra_key_style=settings.extra_key_style,
            ),
            key_mode=settings.key_mode,
        )
        if default.key_mode is KeyMode.ENGINE and not default.hash.reproducible:
            raise ConfigError(
                f"--hash-algo {settings.hash_algo.value} without --hash-seed cannot reproduce "
                "the pods' hashes (vLLM seeds xxhash randomly per process): set PYTHONHASHSEED "
                "on every pod and --hash-seed to the same value, or use --key-mode tokens"
            )
        per_model = {}
        for name, entry in models.models.items():
            base = default.hash
            seed = base.seed if entry.hash_seed is msgspec.UNSET else entry.hash_seed
            per_model[name] = ModelKeying(
                hash=HashConfig(
                    algo=entry.hash_algo or base.algo,
                    block_size=entry.block_size or base.block_size,
                    seed=seed,
                    extra_key_style=entry.extra_key_style or base.extra_key_style,
                    lookahead_tokens=entry.lookahead_tokens or 0,
                ),
                key_mode=entry.key_mode or default.key_mode,
                loras=dict(entry.loras),
                report_mode=entry.kv_cache_report_mode,
            )
        return ModelCatalog(default, per_model)
    except KeyConfigError as exc:
        raise ConfigError(str(exc)) from None


def tier_weights(models: ModelConfigFile) -> TierWeights:
    w = models.tier_weights
    return TierWeights(w.gpu, w.cpu, w.storage)


def route_weights(models: ModelConfigFile) -> CostWeights:
    w = models.route_weights
    try:
        return CostWeights(w.prefix, w.queue, w.kv, w.queue_half)
    except ValueError as exc:
        raise ConfigError(f"route_weights: {exc}") from None


def tokenizer_dirs(models: ModelConfigFile) -> dict[str, str]:
    return {name: entry.tokenizer for name, entry in models.models.items() if entry.tokenizer}


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
    try:
        return DiscoveryConfig(
            namespaces=tuple(settings.k8s_namespace),
            label_selector=settings.k8s_selector,
            mode=DiscoveryMode(settings.k8s_mode),
            grace_s=float(settings.k8s_grace_seconds),
            resync_s=float(settings.k8s_resync_seconds),
            serving_port=settings.serving_port,
            events_port=settings.k8s_events_port,
            replay_port=settings.k8s_replay_port,
            model=settings.model,
        )
    except ValueError as exc:
        raise ConfigError(f"--k8s-*: {exc}") from None

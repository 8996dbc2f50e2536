"""The settings tree: every ``kvindex serve`` setting, its default and its meaning, once.

``Settings`` has one section per part of the service (``http``, ``log``, ``events``,
``index``, ``k8s``, ``scoring``) plus the per-model table; each field's default is written
here only and its ``Meta`` description is the ``--help`` text. Flags, ``KVINDEX_*``
variables and the config file are generated from this tree and decoded into it once
(:mod:`kvindex.api.serve.settings_sources`), so adding a setting is adding one field. A field's
flag is ``--`` + the section's flag prefix + its name with ``-`` for ``_``
(``k8s.namespace`` is ``--k8s-namespace``), its variable ``KVINDEX_`` + that in upper
case, its config-file form ``k8s: {namespace: [...]}``. ``file_only`` fields have no flag
or variable (tables, weights), ``env_only`` ones no flag (the admin token: a flag's value
is visible in ``/proc/<pid>/cmdline``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

from kvindex.indexer.keys import ExtraKeyStyle, HashAlgo
from kvindex.indexer.models import Engine, KeyMode, ReportMode
from kvindex.scoring.route.cost import CostWeights
from kvindex.scoring.scorer import TierWeights


def doc(text: str, **extra: Any) -> msgspec.Meta:
    """A field's help text; ``extra`` carries ``metavar``, ``env_only`` or ``file_only``."""
    return msgspec.Meta(description=text, extra=extra)


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    flag_prefix: ClassVar[str] = ""


class HttpSettings(_Section):
    """The HTTP server and the limits a hostile client meets."""

    listen: Annotated[
        str,
        doc("HTTP address HOST:PORT (the container image and the manifests set 0.0.0.0:8080)"),
    ] = "127.0.0.1:8080"
    admin_token: Annotated[
        str | None,
        doc("bearer token the operator endpoints need; without one they answer 403", env_only=True),
    ] = None
    admin_token_file: Annotated[
        str | None,
        doc(
            "file holding the bearer token DELETE /index/pods/{pod} needs (or set "
            "KVINDEX_ADMIN_TOKEN); without one the operator endpoints answer 403",
            metavar="FILE",
        ),
    ] = None
    max_body_bytes: Annotated[int, doc("largest HTTP request body")] = 16 * 1024 * 1024
    max_pods: Annotated[int, doc("most candidate pods in one /score or /route request")] = 4096
    max_in_flight: Annotated[int, doc("requests handled at once; more get 429")] = 1024
    header_timeout: Annotated[float, doc("seconds a client may take to send its headers")] = 10.0
    body_timeout: Annotated[float, doc("seconds a client may take to send a body")] = 30.0
    keep_alive_timeout: Annotated[
        float, doc("seconds an idle keep-alive connection stays open")
    ] = 5.0
    # 20 s: Kubernetes kills a pod terminationGracePeriodSeconds (30 by default) after
    # SIGTERM; what is left after the drain stops ingest, writes the final snapshot and
    # releases the Redis leases before SIGKILL can come.
    drain_timeout: Annotated[
        float,
        msgspec.Meta(ge=0),
        doc(
            "seconds a shutdown (SIGTERM) lets requests in flight finish, /readyz failing "
            "meanwhile; what is still running then is cut. Keep it under the orchestrator's "
            "grace period (terminationGracePeriodSeconds)",
            metavar="SECONDS",
        ),
    ] = 20.0
    max_prompt_tokens: Annotated[int, doc("largest prompt /score accepts, in tokens")] = 262_144
    max_prompt_chars: Annotated[int, doc("largest text prompt /score accepts")] = 4_000_000
    processes: Annotated[
        int,
        doc(
            "serving processes on the listen address: past 1, the others answer /score from "
            "the memory backend's index in shared memory (/dev/shm) and pass the rest on"
        ),
    ] = 1


class LogSettings(_Section):
    flag_prefix: ClassVar[str] = "log-"

    format: Annotated[Literal["text", "json"], doc("log line format")] = "text"
    level: Annotated[
        Literal["debug", "info", "warning", "error"],
        doc(
            "log level; debug also shows the libraries' line per request (uvicorn's "
            "access log, httpx's per pod scrape)"
        ),
    ] = "info"


class EventsSettings(_Section):
    """Where KV events come from and how a stream is kept."""

    zmq_bind: Annotated[
        list[str],
        doc(
            "bind a SUB socket pods' publishers connect to, e.g. tcp://*:5557 "
            "(pods publish with topic kv@<pod-ip:port>@<model>); repeatable",
            metavar="ENDPOINT",
        ),
    ] = []
    zmq_connect: Annotated[
        list[str],
        doc(
            "connect to a pod's publisher, e.g. tcp://127.0.0.2:5557; the pod "
            "and model come from a kv@<pod>@<model> topic, else from POD@MODEL=, "
            "else from the endpoint host with --serving-port and --model; "
            "';replay=tcp://HOST:RPORT' names its replay endpoint; repeatable",
            metavar="[POD[@MODEL]=]ENDPOINT[;replay=REPLAY]",
        ),
    ] = []
    topic_filter: Annotated[str, doc("bind-mode topic prefix to subscribe to")] = "kv@"
    serving_port: Annotated[
        int, doc("pods' HTTP serving port, for addresses given without one")
    ] = 8000
    model: Annotated[str | None, doc("model name for connect-mode pods whose topic names none")] = (
        None
    )
    replay_port: Annotated[
        int,
        doc(
            "pods' replay port (replay_endpoint of --kv-events-config), asked at the pod's "
            "host, rank r at port + r; the fallback for a pod without an endpoint of its "
            "own (--replay-endpoint); 0 = no replay"
        ),
    ] = 0
    catch_up_on_first_contact: Annotated[
        bool,
        doc(
            "on a stream's first batch past seq 0 (kvindex joined after the engine "
            "started), fetch the engine's buffered history by replay first (no replay "
            "endpoint: the stream is incomplete); --no-catch-up-on-first-contact applies "
            "from there and reports the stream live, not claiming the history"
        ),
    ] = True
    stream_queue: Annotated[
        int,
        msgspec.Meta(ge=1),
        doc(
            "batches waiting per engine stream before the newest is dropped "
            "(and fetched again by replay); raise it if queue_overflow is counted"
        ),
    ] = 32_768
    queue_memory: Annotated[
        int,
        msgspec.Meta(ge=0),
        doc(
            "MiB the batches waiting in every stream's queue may hold together; past it a "
            "stream over its share has its newest dropped (and fetched again by replay); "
            "0: a quarter of the memory the process may use (cgroup limit, else the machine's)",
            metavar="MIB",
        ),
    ] = 0
    replay_endpoint: Annotated[
        list[str],
        doc(
            "one pod's own replay endpoint (its rank r uses RPORT + r); beats "
            "--replay-port, needed when engines share a host; repeatable",
            metavar="POD=tcp://HOST:RPORT",
        ),
    ] = []
    bind_allow: Annotated[
        list[str],
        doc(
            "bind mode: a pod (or a CIDR of pod hosts) whose topic may come from "
            "any sender address, e.g. behind NAT; others must send from their own host; "
            "with this or configured pods (--pod-role, --zmq-connect), only those pods "
            "are accepted; repeatable",
            metavar="POD|CIDR",
        ),
    ] = []
    max_streams_per_sender: Annotated[
        int, doc("bind mode: most streams (pod, DP rank) one sender address may open")
    ] = 64
    max_models: Annotated[
        int,
        msgspec.Meta(ge=1),
        doc(
            "most model names events may add to the index besides the configured ones "
            "(--model, --model-config); events naming one more are skipped (model_cap)"
        ),
    ] = 256


class IndexSettings(_Section):
    """The index backend and how the pods' block hashes are reproduced."""

    backend: Annotated[str, doc("memory or redis://HOST:PORT/DB")] = "memory"
    capacity_blocks: Annotated[
        int | None,
        doc("memory backend: most distinct blocks kept; oldest-stored evicted beyond"),
    ] = None
    expected_blocks: Annotated[
        int,
        msgspec.Meta(ge=0),
        doc(
            "memory backend: distinct blocks to size the index for at start (about the "
            "pods' KV blocks together), so it does not grow into them; it still grows past "
            "them; 0: start small and grow"
        ),
    ] = 0
    snapshot: Annotated[
        str | None,
        doc(
            "memory backend: save the index to PATH periodically and at shutdown, "
            "restore it at start and resume every pod's stream from it",
            metavar="PATH",
        ),
    ] = None
    snapshot_interval: Annotated[
        float, doc("seconds between snapshots; 0: only at shutdown", metavar="SECONDS")
    ] = 60.0
    peers: Annotated[
        list[str],
        doc(
            "memory backend: another replica's URL, e.g. http://10.0.0.7:8080; a replica "
            "that starts without a usable --snapshot copies the index from the first peer "
            "that answers (its GET /index/dump, with this replica's admin token) and resumes "
            "every pod's stream from the copy's positions; comma list or repeatable",
            metavar="URL",
        ),
    ] = []
    hash_algo: Annotated[HashAlgo, doc("pods' --prefix-caching-hash-algo")] = HashAlgo.SHA256
    hash_seed: Annotated[str | None, doc("pods' PYTHONHASHSEED, if set")] = None
    block_size: Annotated[int, doc("pods' KV block size in tokens")] = 16
    extra_key_style: Annotated[
        ExtraKeyStyle, doc("LoRA/salt hash keys: tagged for vLLM >= 0.31, bare for older")
    ] = ExtraKeyStyle.TAGGED
    key_mode: Annotated[
        KeyMode,
        doc(
            "engine: index the pods' own hashes; tokens: kvindex's own chain over token "
            "ids, for pods whose hashes can't be reproduced"
        ),
    ] = KeyMode.ENGINE
    redis_prefix: Annotated[str, doc("prefix of every Redis key")] = "kvindex"
    replica_id: Annotated[
        str | None, doc("redis backend: this replica's name in stream leases (hostname:pid)")
    ] = None
    lease_ttl: Annotated[
        int, doc("redis backend: seconds before a dead replica's streams are taken over")
    ] = 5
    backend_deadline: Annotated[
        float,
        doc(
            "redis backend: seconds /score and /route wait for the index; past it /score "
            "answers 503 backend_timeout and /route decides on load alone"
        ),
    ] = 0.5
    backend_max_in_flight: Annotated[
        int,
        doc("redis backend: index lookups waiting or running at once; more get 503 backend_busy"),
    ] = 64


class K8sSettings(_Section):
    """Kubernetes pod discovery."""

    flag_prefix: ClassVar[str] = "k8s-"

    namespace: Annotated[
        list[str],
        doc(
            "discover vLLM pods in this Kubernetes namespace (repeatable); "
            "needs get/list/watch on pods there",
            metavar="NAMESPACE",
        ),
    ] = []
    selector: Annotated[str, doc("label selector of the vLLM pods")] = "kvindex.io/enabled=true"
    mode: Annotated[
        Literal["connect", "bind"],
        doc(
            "connect: connect to each discovered pod; bind: pods connect to --zmq-bind, "
            "discovery only names and forgets them"
        ),
    ] = "connect"
    grace_seconds: Annotated[int, doc("forget a pod not ready for this long")] = 30
    resync_seconds: Annotated[int, doc("full relist period")] = 300
    events_port: Annotated[int, doc("pods' events port without annotation/named port")] = 5557
    replay_port: Annotated[int, doc("pods' replay port likewise; 0 = none")] = 5558


class ScoringSettings(_Section):
    """/score's tier weights and /route's cost model, load scraping and admission."""

    tier_weights: Annotated[
        TierWeights, doc("what a cached block is worth per tier", file_only=True)
    ] = TierWeights()
    route_weights: Annotated[CostWeights, doc("/route's cost weights", file_only=True)] = (
        CostWeights()
    )
    load_interval: Annotated[
        float,
        doc(
            "/route: seconds between scrapes of every pod's vLLM /metrics (see --load-stale-after)",
            metavar="SECONDS",
        ),
    ] = 1.0
    load_timeout: Annotated[float, doc("/route: one scrape's timeout", metavar="SECONDS")] = 0.5
    load_stale_after: Annotated[
        float,
        doc(
            "/route: a pod whose last good scrape (and last push) is older than this has "
            "unknown load; 0 = 3 load intervals",
            metavar="SECONDS",
        ),
    ] = 0.0
    load_push: Annotated[
        bool,
        doc(
            "/route: follow the load topic of each known pod of a model with SGLang pods "
            "(engines: [sglang]) that advertises one in its /server_info (SGLang "
            "--load-publish-endpoint): its pushed load beats its scrape while fresh; "
            "--no-load-push: scrapes only"
        ),
    ] = True
    eject_after: Annotated[
        int,
        msgspec.Meta(ge=0),
        doc(
            "/route: consecutive failures (refused, timed out, 5xx) reported for a pod "
            "before it is ejected from routing; 0 = never eject"
        ),
    ] = 1
    eject_base: Annotated[
        float,
        doc(
            "/route: seconds a pod's first ejection lasts; the n-th lasts n times this "
            "(at most 300 s or this), then one probe request may go to it",
            metavar="SECONDS",
        ),
    ] = 10.0
    eject_max_percent: Annotated[
        float,
        doc("/route: at most this percentage of a request's candidates counts as ejected"),
    ] = 50.0
    route_ttl: Annotated[
        float,
        doc(
            "/route: a routed request counts against its pod until "
            "POST /route/{id}/done or this many seconds",
            metavar="SECONDS",
        ),
    ] = 120.0
    max_kv_usage: Annotated[
        float,
        doc(
            "/route: pass over a pod whose KV cache usage (fullest engine) is above "
            "this fraction while another candidate has room; when none has (saturated), "
            "the cost decides among all. 1 = off: KV usage is only a cost term"
        ),
    ] = 1.0
    max_waiting: Annotated[
        int,
        doc("/route: never choose a pod with more requests waiting (none left: 429); 0 = no limit"),
    ] = 0
    when_full: Annotated[
        Literal["reject", "least_bad"],
        doc(
            "/route when no pod is admissible: reject (429 with Retry-After) or least_bad "
            "(the cheapest pod anyway, reason least_bad)"
        ),
    ] = "reject"
    route_seed: Annotated[
        int | None,
        doc(
            "/route: seed of the random choice among equally cheap pods (a simulator's "
            "reproducible runs); unset = seeded from the OS"
        ),
    ] = None
    clock: Annotated[
        Literal["monotonic", "external"],
        doc(
            "/route's clock: monotonic, or external for simulators only: every /route, "
            "/route/{id}/done and /first-token call must carry ?now=SECONDS, the caller's "
            "virtual time, and kvindex's route state ages by it (docs/routing.md)"
        ),
    ] = "monotonic"
    speculative_ttl: Annotated[
        float,
        doc(
            "/route: a routed prompt's blocks count as held by its pod for this long, or "
            "until the pod's events confirm them; 0 = off",
            metavar="SECONDS",
        ),
    ] = 2.0
    speculative_max_blocks: Annotated[
        int, doc("/route: most speculative blocks held at once; the oldest entries go first")
    ] = 1_000_000
    max_event_lag: Annotated[
        float,
        doc(
            "/route: a candidate whose events arrive later than this is doubted "
            "(doubt lagging, named in warnings; its matched prefix still counts); 0 = off",
            metavar="SECONDS",
        ),
    ] = 10.0
    pod_role: Annotated[
        list[str],
        doc(
            "/route P/D role of a static pod: prefill, decode or both (the default); "
            "discovered pods take it from the label kvindex.io/role; a pod named here is "
            "known from the start (chosen and scraped before it publishes: in bind mode "
            "without discovery, name every pod, POD=both without P/D); repeatable",
            metavar="POD=ROLE",
        ),
    ] = []
    pd_threshold: Annotated[
        int,
        doc(
            "/route P/D: the decode pod prefills itself when fewer prompt tokens than this "
            "are uncached on it",
            metavar="TOKENS",
        ),
    ] = 256


# What OpenAI clients read from an answer (its type, encoding, request id, rate limits).
DEFAULT_RELAY_HEADERS = (
    "content-type",
    "content-encoding",
    "retry-after",
    "x-request-id",
    "openai-*",
    "x-ratelimit-*",
)


class GatewaySettings(_Section):
    """The OpenAI-compatible front door (``kvindex serve --gateway``, ``kvindex gateway``)."""

    flag_prefix: ClassVar[str] = "gateway-"

    enabled: Annotated[
        bool,
        doc(
            "serve: also answer the OpenAI API (/v1/completions, /v1/chat/completions, "
            "/v1/models, /health) on --listen, routing each request in-process "
            "(--gateway for short)"
        ),
    ] = False
    attempts: Annotated[
        int,
        msgspec.Meta(ge=1),
        doc("most pods one request is tried on while connecting fails before any answer"),
    ] = 3
    connect_timeout: Annotated[
        float, msgspec.Meta(gt=0), doc("seconds to connect to a pod", metavar="SECONDS")
    ] = 2.0
    read_timeout: Annotated[
        float,
        msgspec.Meta(gt=0),
        doc("seconds a pod may stay silent while answering", metavar="SECONDS"),
    ] = 600.0
    first_byte_timeout: Annotated[
        float,
        msgspec.Meta(gt=0),
        doc(
            "seconds a pod may take to send the status line of a streamed answer (vLLM "
            "sends it before any work); past it the request goes to another pod",
            metavar="SECONDS",
        ),
    ] = 30.0
    index_timeout: Annotated[
        float,
        msgspec.Meta(gt=0),
        doc("kvindex gateway: seconds one call to the index may take", metavar="SECONDS"),
    ] = 2.0
    pd_mode: Annotated[
        Literal["kv-transfer", "sidecar"],
        doc(
            "P/D: how a request reaches its prefill pod. kv-transfer: the gateway prefills "
            "it there (max_tokens 1, kv_transfer_params) and passes the answer's "
            "kv_transfer_params to the decode pod, as vLLM's P/D proxies do; sidecar: the "
            "decode pod runs llm-d's routing sidecar, told the prefill pod in the "
            "x-prefiller-host-port header"
        ),
    ] = "kv-transfer"
    relay_headers: Annotated[
        list[str],
        doc(
            "pod answer headers relayed to the client (a name, or a prefix ending in *); "
            "the rest, and hop-by-hop ones always, are dropped; content-encoding must stay "
            "listed for pods that compress (bodies are relayed as encoded); repeatable, "
            "replaces the default list",
            metavar="NAME",
        ),
    ] = msgspec.field(default_factory=lambda: list(DEFAULT_RELAY_HEADERS))


class ModelEntry(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One model's settings in the config file; unset fields use the ``index`` ones."""

    block_size: int | None = None
    hash_algo: HashAlgo | None = None
    hash_seed: str | msgspec.UnsetType | None = msgspec.UNSET
    extra_key_style: ExtraKeyStyle | None = None
    lookahead_tokens: int | None = None
    key_mode: KeyMode | None = None
    kv_cache_report_mode: ReportMode = ReportMode.INCREMENTAL
    #: The engines the model's pods run (vllm, sglang, trtllm); any but vllm keys the
    #: model by token content (key_mode tokens, the default then).
    engines: list[Engine] = msgspec.field(default_factory=lambda: [Engine.VLLM])
    tokenizer: str | None = None
    loras: dict[str, str] = {}


class Settings(_Section):
    """Everything ``kvindex serve`` needs, after flags, environment, file and defaults.

    The config file (``--model-config``; YAML, JSON or TOML) has this shape::

      models:
        Qwen/Qwen3-32B:
          block_size: 16
          hash_algo: sha256
          tokenizer: /models/qwen3-32b      # directory holding tokenizer.json
          loras: {sql-adapter: /adapters/sql}
      scoring:
        tier_weights: {gpu: 1.0, cpu: 0.8, storage: 0.5}
        route_weights: {prefix: 2.0, queue: 1.0, decode: 1.0, kv: 1.0}
      http: {max_pods: 1024}
      k8s: {namespace: [serving]}
    """

    model_config: Annotated[
        str | None,
        doc(
            "the config file (YAML, JSON or TOML): per-model settings under models:, "
            "and any setting by section (http, log, events, index, k8s, scoring, gateway)",
            metavar="FILE",
        ),
    ] = None
    http: HttpSettings = msgspec.field(default_factory=HttpSettings)
    log: LogSettings = msgspec.field(default_factory=LogSettings)
    events: EventsSettings = msgspec.field(default_factory=EventsSettings)
    index: IndexSettings = msgspec.field(default_factory=IndexSettings)
    k8s: K8sSettings = msgspec.field(default_factory=K8sSettings)
    scoring: ScoringSettings = msgspec.field(default_factory=ScoringSettings)
    gateway: GatewaySettings = msgspec.field(default_factory=GatewaySettings)
    models: Annotated[dict[str, ModelEntry], doc("per-model settings", file_only=True)] = {}


SECTIONS: dict[str, type[_Section]] = {
    "http": HttpSettings,
    "log": LogSettings,
    "events": EventsSettings,
    "index": IndexSettings,
    "k8s": K8sSettings,
    "scoring": ScoringSettings,
    "gateway": GatewaySettings,
}

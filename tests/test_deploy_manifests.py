"""deploy/: every manifest is loadable, least-privileged, and watches metrics that exist.

No cluster runs here, so the manifests are checked the way the API server would reject
them: built-in kinds with the ``kubernetes`` client's models (which validate types and
required fields) plus a strict walk of every key against the models' field maps (the
client's deserializer silently drops unknown keys, so a misspelt ``imagePullPolicy``
would otherwise pass); the Prometheus Operator kinds by a minimal schema written here.
The metric check starts a real ``kvindex serve`` and scrapes it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvindex.api.serve.cli import build_parser
from kvindex.api.serve.settings_sources import from_flags
from kvindex.api.testing import ServeProcess, free_port
from kvindex.events.discovery.pods import DiscoveryConfig, PodFacts, plan_pod
from kvindex.events.wire.identity import parse_topic
from kvindex.events.wire.publisher import EnginePublisher
from kvindex.events.wire.vllm import BlockRemoved, BlockStored
from kvindex.indexer.keys import BlockHasher, HashConfig
from tests.support.lazy import LazyModule

yaml = pytest.importorskip("yaml")
kubernetes = LazyModule("kubernetes")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
MODEL = "Qwen/Qwen3-0.6B"

# -- loading ---------------------------------------------------------------------------


def kustomizations() -> list[Path]:
    return sorted(DEPLOY.rglob("kustomization.yaml"))


def referenced(kind: str) -> list[Path]:
    """Files named by any kustomization's ``resources`` (kind="resources") or ``patches``."""
    out = []
    for kfile in kustomizations():
        spec = yaml.safe_load(kfile.read_text())
        for entry in spec.get(kind, []):
            path = entry["path"] if isinstance(entry, dict) else entry
            target = (kfile.parent / path).resolve()
            if target.is_file():
                out.append(target)
    return out


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def resources() -> list[tuple[Path, dict[str, Any]]]:
    files = referenced("resources") + sorted((DEPLOY / "examples").glob("*.yaml"))
    return [(f, d) for f in files for d in docs(f)]


def find(kind: str, name: str, where: str = "base") -> dict[str, Any]:
    for path, doc in resources():
        if doc["kind"] == kind and doc["metadata"]["name"] == name and where in path.parts:
            return doc
    raise AssertionError(f"no {kind} {name} in deploy/{where}")


def model_class(doc: dict[str, Any]) -> str:
    version = doc["apiVersion"].rsplit("/", 1)[-1]
    return version[0].upper() + version[1:] + doc["kind"]


def strict_errors(data: Any, type_name: str, path: str) -> list[str]:
    """Every key the model does not know and every scalar of the wrong type, recursively.

    ``type_name`` is an ``openapi_types`` entry: a model name, ``List[...]`` /
    ``list[...]``, ``Dict[str, ...]`` / ``dict(str, ...)``, or a scalar.
    """
    if data is None:
        return []
    if m := re.fullmatch(r"(?:List|list)\[(.+)\]", type_name):
        if not isinstance(data, list):
            return [f"{path}: expected a list"]
        return [e for i, v in enumerate(data) for e in strict_errors(v, m[1], f"{path}[{i}]")]
    if m := re.fullmatch(r"(?:Dict\[str, (.+)\]|dict\(str, (.+)\))", type_name):
        if not isinstance(data, dict):
            return [f"{path}: expected a map"]
        inner = m[1] or m[2]
        return [e for k, v in data.items() for e in strict_errors(v, inner, f"{path}.{k}")]
    scalars: dict[str, tuple[type, ...]] = {
        "str": (str,), "int": (int,), "bool": (bool,), "float": (int, float),
        "datetime": (str,), "date": (str,), "bytearray": (str,),
    }  # fmt: skip
    if type_name == "object":  # IntOrString, free-form
        return []
    if type_name in scalars:
        ok = isinstance(data, scalars[type_name]) and not (
            type_name == "int" and isinstance(data, bool)
        )
        return [] if ok else [f"{path}: {data!r} is not {type_name}"]
    cls = getattr(kubernetes.client, type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected a {type_name} object"]
    by_json = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    errors = []
    for key, value in data.items():
        attr = by_json.get(key)
        if attr is None:
            errors.append(f"{path}.{key}: no such field in {type_name}")
            continue
        errors += strict_errors(value, cls.openapi_types[attr], f"{path}.{key}")
    return errors


def deserialize(doc: dict[str, Any]) -> Any:
    """The client's own model validation (types, required fields)."""
    api = kubernetes.client.ApiClient()
    try:  # kubernetes >= 35: deserialize(text, type, content_type)
        return api.deserialize(json.dumps(doc), model_class(doc), "application/json")
    except TypeError:  # older clients: deserialize(response, type)

        class Response:
            data = json.dumps(doc)

        return api.deserialize(Response(), model_class(doc))


CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}


# -- every manifest loads ----------------------------------------------------------------


def test_every_yaml_file_is_referenced_and_every_reference_exists() -> None:
    used = set(referenced("resources")) | set(referenced("patches"))
    for kfile in kustomizations():
        spec = yaml.safe_load(kfile.read_text())
        assert set(spec) <= {
            "apiVersion", "kind", "namespace", "resources", "patches", "images",
            "configMapGenerator",
        }, f"{kfile}: unexpected keys {set(spec)}"  # fmt: skip
        assert spec["kind"] == "Kustomization"
        for entry in spec.get("resources", []) + [p["path"] for p in spec.get("patches", [])]:
            assert (kfile.parent / entry).exists(), f"{kfile}: {entry} does not exist"
        for gen in spec.get("configMapGenerator", []):
            for file in gen["files"]:
                assert (kfile.parent / file).is_file(), f"{kfile}: {file} does not exist"
    for path in DEPLOY.rglob("*.yaml"):
        if path.name == "kustomization.yaml" or "examples" in path.parts:
            continue
        assert path.resolve() in used, f"{path} is not listed in any kustomization.yaml"


@pytest.mark.parametrize(
    "path", sorted({p for p, _ in resources()}), ids=lambda p: str(p.relative_to(DEPLOY))
)
def test_builtin_kinds_load_strictly_with_the_client_models(path: Path) -> None:
    for doc in docs(path):
        if doc["kind"] in CRD_KINDS:
            continue
        errors = strict_errors(doc, model_class(doc), doc["kind"])
        assert not errors, f"{path}:\n" + "\n".join(errors)
        assert deserialize(doc).metadata.name == doc["metadata"]["name"]


@pytest.mark.parametrize(
    "path", sorted(set(referenced("patches"))), ids=lambda p: str(p.relative_to(DEPLOY))
)
def test_patches_name_only_real_fields(path: Path) -> None:
    for doc in docs(path):
        errors = strict_errors(doc, model_class(doc), doc["kind"])
        assert not errors, f"{path}:\n" + "\n".join(errors)
        find(doc["kind"], doc["metadata"]["name"])  # patches something the base has


def test_the_strict_check_catches_a_misspelt_field() -> None:
    deployment = json.loads(json.dumps(find("Deployment", "kvindex")))
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "80"
    errors = strict_errors(deployment, "V1Deployment", "Deployment")
    assert any("imagePulPolicy: no such field in V1Container" in e for e in errors)
    assert any("containerPort: '80' is not int" in e for e in errors)


# -- least privilege, wiring -------------------------------------------------------------


def test_role_grants_exactly_get_list_watch_on_pods() -> None:
    kinds = [d["kind"] for _, d in resources()]
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    roles = [d for _, d in resources() if d["kind"] == "Role"]
    assert len(roles) == 1
    (rule,) = roles[0]["rules"]
    assert set(rule) == {"apiGroups", "resources", "verbs"}
    assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"]
    assert sorted(rule["verbs"]) == ["get", "list", "watch"]

    binding = find("RoleBinding", "kvindex-pod-reader")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": roles[0]["metadata"]["name"],
    }
    (subject,) = binding["subjects"]
    account = find("ServiceAccount", subject["name"])
    pod = find("Deployment", "kvindex")["spec"]["template"]["spec"]
    assert (
        subject["kind"] == "ServiceAccount"
        and pod["serviceAccountName"] == account["metadata"]["name"]
    )
    namespace = yaml.safe_load((DEPLOY / "base/kustomization.yaml").read_text())["namespace"]
    assert subject["namespace"] == namespace == find("Namespace", namespace)["metadata"]["name"]


def container(name: str = "kvindex", where: str = "base") -> dict[str, Any]:
    (main,) = find("Deployment", name, where)["spec"]["template"]["spec"]["containers"]
    return main


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def patched_env(overlay: str) -> dict[str, Any]:
    env = env_of(container())
    for path in (DEPLOY / "overlays" / overlay).glob("*.yaml"):
        for doc in docs(path):
            if doc.get("kind") == "Deployment":
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    env.update(env_of(c))
    return env


def test_kvindex_deployment_probes_resources_and_user() -> None:
    pod = find("Deployment", "kvindex")["spec"]["template"]["spec"]
    main = container()
    assert main["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert main["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert main["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {"cpu", "memory"} <= set(main["resources"]["requests"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert main["securityContext"]["allowPrivilegeEscalation"] is False
    port_names = {p["name"]: p["containerPort"] for p in main["ports"]}
    listen = env_of(main)["KVINDEX_LISTEN"]
    assert listen.endswith(f":{port_names['http']}")
    service = find("Service", "kvindex")
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in port_names
    assert (
        service["spec"]["selector"].items()
        <= find("Deployment", "kvindex")["spec"]["template"]["metadata"]["labels"].items()
    )


def test_the_drain_fits_in_the_grace_period_with_room_for_the_snapshot() -> None:
    """A drain that runs into terminationGracePeriodSeconds ends in SIGKILL before the
    final snapshot and the leases' release: every overlay keeps it 10 s shorter."""
    grace = find("Deployment", "kvindex")["spec"]["template"]["spec"]
    grace_s = grace["terminationGracePeriodSeconds"]
    for overlay in ["base", *(p.name for p in (DEPLOY / "overlays").iterdir())]:
        env = env_of(container()) if overlay == "base" else patched_env(overlay)
        drain_s = float(env.get("KVINDEX_DRAIN_TIMEOUT", from_flags().http.drain_timeout))
        assert drain_s + 10 <= grace_s, overlay


def test_every_kvindex_env_var_is_a_serve_flag() -> None:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    flags = {
        "KVINDEX_" + option[2:].upper().replace("-", "_")
        for action in commands.choices["serve"]._actions
        for option in action.option_strings
        if option.startswith("--") and action.help != argparse.SUPPRESS
    }
    flags.add("KVINDEX_ADMIN_TOKEN")  # environment only: a flag would show in cmdline
    used = set(env_of(container())).union(*(patched_env(o) for o in ("bind", "redis", "gateway")))
    unknown = used - flags
    # The discovery flags are added to the CLI alongside events/discovery/kubernetes.py.
    if unknown and all(name.startswith("KVINDEX_K8S_") for name in unknown):
        pytest.skip(f"the CLI does not have the discovery flags yet: {sorted(unknown)}")
    assert not unknown, f"env vars kvindex serve does not read: {sorted(unknown)}"


def test_admin_token_comes_from_a_secret_and_listen_is_explicit() -> None:
    for path, doc in resources():
        if doc["kind"] not in {"Deployment", "StatefulSet"}:
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                if "TOKEN" in e["name"] or "PASSWORD" in e["name"]:
                    assert "value" not in e, f"{path}: {e['name']} is a literal, not a Secret"
    token = env_of(container())["KVINDEX_ADMIN_TOKEN"]["secretKeyRef"]
    assert token["name"] and token["key"] and token["optional"] is True
    # kvindex defaults to 127.0.0.1; the pod must say 0.0.0.0 itself.
    assert env_of(container())["KVINDEX_LISTEN"].startswith("0.0.0.0:")


def test_model_config_map_is_a_valid_model_config(tmp_path: Path) -> None:
    data = find("ConfigMap", "kvindex-models")["data"]
    path = tmp_path / "models.yaml"
    path.write_text(data["models.yaml"])
    assert MODEL in from_flags(model_config=str(path)).models
    assert env_of(container())["KVINDEX_MODEL_CONFIG"].endswith("/models.yaml")


def test_every_configured_model_names_its_tokenizer(tmp_path: Path) -> None:
    """The gateway has only text: before, the ConfigMap's tokenizer line was commented out
    and every gateway request was routed by load alone (fallback_tokenizer_unavailable).
    The folders are the image's (tests/test_dockerfile.py checks it holds them)."""
    path = tmp_path / "models.yaml"
    path.write_text(find("ConfigMap", "kvindex-models")["data"]["models.yaml"])
    models = from_flags(model_config=str(path)).models
    assert models and all(entry.tokenizer for entry in models.values()), models


def test_bind_overlay_binds_what_the_events_service_exposes() -> None:
    env = patched_env("bind")
    assert env["KVINDEX_K8S_MODE"] == "bind"
    bound = {int(e.rsplit(":", 1)[1]) for e in env["KVINDEX_ZMQ_BIND"].split(",")}
    service = find("Service", "kvindex-events")
    assert {p["port"] for p in service["spec"]["ports"]} == bound
    assert {p["targetPort"] for p in service["spec"]["ports"]} == bound
    assert min(bound) == 5557 and bound == set(range(5557, 5557 + len(bound)))


def test_redis_overlay_points_at_its_redis() -> None:
    env = patched_env("redis")
    host, port = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", env["KVINDEX_BACKEND"]).groups()
    service = find("Service", host, "redis")
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    find("StatefulSet", host, "redis")


def test_gateway_overlay_enables_the_gateway_behind_its_own_service() -> None:
    env = patched_env("gateway")
    settings = from_flags(
        gateway_enabled=env["KVINDEX_GATEWAY_ENABLED"] == "true",
        gateway_pd_mode=env["KVINDEX_GATEWAY_PD_MODE"],
    )
    assert settings.gateway.enabled
    service = find("Service", "kvindex-gateway", "gateway")
    pod = find("Deployment", "kvindex")["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = service["spec"]["ports"]
    (http,) = [p for p in container()["ports"] if p["name"] == port["targetPort"]]
    # The port kvindex listens on, where the gateway answers too.
    assert env["KVINDEX_LISTEN"].endswith(f":{http['containerPort']}")


@pytest.mark.slow
def test_gateway_overlay_env_starts_a_kvindex_that_answers_openai_and_exports_metrics(
    tmp_path: Path,
) -> None:
    from tests.test_api import make_tokenizer

    env = patched_env("gateway")
    gateway_env = {k: v for k, v in env.items() if k.startswith("KVINDEX_GATEWAY_")}
    # The ConfigMap's config, its tokenizer folders (the image's) made here.
    models_yaml = find("ConfigMap", "kvindex-models")["data"]["models.yaml"]
    for entry in yaml.safe_load(models_yaml)["models"].values():
        make_tokenizer(tmp_path / entry["tokenizer"].lstrip("/"))
        models_yaml = models_yaml.replace(entry["tokenizer"], f"{tmp_path}{entry['tokenizer']}")
    (tmp_path / "models.yaml").write_text(models_yaml)
    gateway_env["KVINDEX_MODEL_CONFIG"] = str(tmp_path / "models.yaml")
    gateway_env["KVINDEX_ZMQ_BIND"] = f"tcp://127.0.0.1:{free_port()}"
    with ServeProcess(env={**os.environ, **gateway_env}) as server:
        server.wait_ready(30.0, path="/health")  # the gateway's, not kvindex's /healthz
        ready = httpx.get(f"{server.url}/readyz", timeout=5)
        assert ready.status_code == 200, ready.text  # the model's tokenizer loaded
        assert httpx.get(f"{server.url}/v1/models", timeout=5).json()["object"] == "list"
        page = httpx.get(f"{server.url}/metrics", timeout=5).text
        assert 'kvindex_gateway_requests_total{outcome="ok"} 0.0' in page


def test_vllm_example_publishes_what_discovery_expects() -> None:
    example = find("Deployment", "vllm-qwen3", "examples")
    template = example["spec"]["template"]
    (vllm,) = template["spec"]["containers"]
    args = vllm["args"]
    config = json.loads(args[args.index("--kv-events-config") + 1])
    assert "--enable-prefix-caching" in args
    assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
    assert config["endpoint"] == "tcp://*:5557" and config["replay_endpoint"] == "tcp://*:5558"
    serving = int(args[args.index("--port") + 1])
    assert config["topic"] == f"kv@$(POD_IP):{serving}@{MODEL}"
    assert env_of(vllm)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}

    selector = env_of(container())["KVINDEX_K8S_SELECTOR"]
    key, value = selector.split("=")
    assert template["metadata"]["labels"][key] == value

    # The pod, as discovery would read it from the API: same id as its topic names.
    pod = deserialize(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {**template["metadata"], "name": "vllm-0", "namespace": "llm"},
            "spec": template["spec"],
            "status": {
                "phase": "Running",
                "podIP": "127.10.0.7",
                "conditions": [{"type": "Ready", "status": "True"}],
            },
        }
    )
    facts = PodFacts.from_pod(pod)
    assert facts.serving
    plan = plan_pod(facts, DiscoveryConfig())
    topic = parse_topic(config["topic"].replace("$(POD_IP)", "127.10.0.7"))
    assert plan.pod_id == topic.pod == "127.10.0.7:8000"
    assert plan.model == topic.model == MODEL
    (endpoint,) = plan.endpoints
    assert endpoint.endpoint == "tcp://127.10.0.7:5557"
    assert endpoint.replay_endpoint == "tcp://127.10.0.7:5558"


# -- monitoring ----------------------------------------------------------------------------

_DURATION = re.compile(r"\d+[smhdw]")


def alert_rules() -> list[dict[str, Any]]:
    rule = find("PrometheusRule", "kvindex", "monitoring")
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads((DEPLOY / "monitoring/kvindex-dashboard.json").read_text())


def dashboard_panels() -> list[dict[str, Any]]:
    panels = []
    for panel in dashboard()["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def queries() -> list[str]:
    exprs = [r["expr"] for r in alert_rules()]
    exprs += [t["expr"] for p in dashboard_panels() for t in p.get("targets", [])]
    return exprs


def test_prometheus_rule_structure_and_coverage() -> None:
    rule = find("PrometheusRule", "kvindex", "monitoring")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and set(rule["spec"]) == {"groups"}
    names = set()
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"]
        for r in group["rules"]:
            assert set(r) <= {"alert", "record", "expr", "for", "labels", "annotations"}, r
            assert ("alert" in r) != ("record" in r)
            assert isinstance(r["expr"], str) and r["expr"].strip()
            if "alert" in r:
                names.add(r["alert"])
                assert _DURATION.fullmatch(r.get("for", "0s")), r
                assert r["labels"]["severity"] in {"critical", "warning", "info"}
                assert {"summary", "description"} <= set(r["annotations"])
            else:
                assert re.fullmatch(r"[a-z_]+(:[a-z0-9_]+)+", r["record"])
    wanted = {
        "events stalled": "KvindexEventsStalled",
        "hash mismatches": "KvindexHashMismatch",
        "sequence gaps": "KvindexSequenceGaps",
        "replay failures": "KvindexReplayFailures",
        "hit ratio low": "KvindexHitRatioLow",
        "score latency high": "KvindexScoreLatencyHigh",
        "no pods": "KvindexNoPods",
        "prediction diverges from vLLM": "KvindexPredictionDiverges",
    }
    assert set(wanted.values()) <= names
    records = {r["record"]: r["expr"] for r in alert_rules() if "record" in r}
    gap = records["kvindex:hit_ratio_gap:rate15m"]
    assert "kvindex:predicted_hit_ratio:rate15m" in gap
    assert "vllm:prefix_cache_hit_ratio:rate15m" in gap and "on (model)" in gap
    vllm = records["vllm:prefix_cache_hit_ratio:rate15m"]
    assert "vllm:prefix_cache_hits_total" in vllm and "vllm:prefix_cache_queries_total" in vllm
    (diverges,) = [r for r in alert_rules() if r.get("alert") == "KvindexPredictionDiverges"]
    assert "kvindex:hit_ratio_gap:rate15m" in diverges["expr"] and "abs(" in diverges["expr"]


def test_service_monitor_scrapes_the_http_service() -> None:
    monitor = find("ServiceMonitor", "kvindex", "monitoring")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    service = find("Service", "kvindex")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    events = find("Service", "kvindex-events")
    assert (
        not monitor["spec"]["selector"]["matchLabels"].items()
        <= events["metadata"]["labels"].items()
    ), "the ZMQ service has no /metrics"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "honorLabels"}
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics" and _DURATION.fullmatch(endpoint["interval"])
    # The operator names the job after the Service; the "kvindex down" alert relies on it.
    jobs = {j for r in alert_rules() for j in re.findall(r'\bup\{job="([^"]+)"', r["expr"])}
    assert jobs == {service["metadata"]["name"]}


def test_dashboard_structure_and_coverage() -> None:
    board = dashboard()
    assert board["uid"] and board["title"] and isinstance(board["schemaVersion"], int)
    var, *others = board["templating"]["list"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    assert {v["name"] for v in others} == {"namespace", "model"}
    for other in others:
        assert other["type"] == "query" and other["datasource"]["uid"] == "${datasource}"
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${" + var["name"] + "}"
    text = " ".join(queries())
    for metric in (
        "kvindex_score_matched_blocks_total",  # hit ratio
        "kvindex_events_total",  # events/s by type
        "kvindex_index_blocks",  # index size by tier
        "kvindex_pods",
        "kvindex_pod_stream_state",
        "kvindex_seq_gaps_total",
        "kvindex_replays_total",
        "kvindex_score_seconds_bucket",
        "kvindex_event_lag_seconds_bucket",
        "kvindex_redis_errors_total",
        "process_resident_memory_bytes",
        # /route (issue 11): decisions by reason, speculative lifecycle, scrape errors and
        # staleness per pod, in-flight per pod, event lag per pod
        "kvindex_route_decisions_total",
        "kvindex_route_prefill_decisions_total",
        "kvindex_route_speculative_entries_total",
        "kvindex_route_speculative_live",
        "kvindex_route_in_flight",
        "kvindex_load_scrape_errors_total",
        "kvindex_load_age_seconds",
        "kvindex_load_known",
        "kvindex_event_lag_last_seconds",
        # The gateway: requests by outcome, retries, upstream errors, time it adds.
        "kvindex_gateway_requests_total",
        "kvindex_gateway_retries_total",
        "kvindex_gateway_upstream_errors_total",
        "kvindex_gateway_prefill_total",
        "kvindex_gateway_added_seconds_bucket",
        "kvindex_gateway_route_seconds_bucket",  # the part of it spent on /route
    ):
        assert metric in text, f"the dashboard does not show {metric}"
    # Every kvindex series is scoped to the chosen namespace(s), per-model ones to models.
    for expr in queries():
        for name, matchers in re.findall(r"\b(kvindex_[a-z0-9_]+)(\{[^}]*\})?", expr):
            if any(expr in [t["expr"] for t in p.get("targets", [])] for p in panels):
                assert 'namespace=~"$namespace"' in matchers, (name, expr)
                if name.startswith("kvindex_score_") and "blocks" in name:
                    assert 'model=~"$model"' in matchers, (name, expr)
    # The panel operators open first: kvindex's prediction next to vLLM's own counters.
    (compare,) = [
        p
        for p in panels
        if any("vllm:prefix_cache_hits_total" in t["expr"] for t in p.get("targets", []))
    ]
    exprs = " ".join(t["expr"] for t in compare["targets"])
    assert "vllm:prefix_cache_queries_total" in exprs
    assert "kvindex_score_matched_blocks_total" in exprs and "by (pod" in exprs
    assert compare["gridPos"]["y"] <= 1, "the comparison is the first thing on the board"


def test_queries_are_balanced() -> None:
    for expr in queries():
        stripped = re.sub(r'"[^"]*"', '""', expr)
        stack = []
        for ch in stripped:
            if ch in "([{":
                stack.append(ch)
            elif ch in ")]}":
                assert stack and "([{"[")]}".index(ch)] == stack.pop(), expr
        assert not stack, expr


_NAME = re.compile(r"\b((?:kvindex|process)_[a-zA-Z0-9_]+)\b")
_SELECTOR = re.compile(r"\b((?:kvindex|process)_[a-zA-Z0-9_]+)\{([^}]*)\}")
# Added by Prometheus from the scrape target, not exported by kvindex.
_TARGET_LABELS = frozenset({"namespace", "job", "instance"})
_BY = re.compile(r"\bby \(([^)]*)\)")


def referenced_metrics() -> tuple[dict[str, set[str]], list[tuple[str, set[str]]]]:
    """Every kvindex series name in the rules and the dashboard with the labels its
    selectors match on; and each ``by (label)`` with the series of its query."""
    selected: dict[str, set[str]] = {}
    groupings: list[tuple[str, set[str]]] = []
    for expr in queries():
        bare = re.sub(r'"[^"]*"', '""', expr)
        names = set(_NAME.findall(bare))
        for name in names:
            selected.setdefault(name, set())
        for name, matchers in _SELECTOR.findall(bare):
            labels = {m.split("=")[0].strip(" !~") for m in matchers.split(",") if m}
            selected[name] |= labels - _TARGET_LABELS
        for by in _BY.findall(bare):
            groupings += [(label.strip(), names) for label in by.split(",") if label.strip()]
    return selected, groupings


@pytest.fixture
def running_kvindex() -> Iterator[str]:
    from tests.test_load import DP1_IDLE, MetricsServer

    bind = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVINDEX_")}
    # A second pod serving vLLM /metrics, a P/D decode pod, so /route's series exist
    # (127.0.0.1:8000 serves none: its scrape errors are series too).
    vllm = MetricsServer(DP1_IDLE)
    try:
        with ServeProcess(
            "--zmq-bind", f"tcp://127.0.0.1:{bind}", "--log-level", "warning",
            "--load-interval", "0.1", "--pod-role", f"{vllm.pod}=decode", "--gateway",
            "--pod-role", "127.0.0.1:8000=both",  # a configured roster: both pods in it
            env=env,
        ) as server:  # fmt: skip
            server.wait_ready(30.0)
            url = server.url
            tokens = list(range(100, 100 + 64))
            keys = BlockHasher(HashConfig()).keys(tokens)
            with EnginePublisher(
                f"tcp://127.0.0.1:{bind}", topic=f"kv@127.0.0.1:8000@{MODEL}"
            ) as publisher:
                assert publisher.wait_for_subscribers(1, 10)
                publisher.publish([BlockStored(keys, None, tokens, 16)])
                publisher.publish([BlockRemoved(keys[-1:])])
                # One bad frame, so the per-reason error series exists too.
                publisher.send_frames([f"kv@127.0.0.1:8000@{MODEL}".encode(), b"short", b""])
                deadline = time.monotonic() + 10
                while (
                    'kvindex_pod_blocks{pod="127.0.0.1:8000"'
                    not in httpx.get(f"{url}/metrics", timeout=5).text
                ):
                    assert time.monotonic() < deadline, "events never reached the index"
                    time.sleep(0.05)
                answer = httpx.post(
                    f"{url}/score", json={"model": MODEL, "token_ids": tokens}, timeout=5
                )
                assert answer.status_code == 200, answer.text
                with EnginePublisher(
                    f"tcp://127.0.0.1:{bind}", topic=f"kv@{vllm.pod}@{MODEL}"
                ) as second:
                    assert second.wait_for_subscribers(1, 10)
                    second.publish([BlockStored(keys[:1], None, tokens[:16], 16)])
                    while "kvindex_load_age_seconds{" not in httpx.get(f"{url}/metrics").text:
                        assert time.monotonic() < deadline + 10, "the vLLM pod was never scraped"
                        time.sleep(0.05)
                    answer = httpx.post(
                        f"{url}/route", json={"model": MODEL, "token_ids": tokens}, timeout=5
                    )
                    assert answer.status_code == 200, answer.text
                    yield url
    finally:
        vllm.close()


def redis_only_series() -> dict[str, set[str]]:
    """Series only a Redis-backed kvindex exports, with their labels (its collectors read
    local counters, so nothing needs to run)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvindex.api.serve.service import Service
    from kvindex.api.serve.settings_sources import from_flags
    from tests.redis_fixtures import REDIS_URL

    service = Service(from_flags(backend=REDIS_URL, redis_prefix="kvtest-manifests"))
    try:
        text = generate_latest(service.registry).decode()
    finally:
        service.stop()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(("kvindex_redis", "kvindex_stream_owned")):
            for sample in family.samples:
                out.setdefault(sample.name, set()).update(sample.labels)
    assert "kvindex_redis_errors_total" in out
    return out


@pytest.mark.slow
def test_every_queried_metric_is_exported(running_kvindex: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    exposition = httpx.get(f"{running_kvindex}/metrics", timeout=5).text
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)

    labels.update(redis_only_series())
    selected, groupings = referenced_metrics()
    missing = sorted(set(selected) - set(labels))
    assert not missing, f"queried but not exported by kvindex: {missing}"
    for name, used in selected.items():
        assert used <= labels[name], f"{name} has no label(s) {used - labels[name]}"
    for label, series in groupings:
        if all(n.startswith("process_") for n in series) and label == "pod":
            continue  # the scrape target's pod: the replica the process metrics are of
        if label != "le" and series:  # le: histogram buckets
            assert any(label in labels[n] for n in series), f"no series of {series} has {label}"

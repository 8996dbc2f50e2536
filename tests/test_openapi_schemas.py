"""Every route documents its answer (issue 14): a 2xx response schema in the OpenAPI
document whose every field has a description, described parameters, and real answers
that decode with the documented types (which refuse unknown fields, so the document
cannot fall behind)."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi.testclient import TestClient

from kvindex.api.http.app import create_app
from kvindex.api.http.schemas_pods import Health, PodBlocks, PodList, PodReport, Readiness
from kvindex.api.serve.service import Service
from kvindex.api.serve.settings_sources import from_flags
from tests.test_api import KEYS, POD_A, publish, setup  # noqa: F401  (setup: a fixture)

METHODS = ("get", "post", "put", "delete", "patch")


def openapi() -> dict[str, Any]:
    service = Service(from_flags())
    try:
        with TestClient(create_app(service, manage_lifecycle=False)) as client:
            return client.get("/openapi.json").json()
    finally:
        service.stop()


def undescribed(schema: dict[str, Any], components: dict[str, Any], where: str) -> list[str]:
    """Fields under ``schema`` without a description, following $refs once each."""
    missing: list[str] = []
    seen: set[str] = set()

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if ref is not None:
            name = ref.rsplit("/", 1)[-1]
            if name not in seen:
                seen.add(name)
                walk(components[name], name)
            return
        for name, prop in node.get("properties", {}).items():
            target = prop
            if "$ref" in prop and "description" not in prop:
                target = components[prop["$ref"].rsplit("/", 1)[-1]]
            if "description" not in prop and "description" not in target:
                missing.append(f"{where}: {path}.{name}")
            walk(prop, f"{path}.{name}")
        for key in ("items", "additionalProperties"):
            walk(node.get(key), path)
        for key in ("anyOf", "oneOf", "allOf"):
            for option in node.get(key, []):
                walk(option, path)

    walk(schema, "")
    return missing


def test_every_route_has_a_described_2xx_response_schema() -> None:
    document = openapi()
    components = document["components"]["schemas"]
    routes, missing = 0, []
    for path, item in document["paths"].items():
        for method in METHODS:
            if method not in item:
                continue
            routes += 1
            where = f"{method.upper()} {path}"
            ok = {k: v for k, v in item[method]["responses"].items() if k.startswith("2")}
            assert ok, f"{where}: no 2xx response"
            for response in ok.values():
                content = response.get("content", {})
                assert content, f"{where}: a 2xx response without a body schema"
                for media, body in content.items():
                    schema = body.get("schema")
                    assert schema, f"{where} {media}: no schema"
                    if media == "application/json":
                        assert schema != {}, f"{where}: an empty JSON schema"
                        missing += undescribed(schema, components, where)
                    else:
                        assert schema == {"type": "string"}, (where, media)
            for parameter in item[method].get("parameters", []):
                if not parameter.get("description"):
                    missing.append(f"{where}: parameter {parameter['name']}")
    assert routes >= 10
    assert missing == []


def test_real_answers_decode_with_the_documented_types(setup) -> None:  # noqa: F811
    client, endpoint, service = setup
    publish(endpoint, POD_A, 8, service)
    pods = msgspec.convert(client.get("/index/pods").json(), PodList)
    assert [p.pod for p in pods.pods] == [POD_A]
    pod = msgspec.convert(client.get(f"/index/pods/{POD_A}").json(), PodReport)
    assert pod.blocks.gpu == 8 and pod.streams[0].delivered == 1
    blocks = client.get(f"/index/pods/{POD_A}/blocks", params={"model": "m"}).json()
    assert msgspec.convert(blocks, PodBlocks).blocks[POD_A] == sorted(KEYS[:8])
    assert msgspec.convert(client.get("/healthz").json(), Health).status == "ok"
    ready = client.get("/readyz")
    assert msgspec.convert(ready.json(), Readiness).status == "ready", ready.text

"""A Kubernetes API server for tests: pods only, the real list/watch protocol, on loopback.

No cluster can run on the development machines, and a mock of the ``kubernetes`` client
would test our idea of the protocol rather than the protocol. This server speaks what
the client actually sends and parses, over real HTTP:

* ``GET /api/v1/namespaces/{ns}/pods?labelSelector=...`` - a ``PodList`` whose
  ``metadata.resourceVersion`` is the current version;
* the same with ``watch=true&resourceVersion=N[&timeoutSeconds=S]`` - a chunked stream of
  newline-delimited ``{"type": ADDED|MODIFIED|DELETED|ERROR, "object": ...}`` events
  newer than N, open until the timeout. A version older than the last compaction gets
  ``ERROR`` with a ``410 Expired`` Status, as the real API server sends after etcd
  compacted its history.

Tests change pods with or without telling the watchers (``notify=False`` models an event
lost while a watch was down), expire or cut every open watch, take the whole server
away and bring it back on the same port, or make it refuse everything with 403.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

_POD_PATH = re.compile(r"/api/v1/namespaces/([^/]+)/pods")
_ids = itertools.count(1)


def make_pod(
    namespace: str,
    name: str,
    *,
    ip: str | None = None,
    ready: bool = False,
    phase: str | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ports: dict[str, int] | None = None,
    uid: str | None = None,
) -> dict[str, Any]:
    """A Pod as the API server serialises it. ``phase`` defaults to Running once the pod
    has an IP, Pending before."""
    container: dict[str, Any] = {"name": "vllm", "image": "vllm/vllm-openai:latest"}
    if ports:
        container["ports"] = [
            {"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports.items()
        ]
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or str(uuid.uuid4()),
            "labels": dict(labels if labels is not None else {"kvindex.io/enabled": "true"}),
            "annotations": dict(annotations or {}),
            "creationTimestamp": "2025-01-01T00:00:00Z",
        },
        "spec": {"containers": [container], "nodeName": "node-1"},
        "status": {},
    }
    _set_status(pod, ip=ip, ready=ready, phase=phase or ("Running" if ip else "Pending"))
    return pod


def _set_status(pod: dict[str, Any], *, ip: str | None, ready: bool, phase: str) -> None:
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    pod["status"] = status


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class SelectorError(ValueError):
    pass


def parse_selector(text: str) -> list[tuple[str, str, str | None]]:
    """Equality-based label selector terms: (op, key, value), op in = != exists !exists."""
    terms: list[tuple[str, str, str | None]] = []
    for raw in filter(None, (t.strip() for t in text.split(","))):
        if " in " in raw or " notin " in raw or "(" in raw:
            raise SelectorError(f"set-based selector {raw!r} is not supported by the fake")
        if "!=" in raw:
            key, value = raw.split("!=", 1)
            terms.append(("!=", key.strip(), value.strip()))
        elif "=" in raw:
            key, value = raw.replace("==", "=").split("=", 1)
            terms.append(("=", key.strip(), value.strip()))
        elif raw.startswith("!"):
            terms.append(("!exists", raw[1:].strip(), None))
        else:
            terms.append(("exists", raw, None))
    return terms


def _matches(pod: dict[str, Any], terms: list[tuple[str, str, str | None]]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    for op, key, value in terms:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "!exists" and key in labels:
            return False
    return True


class FakeKubeAPI:
    """The fake API server. ``start``/``stop`` may be called repeatedly (same port)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = 1000
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        # Every change: (version, type, namespace, pod). Watches read it from their start.
        self._history: list[tuple[int, str, str, dict[str, Any]]] = []
        self._compacted = 0  # watches from a version below this get 410
        self._cuts = 0  # bumped to end every open watch
        self._cut_kind = "drop"
        self._connections: set[socket.socket] = set()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self.forbid = False
        self.requests: list[tuple[str, dict[str, list[str]]]] = []

    # -- lifecycle ------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Listen on 127.0.0.1 (on the previous port after a stop)."""
        handler = type("Handler", (_Handler,), {"api": self})
        server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Go away like a crashed API server: stop listening, cut every connection."""
        self._cut("drop")
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self._cond:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(5)

    # -- pods -------------------------------------------------------------------------

    def put_pod(self, pod: dict[str, Any], *, notify: bool = True) -> dict[str, Any]:
        """Create or replace a pod (ADDED or MODIFIED)."""
        with self._cond:
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
            kind = "MODIFIED" if key in self._pods else "ADDED"
            return self._record(kind, key, copy.deepcopy(pod), notify)

    def update_pod(
        self,
        namespace: str,
        name: str,
        *,
        notify: bool = True,
        ip: str | None = None,
        ready: bool | None = None,
        phase: str | None = None,
        annotations: dict[str, str] | None = None,
        terminating: bool = False,
    ) -> dict[str, Any]:
        """Change a pod's status or annotations (MODIFIED)."""
        with self._cond:
            pod = copy.deepcopy(self._pods[(namespace, name)])
            status = pod["status"]
            old_ready = any(
                c["type"] == "Ready" and c["status"] == "True" for c in status["conditions"]
            )
            _set_status(
                pod,
                ip=ip if ip is not None else status.get("podIP"),
                ready=old_ready if ready is None else ready,
                phase=phase or status["phase"],
            )
            if annotations:
                pod["metadata"]["annotations"].update(annotations)
            if terminating:
                pod["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:30Z"
            return self._record("MODIFIED", (namespace, name), pod, notify)

    def delete_pod(self, namespace: str, name: str, *, notify: bool = True) -> None:
        with self._cond:
            pod = copy.deepcopy(self._pods[(namespace, name)])
            self._record("DELETED", (namespace, name), pod, notify)

    def _record(
        self, kind: str, key: tuple[str, str], pod: dict[str, Any], notify: bool
    ) -> dict[str, Any]:
        self._version += 1
        pod["metadata"]["resourceVersion"] = str(self._version)
        if kind == "DELETED":
            del self._pods[key]
        else:
            self._pods[key] = pod
        if notify:  # else a change no watcher is ever told about: only a list shows it
            self._history.append((self._version, kind, key[0], copy.deepcopy(pod)))
        self._cond.notify_all()
        return pod

    # -- watches -------------------------------------------------------------------------

    def expire_watches(self) -> None:
        """Compact history past every version handed out: open watches end with an
        ERROR 410 event, and a watch resumed from any old version is refused the same way."""
        with self._cond:
            # Other objects changed meanwhile (etcd's revision is cluster-wide), and
            # history was compacted up to the present.
            self._version += 1
            self._compacted = self._version
        self._cut("expire")

    def drop_watches(self) -> None:
        """End every open watch abruptly (no final chunk), like a proxy that reset them."""
        self._cut("drop")

    def _cut(self, kind: str) -> None:
        with self._cond:
            self._cuts += 1
            self._cut_kind = kind
            self._cond.notify_all()

    def watch_requests(self) -> int:
        with self._cond:
            return sum(1 for _, q in self.requests if q.get("watch"))

    def list_requests(self) -> int:
        with self._cond:
            return sum(1 for _, q in self.requests if not q.get("watch"))


class _Handler(BaseHTTPRequestHandler):
    api: FakeKubeAPI
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def setup(self) -> None:
        super().setup()
        with self.api._cond:
            self.api._connections.add(self.connection)

    def finish(self) -> None:
        with self.api._cond:
            self.api._connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def do_GET(self) -> None:
        api = self.api
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        with api._cond:
            api.requests.append((url.path, query))
        match = _POD_PATH.fullmatch(url.path)
        if api.forbid:
            namespace = match.group(1) if match else "?"
            self._send_json(
                403,
                _status(
                    403,
                    "Forbidden",
                    'pods is forbidden: User "system:serviceaccount:kvindex:kvindex" cannot '
                    f'list resource "pods" in API group "" in the namespace "{namespace}"',
                ),
            )
            return
        if match is None:
            self._send_json(404, _status(404, "NotFound", f"no route for {url.path}"))
            return
        try:
            terms = parse_selector(query.get("labelSelector", [""])[0])
        except SelectorError as exc:
            self._send_json(400, _status(400, "BadRequest", str(exc)))
            return
        namespace = match.group(1)
        if query.get("watch", ["false"])[0].lower() in ("true", "1"):
            version = query.get("resourceVersion", [None])[0]
            timeout = int(query.get("timeoutSeconds", ["3600"])[0])
            self._watch(namespace, terms, version, timeout)
        else:
            self._list(namespace, terms)

    def _send_json(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _list(self, namespace: str, terms: list[tuple[str, str, str | None]]) -> None:
        api = self.api
        with api._cond:
            items = [
                copy.deepcopy(p)
                for (ns, _), p in sorted(api._pods.items())
                if ns == namespace and _matches(p, terms)
            ]
            version = api._version
        self._send_json(
            200,
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(version)},
                "items": items,
            },
        )

    def _chunk(self, event: dict[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def _watch(
        self,
        namespace: str,
        terms: list[tuple[str, str, str | None]],
        version: str | None,
        timeout_s: int,
    ) -> None:
        api = self.api
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        deadline = time.monotonic() + timeout_s
        try:
            with api._cond:
                cuts = api._cuts
                if version is not None and int(version) < api._compacted:
                    pending = [self._expired(version)]
                    position = None
                elif version is None or version == "0":
                    # No version: the current state as synthetic ADDED events first.
                    pending = [
                        {"type": "ADDED", "object": copy.deepcopy(p)}
                        for (ns, _), p in sorted(api._pods.items())
                        if ns == namespace and _matches(p, terms)
                    ]
                    position = len(api._history)
                else:
                    start = int(version)
                    position = next(
                        (i for i, h in enumerate(api._history) if h[0] > start),
                        len(api._history),
                    )
                    pending = []
            while True:
                for event in pending:
                    self._chunk(event)
                if position is None:
                    break
                with api._cond:
                    while (
                        position >= len(api._history)
                        and api._cuts == cuts
                        and time.monotonic() < deadline
                    ):
                        api._cond.wait(max(0.0, min(0.5, deadline - time.monotonic())))
                    if api._cuts != cuts:
                        if api._cut_kind == "expire":
                            self._chunk(self._expired(version or "0"))
                            break
                        self._abort()
                        return
                    if position >= len(api._history):
                        break  # timeoutSeconds reached: a normal end
                    pending = [
                        {"type": kind, "object": copy.deepcopy(pod)}
                        for _, kind, ns, pod in api._history[position:]
                        if ns == namespace and _matches(pod, terms)
                    ]
                    position = len(api._history)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True
            return
        self.close_connection = True

    def _expired(self, version: str) -> dict[str, Any]:
        return {
            "type": "ERROR",
            "object": _status(
                410,
                "Expired",
                f"too old resource version: {version} ({self.api._compacted})",
            ),
        }

    def _abort(self) -> None:
        """Cut the connection mid-stream: the client sees a response that never ends well."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

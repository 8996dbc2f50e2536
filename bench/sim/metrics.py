"""Each simulated pod's vLLM ``/metrics`` page, served on its own ``ip:port`` so that the
real kvindex can scrape pod load for ``POST /route`` as it does in a cluster.

The page holds what ``kvindex.scoring.load_metrics`` reads from vLLM 0.33's Prometheus
logger: ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc``, labelled ``model_name`` and ``engine``. kvindex scrapes on
its own wall clock while the simulation runs in virtual time, so a scrape reads the pod
as it is at the decision the simulator is at then: scraped load lags by however many
decisions the simulator makes per scrape interval (as a real scrape lags by an interval),
and is the one part of a run that is not deterministic.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.sim.pod import SimPod
from bench.sim.service import ServiceError


class PodMetricsServers:
    """One HTTP server per pod on the pod id's own port; ``close`` stops them."""

    def __init__(self, pods: Sequence[SimPod], model: str) -> None:
        self._servers: list[ThreadingHTTPServer] = []
        try:
            for pod in pods:
                host, _, port = pod.pod_id.rpartition(":")
                server = ThreadingHTTPServer((host, int(port)), _handler(pod, model))
                server.daemon_threads = True
                threading.Thread(target=server.serve_forever, daemon=True).start()
                self._servers.append(server)
        except OSError as exc:
            self.close()
            raise ServiceError(f"cannot serve a pod's /metrics ({exc}); try --first-port") from exc

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers = []


def page(pod: SimPod, model: str) -> bytes:
    labels = f'{{engine="0",model_name="{model}"}}'
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{labels} {len(pod.running)}\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{labels} {len(pod.waiting)}\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{labels} {pod.kv_usage:.6f}\n"
    ).encode()


def _handler(pod: SimPod, model: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the stdlib handler's name
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = page(pod, model)
            self.send_response(200)
            self.send_header("content-type", "text/plain; version=0.0.4")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler

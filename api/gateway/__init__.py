"""``kvindex gateway``: an OpenAI-compatible front door that routes each request with
``/route`` and forwards it, unchanged, to the chosen vLLM pod.

One module per job: :mod:`.bodies` reads the OpenAI request and tokenizes it as vLLM
will; :mod:`.routes` asks for a decision (in-process, or over HTTP with the client);
:mod:`.upstream` connects to the chosen pod, trying another when the connection fails
before any byte was sent, and relays the answer chunk by chunk; :mod:`.app` is the
work per endpoint (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``), and :mod:`.asgi` serves them, alone or in front of kvindex's own app;
:mod:`.pod_http` is the small HTTP/1.1 client the pods are spoken to with; :mod:`.pd`
carries a request split over a prefill and a decode pod; :mod:`.client_watch` stops a
request whose client left; :mod:`.headers` says which headers cross, :mod:`.errors`
what an error looks like; :mod:`.metrics` counts what happened to each request.
"""

from kvindex.api.gateway.app import Gateway
from kvindex.api.gateway.asgi import GatewayApp

__all__ = ["Gateway", "GatewayApp"]

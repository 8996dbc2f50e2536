"""``kvindex gateway``: an OpenAI-compatible front door that routes each request with
``/route`` and forwards it, unchanged, to the chosen vLLM pod.

One module per job: :mod:`.bodies` reads and tokenizes the OpenAI request as vLLM will;
:mod:`.routes` asks for a decision (in-process or over HTTP); :mod:`.upstream` connects
to the chosen pod (another when connecting fails) and relays the answer; :mod:`.app` is
the work per endpoint and :mod:`.asgi` serves it; :mod:`.pod_http` is the HTTP/1.1
client to the pods; :mod:`.pd` splits a request over a prefill and a decode pod;
:mod:`.client_watch` stops a request whose client left; :mod:`.headers`,
:mod:`.errors` and :mod:`.metrics` say which headers cross, what errors look like and
what is counted.
"""

from kvindex.api.gateway.app import Gateway
from kvindex.api.gateway.asgi import GatewayApp

__all__ = ["Gateway", "GatewayApp"]

"""``kvindex gateway``: an OpenAI-compatible front door that routes each request with
``/route`` and forwards it, unchanged, to the chosen vLLM pod.

One module per job: :mod:`.bodies` reads the OpenAI request and tokenizes it as vLLM
will; :mod:`.routes` asks for a decision (in-process, or over HTTP with the client);
:mod:`.upstream` connects to the chosen pod, trying another when the connection fails
before any byte was sent, and relays the answer chunk by chunk; :mod:`.app` is the HTTP
surface (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``).
"""

from kvindex.api.gateway.app import Gateway, create_gateway_app, install_gateway

__all__ = ["Gateway", "create_gateway_app", "install_gateway"]

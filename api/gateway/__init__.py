"""``kvindex gateway``: an OpenAI-compatible front door that routes each request with
``/route`` and forwards it, unchanged, to the chosen vLLM pod (:mod:`.app` is the work per
endpoint, :mod:`.asgi` serves it, :mod:`.upstream` talks to the pods)."""

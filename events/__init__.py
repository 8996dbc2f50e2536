"""KV-cache events: the wire formats (``wire/``), the subscriber runtime (``ingest/``) and
Kubernetes discovery (``discovery/``). Knows nothing about the index; ``errors`` is the
bottom every package imports."""

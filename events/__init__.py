"""KV-cache event wire: vLLM structs, subscriber, replay, engine-side publisher."""

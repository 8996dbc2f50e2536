"""The KV-event wire: vLLM's and SGLang's formats, the compiled scanner, the engine-side
publisher, captures. No threads."""

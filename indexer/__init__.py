"""The block index: vLLM-compatible keys, backends, applying event batches."""

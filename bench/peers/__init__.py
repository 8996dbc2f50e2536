"""Helpers of ``bench/compare_peers.py``: kvindex beside NVIDIA Dynamo's KV indexer."""

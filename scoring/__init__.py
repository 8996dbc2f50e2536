"""Prompt to block keys to per-pod cached-prefix scores."""

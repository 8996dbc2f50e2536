"""Benchmarks and the cluster simulator (not installed; run from the repository root)."""

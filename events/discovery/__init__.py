"""Kubernetes pod discovery: which pods publish events, and where."""

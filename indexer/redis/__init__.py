"""The Redis backend: one index shared by replicas and kept across restarts, with stream
leases."""

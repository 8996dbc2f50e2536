"""The in-process backend (the embedded default): the block table, snapshots, sharing with
serving workers."""

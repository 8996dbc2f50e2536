"""Fixtures shared across test modules."""

from tests.redis_fixtures import redis_cluster, redis_server  # noqa: F401

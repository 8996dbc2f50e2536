"""Fixtures shared across test modules."""

from collections.abc import Iterator

import pytest
import zmq

from tests.redis_fixtures import redis_cluster, redis_server  # noqa: F401


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    """A ZMQ context of the test's own, destroyed (sockets and all) after it."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)

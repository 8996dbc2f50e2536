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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with a ``slow`` test run first. The workers are handed whole files in
    collection order (``--dist loadfile``), so a long file handed out last keeps one
    worker busy while the other idles; with the slow files first, the many short ones
    fill in at the end. Order within a file is kept (the sort is stable)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)

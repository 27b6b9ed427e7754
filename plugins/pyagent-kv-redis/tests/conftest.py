"""Fixtures of the pyagent-kv-redis tests: a real ``redis-server`` (skipped, with the
reason, when none is installed), started by ``pyagent_kv_redis.testing.RedisServer``."""

from __future__ import annotations

import pytest

from pyagent_kv_redis.testing import RedisServer, find_server

SKIP_REASON = "redis-server is not installed (apt-get install redis-server, or set PYAGENT_REDIS_SERVER)"


def _require_server() -> None:
    if find_server() is None:
        pytest.skip(SKIP_REASON)


@pytest.fixture(scope="session")
def redis_server():
    """One server for the session; tests that stop or pause it use ``own_redis_server``."""
    _require_server()
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    """The session server's URL, emptied before the test."""
    if not redis_server.running:  # a test broke it: bring it back
        redis_server.start()
    redis_server.flushall()
    return redis_server.url


@pytest.fixture
def own_redis_server():
    """A server of this test's own, free to be stopped, paused and started again."""
    _require_server()
    with RedisServer() as server:
        yield server


@pytest.fixture
def make_connector():
    """``make_connector(url, **config)`` -> a RedisConnector, closed after the test."""
    from pyagent_kv_redis.connector import RedisConnector

    made = []

    def make(url, **config):
        connector = RedisConnector({"url": url, **config})
        made.append(connector)
        return connector

    yield make
    for connector in made:
        connector.close()

"""Redis going away, stalling and coming back."""

import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

FAST = {"socket_timeout": 0.3, "connect_timeout": 0.3}
CALLS = {
    "contains": lambda c: c.contains([b"k"]),
    "get": lambda c: c.get([b"k"]),
    "put": lambda c: c.put({b"k": b"v"}),
}


@pytest.mark.parametrize("call", CALLS)
def test_stopped_server_raises_fast_and_recovers(own_redis_server, make_connector, call):
    c = make_connector(own_redis_server.url, **FAST)
    c.put({b"k": b"v"})
    assert c.get([b"k"]) == [b"v"]
    own_redis_server.stop()
    for _ in range(2):  # again: the failed call left nothing half-done behind
        start = time.monotonic()
        with pytest.raises((RedisConnectionError, RedisTimeoutError)):
            CALLS[call](c)
        assert time.monotonic() - start < FAST["socket_timeout"] + 1.0
    assert c.stats()["errors"] == 2

    own_redis_server.start()  # same port, empty (no persistence)
    assert c.get([b"k"]) == [None]
    CALLS[call](c)
    c.put({b"k": b"again"})
    assert c.get([b"k"]) == [b"again"] and c.contains([b"k"]) == [True]
    assert c.stats()["errors"] == 2


def test_never_started_server_raises(make_connector):
    from pyagent_kv_redis.testing import free_port

    c = make_connector(f"redis://127.0.0.1:{free_port()}/0", **FAST)
    start = time.monotonic()
    with pytest.raises(RedisConnectionError):
        c.get([b"k"])
    assert time.monotonic() - start < 1.0


def _checkout(pool):
    try:
        return pool.get_connection()
    except TypeError:  # redis-py 5.0-5.2 wants a command name
        return pool.get_connection("PING")


def test_dead_pooled_connections_do_not_poison_later_calls(own_redis_server, make_connector):
    """The server restarts between two calls: every idle pooled connection is dead,
    and the very next calls must still work (no failed call first)."""
    c = make_connector(own_redis_server.url, **FAST)
    c.put({b"k": b"v"})
    pool = c.client.connection_pool
    conns = [_checkout(pool) for _ in range(4)]  # four live connections in the pool
    for conn in conns:
        pool.release(conn)

    own_redis_server.stop()
    own_redis_server.start()

    for i in range(6):
        c.put({b"k%d" % i: b"v%d" % i})
        assert c.get([b"k%d" % i]) == [b"v%d" % i]
        assert c.contains([b"k%d" % i]) == [True]
    assert c.stats()["errors"] == 0


@pytest.mark.parametrize("call", CALLS)
def test_a_connection_that_breaks_during_a_call_is_retried_once(redis_url, make_connector, monkeypatch, call):
    """A socket error while sending (a connection that died after the pool checked it)
    costs one reconnect on a fresh connection, not a failed call."""
    c = make_connector(redis_url, **FAST)
    c.put({b"k": b"v"})
    cls = c.client.connection_pool.connection_class
    original = cls.send_packed_command
    failures = []

    def flaky(self, command, *args, **kwargs):
        if not failures:
            failures.append(command)
            raise RedisConnectionError("injected: connection reset by peer")
        return original(self, command, *args, **kwargs)

    monkeypatch.setattr(cls, "send_packed_command", flaky)
    CALLS[call](c)
    assert len(failures) == 1
    assert c.get([b"k"]) == [b"v"] and c.stats()["errors"] == 0


def test_stalled_server_times_out_without_a_stale_reply(own_redis_server, make_connector):
    """A paused (SIGSTOP) server answers nothing: the call raises TimeoutError after
    about socket_timeout (once: timeouts are not retried), and once it resumes the late
    reply to that call is not mistaken for the answer to the next one."""
    c = make_connector(own_redis_server.url, socket_timeout=0.5, connect_timeout=0.5)
    c.put({b"a": b"value of a", b"b": b"value of b"})
    own_redis_server.pause()
    try:
        start = time.monotonic()
        with pytest.raises(RedisTimeoutError):
            c.get([b"a"])
        elapsed = time.monotonic() - start
        assert 0.4 <= elapsed < 0.9, elapsed
    finally:
        own_redis_server.resume()
    assert c.get([b"b"]) == [b"value of b"]
    assert c.contains([b"a", b"zzz"]) == [True, False]
    assert c.stats()["errors"] == 1

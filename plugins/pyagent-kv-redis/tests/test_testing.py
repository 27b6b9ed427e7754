"""pyagent_kv_redis.testing.RedisServer, the helper the other tests stand on."""

import pytest

from pyagent_kv_redis.testing import RedisServer, RedisServerError, find_server

pytestmark = pytest.mark.skipif(find_server() is None, reason="redis-server is not installed (apt-get install redis-server, or set PYAGENT_REDIS_SERVER)")


def test_start_stop_start_on_the_same_port():
    server = RedisServer()
    with server:
        port, directory = server.port, server.dir
        assert server.url == f"redis://127.0.0.1:{port}/0"
        assert server.ping() and server.running
        server.command("SET", "x", b"\xff")
        assert server.command("GET", "x") == b"\xff"
        server.stop()
        assert not server.running and not server.ping()
        server.start()
        assert server.port == port and server.ping()
        assert server.command("GET", "x") is None  # no persistence
        assert server.command("CONFIG", "GET", "save") == [b"save", b""]
        assert server.command("CONFIG", "GET", "appendonly") == [b"appendonly", b"no"]
        assert directory.is_dir()
    assert not server.running
    assert not directory.exists()  # close() removed it


def test_a_server_that_does_not_start_reports_its_log():
    with pytest.raises(RedisServerError, match="(?s)exited with status.*log:.*no-such-option"):
        RedisServer(extra_args=["--no-such-option", "1"]).start()


def test_port_taken_by_another_server_is_not_mistaken_for_ours():
    with RedisServer() as first:
        second = RedisServer(port=first.port, startup_timeout=5)
        with pytest.raises(RedisServerError, match="(?i)in use"):
            second.start()
        second.close()
        assert first.ping()


def test_find_server_honours_the_environment(monkeypatch, tmp_path):
    real = find_server()
    monkeypatch.setenv("PYAGENT_REDIS_SERVER", str(tmp_path / "nope"))
    assert find_server() is None
    monkeypatch.setenv("PYAGENT_REDIS_SERVER", real)
    assert find_server() == real

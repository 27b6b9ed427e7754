"""RedisConnector against a real redis-server."""

import os
import threading

import pytest

from pyagent_kv_redis.connector import DEFAULTS, RedisConnector

# Values the kernel would store are framed binary: every byte value, invalid UTF-8,
# NULs, CR/LF (RESP's line end), and a larger blob.
VALUES = {
    b"\x00": bytes(range(256)),
    b"\xff" * 32: b"\xff\xfe\xfd\x80\xc3\x28",  # not UTF-8
    b"\r\n": b"\r\n$-1\r\n*0\r\n",  # RESP-looking bytes are just bytes
    os.urandom(32): os.urandom(1 << 20),
    b"k": b"",  # an empty value is a value, not a miss
}


def test_round_trip_of_binary_values(redis_url, make_connector):
    c = make_connector(redis_url)
    keys = list(VALUES)
    assert c.contains(keys) == [False] * len(keys)
    c.put(VALUES)
    assert c.contains(keys) == [True] * len(keys)
    got = c.get(keys)
    assert got == [VALUES[k] for k in keys]
    assert all(type(v) is bytes for v in got)
    s = c.stats()
    assert s["bytes_out"] == s["bytes_in"] == sum(map(len, VALUES.values()))
    assert s["keys_stored"] == s["hits"] == len(VALUES) and s["misses"] == 0


def test_missing_keys_mixed_with_present_ones(redis_url, make_connector):
    c = make_connector(redis_url)
    c.put({b"a": b"1", b"c": b"3"})
    keys = [b"a", b"b", b"c", b"d", b"a"]
    assert c.contains(keys) == [True, False, True, False, True]
    assert c.get(keys) == [b"1", None, b"3", None, b"1"]
    assert c.stats()["misses"] == 2


def test_overwrite_replaces_the_value(redis_url, make_connector):
    c = make_connector(redis_url)
    c.put({b"a": b"old"})
    c.put({b"a": b"new"})
    assert c.get([b"a"]) == [b"new"]


def test_key_layout_is_prefix_plus_hex(redis_server, redis_url, make_connector):
    c = make_connector(redis_url)
    c.put({b"\x01\xab": b"v"})
    assert redis_server.command("KEYS", "*") == [b"pyagent:kv:01ab"]
    assert c.redis_key(b"\x01\xab") == b"pyagent:kv:01ab"
    assert redis_server.command("GET", "pyagent:kv:01ab") == b"v"


def _spy_round_trips(monkeypatch, connector):
    """Count packets handed to the socket layer (one per pipeline or command)."""
    cls = connector.client.connection_pool.connection_class
    original = cls.send_packed_command
    sent = []

    def spy(self, command, *args, **kwargs):
        sent.append(command)
        return original(self, command, *args, **kwargs)

    monkeypatch.setattr(cls, "send_packed_command", spy)
    return sent


def test_one_round_trip_per_batch(redis_url, make_connector, monkeypatch):
    c = make_connector(redis_url)
    c.contains([b"warm-up"])  # connect (and its handshake) outside the count
    sent = _spy_round_trips(monkeypatch, c)
    before = c.stats()["round_trips"]
    items = {i.to_bytes(4, "big"): os.urandom(100) for i in range(200)}
    c.put(items)
    assert len(sent) == 1
    assert c.contains(list(items)) == [True] * 200
    assert len(sent) == 2
    assert c.get(list(items)) == list(items.values())
    assert len(sent) == 3
    assert c.stats()["round_trips"] - before == 3
    # Empty batches: no round trip at all.
    assert c.contains([]) == [] and c.get([]) == [] and c.put({}) is None
    assert len(sent) == 3 and c.stats()["round_trips"] - before == 3


def test_empty_batches_need_no_server():
    c = RedisConnector({"url": "redis://127.0.0.1:1/0"})
    assert c.contains([]) == [] and c.get([]) == [] and c.put({}) is None
    assert c.stats()["round_trips"] == 0
    c.close()


def test_ttl_is_set(redis_server, redis_url, make_connector):
    c = make_connector(redis_url, ttl=120)
    c.put({b"a": b"1", b"b": b"2"})
    for key in (b"a", b"b"):
        assert 118 <= redis_server.command("TTL", c.redis_key(key)) <= 120


def test_default_ttl(redis_server, redis_url, make_connector):
    c = make_connector(redis_url)
    c.put({b"a": b"1"})
    assert DEFAULTS["ttl"] - 2 <= redis_server.command("TTL", c.redis_key(b"a")) <= DEFAULTS["ttl"]


@pytest.mark.parametrize("ttl", [0, None])
def test_ttl_zero_or_none_means_no_expiry(redis_server, redis_url, make_connector, ttl):
    c = make_connector(redis_url, ttl=ttl)
    c.put({b"a": b"1"})
    assert redis_server.command("TTL", c.redis_key(b"a")) == -1  # exists, no expiry


def test_fractional_ttl_in_milliseconds(redis_server, redis_url, make_connector):
    c = make_connector(redis_url, ttl=2.5)
    c.put({b"a": b"1"})
    assert 2000 < redis_server.command("PTTL", c.redis_key(b"a")) <= 2500


def test_values_expire(redis_url, make_connector):
    import time

    c = make_connector(redis_url, ttl=0.2)
    c.put({b"a": b"1"})
    assert c.get([b"a"]) == [b"1"]
    time.sleep(0.35)
    assert c.get([b"a"]) == [None] and c.contains([b"a"]) == [False]


def test_key_prefix_isolates_connectors(redis_url, make_connector):
    one = make_connector(redis_url, key_prefix="model-a:")
    two = make_connector(redis_url, key_prefix=b"model-b:")
    one.put({b"k": b"from one", b"only-one": b"x"})
    two.put({b"k": b"from two"})
    assert one.get([b"k", b"only-one"]) == [b"from one", b"x"]
    assert two.get([b"k", b"only-one"]) == [b"from two", None]
    assert two.contains([b"only-one"]) == [False]


def test_values_over_max_value_size_are_skipped(redis_url, make_connector, monkeypatch):
    c = make_connector(redis_url, max_value_size=100)
    c.put({b"small": b"x" * 100, b"big": b"x" * 101})
    assert c.get([b"small", b"big"]) == [b"x" * 100, None]
    s = c.stats()
    assert s["skipped_too_large"] == 1 and s["keys_stored"] == 1 and s["bytes_out"] == 100
    # A batch of only oversized values makes no round trip.
    sent = _spy_round_trips(monkeypatch, c)
    before = s["round_trips"]
    c.put({b"big2": b"y" * 1000})
    assert sent == [] and c.stats()["round_trips"] == before
    assert c.stats()["skipped_too_large"] == 2


def test_bytes_like_keys_and_values(redis_url, make_connector):
    c = make_connector(redis_url)
    c.put({memoryview(b"ba"): memoryview(b"mv"), b"b": bytearray(b"\x00\x01")})
    assert c.get([bytearray(b"ba"), b"b"]) == [b"mv", b"\x00\x01"]


@pytest.mark.parametrize("key", [b"", b"x" * 65])
def test_bad_key_length(key):
    c = RedisConnector({"url": "redis://127.0.0.1:1/0"})
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        c.get([key])
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        c.put({key: b"v"})
    assert c.stats()["round_trips"] == 0


def test_a_64_byte_key_is_fine(redis_url, make_connector):
    c = make_connector(redis_url)
    c.put({b"\xee" * 64: b"v"})
    assert c.get([b"\xee" * 64]) == [b"v"]


def test_str_keys_and_values_are_refused():
    c = RedisConnector({"url": "redis://127.0.0.1:1/0"})
    with pytest.raises(TypeError, match="key must be bytes"):
        c.contains(["text"])
    with pytest.raises(TypeError, match="value must be bytes"):
        c.put({b"k": "text"})


def test_shared_between_threads(redis_url, make_connector):
    c = make_connector(redis_url)
    errors = []

    def work(t):
        try:
            for i in range(20):
                key = bytes([t, i])
                c.put({key: key * 10})
                assert c.get([key]) == [key * 10]
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert c.stats()["round_trips"] == 8 * 20 * 2


def test_close_then_use_again(redis_url, make_connector):
    c = make_connector(redis_url)
    c.put({b"a": b"1"})
    c.close()
    c.close()  # idempotent
    assert c.get([b"a"]) == [b"1"]  # a new pool, made on demand

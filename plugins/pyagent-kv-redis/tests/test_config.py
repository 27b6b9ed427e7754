"""Config validation: nothing here needs a server."""

import pytest

from pyagent_kv_redis.connector import DEFAULTS, RedisConnector


def test_defaults():
    c = RedisConnector({})
    assert c.url == "redis://127.0.0.1:6379/0"
    assert c.key_prefix == b"pyagent:kv:"
    assert c.ttl == 3600
    assert c.socket_timeout == 1.0 and c.connect_timeout == 1.0
    assert c.max_value_size == 64 * 1024 * 1024
    assert c._client is None  # the pool is made on first use
    assert RedisConnector(None).url == DEFAULTS["url"]


def test_unknown_key_is_named_and_known_keys_listed():
    with pytest.raises(ValueError) as info:
        RedisConnector({"url": "redis://127.0.0.1:6379/0", "tll": 5, "host": "x"})
    msg = str(info.value)
    assert "'host'" in msg and "'tll'" in msg
    for known in DEFAULTS:
        assert known in msg


@pytest.mark.parametrize("ttl", [-1, -0.5, "-3"])
def test_negative_ttl(ttl):
    with pytest.raises(ValueError, match="'ttl'"):
        RedisConnector({"ttl": ttl})


@pytest.mark.parametrize(
    "key, value",
    [
        ("ttl", "soon"),
        ("ttl", True),
        ("socket_timeout", 0),
        ("socket_timeout", -1),
        ("connect_timeout", None),
        ("max_value_size", 0),
        ("max_value_size", 1.5),
        ("key_prefix", 7),
        ("url", "http://127.0.0.1:6379"),
        ("url", 6379),
    ],
)
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ValueError, match=repr(key)):
        RedisConnector({key: value})


def test_numeric_strings_from_a_command_line_are_accepted():
    c = RedisConnector({"ttl": "60", "socket_timeout": "0.25", "max_value_size": "1024"})
    assert c.ttl == 60 and c.socket_timeout == 0.25 and c.max_value_size == 1024


def test_config_must_be_a_mapping():
    with pytest.raises(TypeError):
        RedisConnector(["url"])


def test_repr_hides_the_password():
    c = RedisConnector({"url": "redis://user:s3cret@127.0.0.1:6379/0"})
    assert "s3cret" not in repr(c) and "***" in repr(c)

"""``RedisConnector``: the kernel's KV-cache blocks in Redis.

Values are opaque bytes. The kernel frames them (header, raw tensor bytes, checksum)
and validates them on read; this module only moves bytes and never decodes,
interprets or unpickles them (``decode_responses=False``).

Key layout: ``key_prefix`` (UTF-8) + ``key.hex()``, e.g. ``b"pyagent:kv:9f86d0..."``.

Round trips: ``contains`` is one non-transactional pipeline of ``EXISTS`` (one per
key), ``get`` is one ``MGET``, ``put`` is one non-transactional pipeline of
``SET key value [EX ttl]``. An empty batch makes no round trip.

Failures (connection refused, timeout, server gone, error replies) propagate as
redis-py exceptions (``redis.exceptions.ConnectionError``, ``TimeoutError``,
``ResponseError``, all ``redis.exceptions.RedisError``); the kernel counts them as
misses and backs off. A connection error is retried once, at once, on a fresh
connection, so a pooled connection left dead by a server restart costs one reconnect,
not a failed call; a timeout is not retried, so a stalled server fails a call within
about ``socket_timeout``.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.retry import Retry

from pyagent_framework.interfaces import KVConnector

__all__ = ["DEFAULTS", "MAX_KEY_BYTES", "RedisConnector"]

#: Config keys and their defaults.
DEFAULTS: dict[str, Any] = {
    "url": "redis://127.0.0.1:6379/0",
    "key_prefix": "pyagent:kv:",
    "ttl": 3600,
    "socket_timeout": 1.0,
    "connect_timeout": 1.0,
    "max_value_size": 64 * 1024 * 1024,
}

#: Longest accepted key (a block hash), in bytes.
MAX_KEY_BYTES = 64

#: Seconds a pooled connection may sit idle before redis-py PINGs it before use.
HEALTH_CHECK_INTERVAL = 30

_URL_SCHEMES = ("redis", "rediss", "unix")
_STAT_NAMES = (
    "round_trips",
    "errors",
    "bytes_in",
    "bytes_out",
    "keys_stored",
    "hits",
    "misses",
    "skipped_too_large",
)


def _number(name: str, value: Any, *, allow_zero: bool) -> float:
    """``value`` as a float (numeric strings accepted, for command-line configs)."""
    if isinstance(value, bool):
        raise ValueError(f"redis kv_connector config {name!r} must be a number, got {value!r}")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"redis kv_connector config {name!r} must be a number, got {value!r}") from None
    if not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"redis kv_connector config {name!r} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"redis kv_connector config {name!r} must be {bound}, got {value!r}")
    return float(value)


def _redact(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for repr and messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[-1]}"))


def _as_bytes(what: str, value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"redis kv_connector: {what} must be bytes, got {type(value).__name__}")


class RedisConnector(KVConnector):
    """A :class:`~pyagent_framework.interfaces.KVConnector` backed by Redis.

    ``config`` keys (all optional; anything else is a ``ValueError``):

    - ``url``: ``redis://[[user]:password@]host:port/db``, ``rediss://...`` or
      ``unix:///path.sock?db=N`` (default ``redis://127.0.0.1:6379/0``);
    - ``key_prefix``: str or bytes put before ``key.hex()`` (default ``"pyagent:kv:"``);
    - ``ttl``: seconds a stored value lives (default 3600; ``0``/``None``: no expiry;
      whole seconds use ``EX``, fractions ``PX``);
    - ``socket_timeout`` / ``connect_timeout``: seconds (default 1.0 each);
    - ``max_value_size``: bytes; a larger value is not stored and is counted in
      ``stats()["skipped_too_large"]`` (default 64 MiB).

    Keys are non-empty ``bytes`` of at most 64 bytes. The connection pool is created on
    first use. The object is safe to share between threads.
    """

    def __init__(self, config: Mapping[str, Any] | None = None):
        if config is None:
            config = {}
        if not isinstance(config, Mapping):
            raise TypeError(f"redis kv_connector config must be a mapping, got {type(config).__name__}")
        unknown = sorted(str(k) for k in config if k not in DEFAULTS)
        if unknown:
            raise ValueError(
                f"unknown redis kv_connector config key(s): {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(sorted(DEFAULTS))}"
            )
        cfg = {**DEFAULTS, **config}

        url = cfg["url"]
        if not isinstance(url, str) or urlsplit(url).scheme not in _URL_SCHEMES:
            raise ValueError(
                f"redis kv_connector config 'url' must be a redis://, rediss:// or unix:// URL, got {url!r}"
            )
        self.url: str = url

        prefix = cfg["key_prefix"]
        if isinstance(prefix, str):
            prefix = prefix.encode("utf-8")
        elif isinstance(prefix, (bytes, bytearray)):
            prefix = bytes(prefix)
        else:
            raise ValueError(f"redis kv_connector config 'key_prefix' must be str or bytes, got {prefix!r}")
        self.key_prefix: bytes = prefix

        ttl = cfg["ttl"]
        if ttl is None:
            ttl = 0
        ttl = _number("ttl", ttl, allow_zero=True)
        # SET EX takes whole seconds, PX milliseconds: fractions go as PX.
        self.ttl: int | float | None = (int(ttl) if ttl.is_integer() else ttl) or None
        self._set_kwargs: dict[str, int] = {}
        if ttl and ttl.is_integer():
            self._set_kwargs = {"ex": int(ttl)}
        elif ttl:
            self._set_kwargs = {"px": max(1, round(ttl * 1000))}

        self.socket_timeout = _number("socket_timeout", cfg["socket_timeout"], allow_zero=False)
        self.connect_timeout = _number("connect_timeout", cfg["connect_timeout"], allow_zero=False)
        max_size = _number("max_value_size", cfg["max_value_size"], allow_zero=False)
        if not max_size.is_integer():
            raise ValueError(f"redis kv_connector config 'max_value_size' must be whole bytes, got {max_size!r}")
        self.max_value_size = int(max_size)

        self._client: redis.Redis | None = None
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(_STAT_NAMES, 0)

    def __repr__(self) -> str:
        return f"RedisConnector(url={_redact(self.url)!r}, key_prefix={self.key_prefix!r}, ttl={self.ttl!r})"

    # -- connection -------------------------------------------------------------------

    @property
    def client(self) -> redis.Redis:
        """The redis-py client (and its connection pool), created on first use."""
        client = self._client
        if client is None:
            with self._lock:
                client = self._client
                if client is None:
                    client = self._client = redis.Redis.from_url(
                        self.url,
                        socket_timeout=self.socket_timeout,
                        socket_connect_timeout=self.connect_timeout,
                        health_check_interval=HEALTH_CHECK_INTERVAL,
                        socket_keepalive=True,
                        decode_responses=False,
                        # One immediate retry on a fresh connection for connection
                        # errors only (a pooled socket the server closed; a refused
                        # connect fails fast anyway). Timeouts are not retried, so a
                        # stalled server costs one socket_timeout, not several.
                        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
                    )
        return client

    def close(self) -> None:
        """Disconnect every pooled connection. A later call reconnects."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.connection_pool.disconnect()
            client.close()

    def __enter__(self) -> RedisConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- keys -------------------------------------------------------------------------

    def _key(self, key: Any) -> bytes:
        key = _as_bytes("a key", key)
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"redis kv_connector: a key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}")
        return self.key_prefix + key.hex().encode("ascii")

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key a block key is stored under (``key_prefix + key.hex()``)."""
        return self._key(key)

    # -- the interface ----------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        rkeys = [self._key(k) for k in keys]
        if not rkeys:
            return []

        def call(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for rk in rkeys:
                pipe.exists(rk)
            return pipe.execute()

        return [bool(n) for n in self._round_trip(call)]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        rkeys = [self._key(k) for k in keys]
        if not rkeys:
            return []
        values = self._round_trip(lambda client: client.mget(rkeys))
        hits = [v for v in values if v is not None]
        self._count(hits=len(hits), misses=len(values) - len(hits), bytes_in=sum(len(v) for v in hits))
        return list(values)

    def put(self, items: Mapping[bytes, bytes]) -> None:
        batch: list[tuple[bytes, bytes]] = []
        skipped = 0
        pairs: Iterable[tuple[Any, Any]] = items.items()
        for key, value in pairs:
            rk = self._key(key)
            value = _as_bytes("a value", value)
            if len(value) > self.max_value_size:
                skipped += 1
                continue
            batch.append((rk, value))
        if skipped:
            self._count(skipped_too_large=skipped)
        if not batch:
            return

        def call(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for rk, value in batch:
                pipe.set(rk, value, **self._set_kwargs)
            return pipe.execute()

        self._round_trip(call)
        self._count(keys_stored=len(batch), bytes_out=sum(len(v) for _, v in batch))

    # -- bookkeeping ------------------------------------------------------------------

    def _round_trip(self, call):
        client = self.client
        self._count(round_trips=1)
        try:
            return call(client)
        except RedisError:
            self._count(errors=1)
            # The server may have gone away: drop the idle pooled connections too, so
            # none of them is handed out dead later. In-use ones are left alone (other
            # threads); redis-py disconnects the one that failed.
            with contextlib.suppress(Exception):  # best effort: the original error matters
                client.connection_pool.disconnect(inuse_connections=False)
            raise

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._stats[name] += delta

    def stats(self) -> dict[str, int]:
        """Counters since construction.

        ``round_trips`` (batches sent; a redis-py reconnect-and-retry is not counted
        twice), ``errors`` (round trips that raised), ``bytes_in`` (value bytes read by
        ``get``), ``bytes_out`` (value bytes written by ``put``), ``keys_stored``,
        ``hits`` / ``misses`` (keys found / not found by ``get``), ``skipped_too_large``
        (values over ``max_value_size`` not stored).
        """
        with self._lock:
            return dict(self._stats)

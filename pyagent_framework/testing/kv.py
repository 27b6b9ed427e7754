"""A contract for KV connector plugins, and an in-memory connector to test engines with.

A connector's tests subclass :class:`KVConnectorContract` and provide a ``connector``
fixture (a fresh, empty store); they get the behaviour the engine relies on:
round trips of arbitrary bytes, misses as ``None``/``False``, batches in order, keys
kept apart, overwrites, and values that are never interpreted (a pickle payload
comes back as the same bytes, unexecuted).
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Mapping, Sequence

import pytest

from pyagent_framework.interfaces import KVConnector


class MemoryConnector(KVConnector):
    """A dict in this process: the reference store, with fault injection for tests.

    ``fail`` (an exception instance or None) is raised by every call while set;
    ``calls`` counts calls by method name.
    """

    def __init__(self, config: Mapping | None = None) -> None:
        unknown = set(config or {}) - {"shared"}
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)}; known: shared")
        # "shared": a dict several connectors (engines) use as one store.
        self.data: dict[bytes, bytes] = (config or {}).get("shared", {})
        self.fail: Exception | None = None
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def _enter(self, name: str) -> None:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
        if self.fail is not None:
            raise self.fail

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._enter("contains")
        return [key in self.data for key in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        self._enter("get")
        return [self.data.get(key) for key in keys]

    def put(self, items: Mapping[bytes, bytes]) -> None:
        self._enter("put")
        with self._lock:
            self.data.update({key: bytes(value) for key, value in items.items()})


class KVConnectorContract:
    """Subclass in a connector plugin's tests and define a ``connector`` fixture."""

    @pytest.fixture
    def connector(self) -> KVConnector:  # pragma: no cover - provided by the subclass
        raise NotImplementedError("define a `connector` fixture returning a fresh, empty store")

    def test_round_trip_of_arbitrary_bytes(self, connector):
        values = {os.urandom(32): os.urandom(n) for n in (1, 255, 4096, 100_000)}
        connector.put(values)
        keys = list(values)
        assert connector.contains(keys) == [True] * len(keys)
        assert connector.get(keys) == [values[key] for key in keys]

    def test_misses_are_none_and_false_in_batch_order(self, connector):
        present, absent = os.urandom(32), os.urandom(32)
        connector.put({present: b"value"})
        assert connector.contains([absent, present, absent]) == [False, True, False]
        assert connector.get([absent, present]) == [None, b"value"]
        assert connector.get([]) == [] and connector.contains([]) == []

    def test_keys_are_kept_apart_and_overwrites_win(self, connector):
        a, b = b"\x00" * 32, b"\x00" * 31 + b"\x01"
        connector.put({a: b"first", b: b"other"})
        connector.put({a: b"second"})
        assert connector.get([a, b]) == [b"second", b"other"]

    def test_values_are_moved_not_interpreted(self, connector, monkeypatch):
        payload = pickle.dumps(object())
        key = os.urandom(32)

        def refuse(*args, **kwargs):
            raise AssertionError("a connector must never unpickle")

        monkeypatch.setattr(pickle, "loads", refuse)
        monkeypatch.setattr(pickle, "load", refuse)
        monkeypatch.setattr(pickle, "Unpickler", refuse)
        connector.put({key: payload})
        assert connector.get([key]) == [payload]

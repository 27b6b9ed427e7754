from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence


class KVConnector(ABC):
    """A store of KV-cache blocks outside the engine's memory, keyed by block hash.

    Built as ``cls(config)`` from the ``--kv-connector-config`` mapping. Values are
    opaque bytes: the kernel frames them (header with format version, model identity,
    shape, checksum; then raw tensor bytes) and validates them on read, so a connector
    only moves bytes. Batched calls keep round trips down. Errors raised here count as
    misses; the kernel retries later with back-off.
    """

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    @abstractmethod
    def put(self, items: Mapping[bytes, bytes]) -> None: ...

    def close(self) -> None:
        """Release connections and files."""

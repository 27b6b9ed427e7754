"""``DiskConnector``: KV-cache blocks as files in a size-bounded local directory."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pyagent_framework import registries
from pyagent_framework.interfaces import KVConnector
from pyagent_framework.sizes import parse_size

logger = logging.getLogger("pyagent_kv_disk")

#: Longest key accepted, in bytes (the file name is its hex: 128 characters + ".kv").
MAX_KEY_BYTES = 64
DEFAULT_MAX_SIZE = "4GiB"
DEFAULT_POLICY = "lru"
SUFFIX = ".kv"
TEMP_PREFIX = "."
TEMP_SUFFIX = ".tmp"
#: Temp files older than this (seconds) found on start are leftovers of a crashed writer.
STALE_TEMP_AGE = 3600.0
_HEX = frozenset("0123456789abcdef")


def default_path() -> Path:
    """``$XDG_CACHE_HOME/pyagent/kv``, or ``~/.cache/pyagent/kv`` when it is unset
    (or not absolute, as the XDG base directory spec asks)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "pyagent" / "kv"


def _check_key(key: Any) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"keys must be bytes, got {type(key).__name__}")
    if not key or len(key) > MAX_KEY_BYTES:
        raise ValueError(f"keys must be 1 to {MAX_KEY_BYTES} bytes long, got {len(key)} bytes")


class DiskConnector(KVConnector):
    """A directory of opaque byte values keyed by ``bytes`` (KV-cache block hashes).

    Config (``--kv-connector-config``), every key optional:

    - ``path``: the directory, created (mode 0700) if missing; default
      ``$XDG_CACHE_HOME/pyagent/kv`` or ``~/.cache/pyagent/kv``.
    - ``max_size``: the size limit, bytes or a string such as ``"10GiB"``; default
      ``"4GiB"``. Only value bytes count (not file-system overhead).
    - ``eviction_policy``: a name from ``registries.eviction_policies`` (``lru``,
      ``lfu``, ``arc``, ``s3fifo``, ``native-*``, ...); default ``"lru"``.
    - ``fsync``: fsync each value (and its directory) around the rename; default False.

    Layout: ``<path>/<hex[:2]>/<hex>.kv`` with ``hex = key.hex()``. Each value is
    written to a unique temp file in the same directory and moved into place with
    ``os.replace``, so a reader sees the old complete file or the new complete file,
    never a partial one. Values are never interpreted: the framework frames and
    validates them.

    Eviction: every stored file is an evictable entry of the policy (nothing pins a
    file), named by an int id. ``put`` files it (``insert`` + ``release``); a ``get``
    hit is a reuse (``touch`` + ``release``); while the bytes accounted exceed
    ``max_size`` the policy's victim is deleted. The policy is built on first need
    with ``capacity = max(1, max_size // mean value size)`` (the mean of the files
    indexed on start, else the first value stored): the number of values that fit,
    which is what ``capacity`` means to the policies (S3-FIFO sizes its small queue
    at 10% of it; ARC bounds its target and ghosts by it).

    Sharing: several processes may use one directory. Each keeps its own accounting:
    the files it indexed on start, wrote, or read from others (a ``get`` hit on a
    file it did not know adopts it). The limit is therefore per process view and
    approximate when shared; a restart re-indexes the whole directory and enforces
    it on everything found. ``contains`` checks the files themselves, so values
    written by other processes are seen.

    Thread safe: one lock guards the in-memory index and the policy; file contents
    are written and read outside it (renames and deletions happen under it).
    """

    KNOWN_KEYS = ("path", "max_size", "eviction_policy", "fsync")

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        config = dict(config or {})
        unknown = sorted(set(config) - set(self.KNOWN_KEYS), key=str)
        if unknown:
            raise ValueError(
                f"DiskConnector: unknown config key(s) {', '.join(map(repr, unknown))} "
                f"(known: {', '.join(self.KNOWN_KEYS)})"
            )

        path = config.get("path")
        if path is None or path == "":
            self.path = default_path()
        elif isinstance(path, (str, os.PathLike)):
            self.path = Path(path).expanduser()
        else:
            raise ValueError(f"DiskConnector: path must be a string, got {type(path).__name__}")

        try:
            self.max_size = parse_size(config.get("max_size", DEFAULT_MAX_SIZE))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"DiskConnector: bad max_size {config.get('max_size')!r}: {exc}") from None

        fsync = config.get("fsync", False)
        if not isinstance(fsync, bool):
            raise ValueError(f"DiskConnector: fsync must be true or false, got {fsync!r}")  # noqa: TRY004
        self.fsync = fsync

        name = config.get("eviction_policy", DEFAULT_POLICY)
        if not isinstance(name, str) or name not in registries.eviction_policies:
            available = ", ".join(registries.eviction_policies.names())
            raise ValueError(f"DiskConnector: unknown eviction_policy {name!r} (available: {available})")
        self.eviction_policy = name
        self._policy_cls = registries.eviction_policies.load(name)
        self._policy: Any = None
        #: The capacity the policy was built with (None until it is built).
        self.capacity: int | None = None

        self._lock = threading.Lock()
        self._ids: dict[bytes, int] = {}  # key -> policy id
        self._entries: dict[int, tuple[bytes, int]] = {}  # policy id -> (key, size)
        self._next_id = 0
        self._bytes = 0
        self._evictions = 0
        self._skipped_too_large = 0
        self._closed = False

        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._index_existing()

    # ------------------------------------------------------------------ files

    def file_of(self, key: bytes) -> Path:
        """Where the value of ``key`` lives."""
        hex_ = key.hex()
        return self.path / hex_[:2] / (hex_ + SUFFIX)

    def _index_existing(self) -> None:
        """Index the files already there (oldest mtime first) and enforce the limit;
        delete temp files older than an hour (a crashed writer's)."""
        found: list[tuple[int, str, bytes, int]] = []  # (mtime_ns, name, key, size)
        now = time.time()
        with os.scandir(self.path) as top:
            subdirs = [e.path for e in top if len(e.name) == 2 and set(e.name) <= _HEX and e.is_dir()]
        for subdir in sorted(subdirs):
            prefix = os.path.basename(subdir)
            try:
                entries = list(os.scandir(subdir))
            except FileNotFoundError:
                continue
            for entry in entries:
                name = entry.name
                try:
                    if name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX):
                        if now - entry.stat().st_mtime > STALE_TEMP_AGE:
                            os.unlink(entry.path)
                        continue
                    if not name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
                        continue
                    hex_ = name[: -len(SUFFIX)]
                    if not hex_.startswith(prefix) or not set(hex_) <= _HEX or len(hex_) % 2:
                        continue
                    key = bytes.fromhex(hex_)
                    if not key or len(key) > MAX_KEY_BYTES:
                        continue
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # another process removed it meanwhile
                found.append((st.st_mtime_ns, name, key, st.st_size))
        if not found:
            return
        found.sort()
        with self._lock:
            self._build_policy(sum(size for *_, size in found) // len(found))
            for _, _, key, size in found:
                self._file(key, size)
            self._evict_over_limit()

    # ------------------------------------------------------------------ index (lock held)

    def _build_policy(self, reference_size: int) -> None:
        if self._policy is None:
            self.capacity = max(1, self.max_size // max(1, reference_size))
            self._policy = self._policy_cls(self.capacity)

    def _file(self, key: bytes, size: int) -> None:
        """Account a newly stored (or newly seen) value: filed, then evictable."""
        block = self._next_id
        self._next_id += 1
        self._ids[key] = block
        self._entries[block] = (key, size)
        self._bytes += size
        self._policy.insert(block)
        self._policy.release(block)

    def _reuse(self, key: bytes, size: int) -> None:
        """A known value was used again: a hit, or a put of a key already stored."""
        block = self._ids[key]
        _, old = self._entries[block]
        self._entries[block] = (key, size)
        self._bytes += size - old
        self._policy.touch(block)
        self._policy.release(block)

    def _forget(self, key: bytes) -> None:
        """The value's file is gone (another process evicted it): drop it."""
        block = self._ids.pop(key, None)
        if block is not None:
            _, size = self._entries.pop(block)
            self._bytes -= size
            self._policy.remove(block)

    def _evict_over_limit(self) -> None:
        while self._bytes > self.max_size:
            try:
                block = self._policy.evict()
            except LookupError:  # cannot happen (every file is evictable); be safe
                logger.warning(
                    "eviction policy %r has no victim at %d bytes",
                    self.eviction_policy,
                    self._bytes,
                )
                return
            entry = self._entries.pop(block, None)
            if entry is None:
                continue
            key, size = entry
            del self._ids[key]
            self._bytes -= size
            self._evictions += 1
            try:
                os.unlink(self.file_of(key))
            except FileNotFoundError:
                pass  # already gone (another process evicted it)
            except OSError as exc:
                logger.warning("cannot delete evicted %s: %s", self.file_of(key), exc)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("DiskConnector is closed")

    # ------------------------------------------------------------------ KVConnector

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = list(keys)
        for key in keys:
            _check_key(key)
        self._check_open()
        found = [self.file_of(key).is_file() for key in keys]
        missing = [key for key, ok in zip(keys, found) if not ok and key in self._ids]
        if missing:
            with self._lock:
                for key in missing if not self._closed else ():
                    if not self.file_of(key).exists():  # re-checked under the lock
                        self._forget(key)
        return found

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        keys = list(keys)
        for key in keys:
            _check_key(key)
        self._check_open()
        values: list[bytes | None] = []
        for key in keys:
            try:
                with open(self.file_of(key), "rb") as f:
                    values.append(f.read())
            except FileNotFoundError:
                values.append(None)
        with self._lock:
            if self._closed:
                return values
            for key, value in zip(keys, values):
                if value is not None:
                    if key in self._ids:
                        self._reuse(key, len(value))
                    elif len(value) <= self.max_size and self.file_of(key).exists():
                        # another process's file: adopt it (file it, and this was a use)
                        self._build_policy(len(value))
                        self._file(key, len(value))
                        self._policy.touch(self._ids[key])
                        self._policy.release(self._ids[key])
                elif key in self._ids and not self.file_of(key).exists():
                    self._forget(key)
            self._evict_over_limit()
        return values

    def put(self, items: Mapping[bytes, bytes]) -> None:
        batch: list[tuple[bytes, memoryview]] = []
        for key, value in items.items():
            _check_key(key)
            try:
                view = memoryview(value)
            except TypeError:
                raise TypeError(f"values must be bytes-like, got {type(value).__name__} for key {key.hex()}") from None
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B") if view.c_contiguous else memoryview(view.tobytes())
            batch.append((key, view))
        self._check_open()
        for key, view in batch:
            size = view.nbytes
            if size > self.max_size:
                with self._lock:
                    self._skipped_too_large += 1
                continue  # could never fit; storing it would only flush the cache
            self._write(key, view, size)

    def _write(self, key: bytes, view: memoryview, size: int) -> None:
        final = self.file_of(key)
        final.parent.mkdir(mode=0o700, exist_ok=True)
        fd, temp = tempfile.mkstemp(
            prefix=TEMP_PREFIX + final.stem[:16] + "-",
            suffix=TEMP_SUFFIX,
            dir=final.parent,
        )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(view)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            with self._lock:
                os.replace(temp, final)
                temp = None
                if self._closed:
                    return
                self._build_policy(size)
                if key in self._ids:
                    self._reuse(key, size)
                else:
                    self._file(key, size)
                self._evict_over_limit()
        finally:
            if temp is not None:
                try:
                    os.unlink(temp)
                except OSError:
                    pass
        if self.fsync:
            self._fsync_dir(final.parent)

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass  # some file systems cannot fsync a directory
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ extras

    def stats(self) -> dict[str, int]:
        """This process's view: files and bytes accounted, evictions, values skipped
        because they were larger than ``max_size``."""
        with self._lock:
            return {
                "files": len(self._ids),
                "bytes": self._bytes,
                "evictions": self._evictions,
                "skipped_too_large": self._skipped_too_large,
            }

    def __len__(self) -> int:
        return len(self._ids)

    def close(self) -> None:
        """Drop the in-memory index (the files stay). Idempotent; later calls raise."""
        with self._lock:
            self._closed = True
            self._ids.clear()
            self._entries.clear()
            self._bytes = 0
            self._policy = None

    def __repr__(self) -> str:
        return (
            f"DiskConnector(path={str(self.path)!r}, max_size={self.max_size}, "
            f"eviction_policy={self.eviction_policy!r}, files={len(self._ids)}, bytes={self._bytes})"
        )

"""Moving computed KV blocks through a KV connector (``--kv-connector NAME``).

A connector plugin is a store of opaque byte values keyed by block hash
(:class:`~pyagent_framework.interfaces.KVConnector`: ``contains``, ``get``, ``put``).
Everything else is done here, once for every store:

- **Framing** (:func:`encode_block` / :func:`decode_block`): a value is a fixed
  little-endian header (magic, format version, dtype, layer count, block shape, model
  identity, the block's own key, payload length, sha256 of the payload) followed by the
  block's raw tensor bytes, ``[num_layers, 2, block_size, num_kv_heads, head_dim]``.
  Every field is checked on read; anything else (a truncated file, a flipped byte, a
  block of another model, a pickle someone stored under the key) is a miss with a
  counted reason, never an exception and never deserialized.
- **Scheduler side** (:meth:`KVTransfer.load_prefix`): when a sequence is admitted,
  after the local prefix cache, the hashes of its next full prompt blocks are looked up
  (one ``contains``), blocks are allocated for the run found, fetched (one ``get``),
  validated in order and written into the KV cache; the sequence starts after the
  last good one. A block that fails is recomputed, like any miss.
- **Worker side** (:meth:`KVTransfer.save`): blocks the engine files after a step are
  copied out of the cache (on the engine thread, before they can be reused) and
  framed and ``put`` by a background thread, off the engine loop. At most
  ``max_pending_saves`` blocks wait as copies: when the store cannot keep up, saves
  are dropped and counted, the engine never waits (except a ``producer``'s finished
  request, whose answer says its blocks are stored).
- **Faults**: a connector call that raises counts as a failure of its kind (its
  blocks are misses); after ``failure_threshold`` consecutive failures the connector
  is left alone for ``backoff_seconds`` (circuit breaker), then tried again.

Roles (``--kv-role``): ``producer`` saves, ``consumer`` loads, ``both`` (default) does
both. The uses (offload to a bigger tier, prefix sharing between instances, prefill
on one instance and decode on another) are all this one mechanism: what one engine
saves, any engine of the same model finds by hash.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import queue
import struct
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pyagent_framework.engine.faults import describe_failure
from pyagent_framework.engine.kv_cache import BlockPool, block_hash, root_hash
from pyagent_framework.engine.sequence import Sequence
from pyagent_framework.interfaces import KVConnector

logger = logging.getLogger("pyagent_framework.engine")

MAGIC = b"PYAGKV\r\n"  # the \r\n catches text-mode mangling, as PNG's signature does
FORMAT_VERSION = 1
ROLES = ("producer", "consumer", "both")
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.int8: 4, torch.float8_e4m3fn: 5}
_DTYPE_NAMES = {code: dtype for dtype, code in _DTYPES.items()}
# magic, version, dtype, reserved, layers, block_size, kv heads, head dim,
# model identity (32), key length, key (64, zero padded), payload length, payload sha256 (32)
_HEADER = struct.Struct("<8sHBBIIII32sI64sQ32s")
HEADER_SIZE = _HEADER.size


class BlockError(ValueError):
    """A stored value that is not the block asked for; ``reason`` names the check."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class BlockLayout:
    """What every block of one engine's cache looks like."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    model_identity: bytes  # 32 bytes, see loader.model_identity

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_size(self) -> int:
        count = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return count * torch.empty((), dtype=self.dtype).element_size()


def encode_block(layout: BlockLayout, key: bytes, block: torch.Tensor) -> bytes:
    """Header + raw bytes of ``block`` (``layout.shape``, ``layout.dtype``, on the CPU)."""
    if tuple(block.shape) != layout.shape or block.dtype != layout.dtype:
        raise ValueError(f"block of shape {tuple(block.shape)} {block.dtype}, expected {layout.shape} {layout.dtype}")
    if len(key) > 64:
        raise ValueError(f"key of {len(key)} bytes; at most 64")
    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, _DTYPES[layout.dtype], 0, layout.num_layers, layout.block_size,
        layout.num_kv_heads, layout.head_dim, layout.model_identity, len(key), key, len(payload),
        hashlib.sha256(payload).digest(),
    )  # fmt: skip
    return header + payload


def decode_block(layout: BlockLayout, key: bytes, value: bytes) -> torch.Tensor:
    """The block stored in ``value`` as a CPU tensor of ``layout.shape``; a
    :class:`BlockError` naming the first check that fails."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise BlockError("type", f"value is a {type(value).__name__}, not bytes")
    if bytes(value[: len(MAGIC)]) != MAGIC:
        raise BlockError("format", "not a KV block (bad magic)")
    if len(value) < HEADER_SIZE:
        raise BlockError("truncated", f"value of {len(value)} bytes is shorter than the {HEADER_SIZE}-byte header")
    (_, version, dtype, _, layers, block_size, kv_heads, head_dim, model, key_len, stored_key, length, digest) = (
        _HEADER.unpack_from(value)
    )
    if version != FORMAT_VERSION:
        raise BlockError("version", f"format version {version}, this engine reads {FORMAT_VERSION}")
    if model != layout.model_identity:
        raise BlockError("model", "block of another model (model identity differs)")
    if _DTYPE_NAMES.get(dtype) != layout.dtype:
        raise BlockError("dtype", f"dtype code {dtype}, expected {layout.dtype}")
    if (layers, block_size, kv_heads, head_dim) != layout.shape[:1] + layout.shape[2:]:
        raise BlockError("shape", f"shape {(layers, 2, block_size, kv_heads, head_dim)}, expected {layout.shape}")
    if key_len > 64 or stored_key[:key_len] != key:
        raise BlockError("key", "block stored under another key")
    if length != layout.payload_size or len(value) != HEADER_SIZE + length:
        raise BlockError("truncated", f"{len(value) - HEADER_SIZE} payload bytes, expected {layout.payload_size}")
    payload = memoryview(value)[HEADER_SIZE:]
    if hashlib.sha256(payload).digest() != digest:
        raise BlockError("checksum", "payload checksum mismatch")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(layout.dtype).view(layout.shape)


class CircuitBreaker:
    """Open after ``threshold`` consecutive failures; closed again ``backoff`` seconds
    later, when the next call is let through to try the connector again."""

    def __init__(self, threshold: int, backoff: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold = threshold
        self.backoff = backoff
        self.clock = clock
        self.failures = 0
        self.open_until = 0.0
        self.times_opened = 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            return self.clock() >= self.open_until

    def success(self) -> None:
        with self._lock:
            self.failures = 0

    def failure(self) -> None:
        with self._lock:
            self.failures += 1
            if self.failures >= self.threshold:
                self.open_until = self.clock() + self.backoff
                self.failures = 0
                self.times_opened += 1


class KVTransfer:
    """The engine's side of a KV connector: lookups and loads for the scheduler, saves
    after each step, framing, metrics and the circuit breaker (module docstring).

    ``kv_cache`` is the engine's whole cache, ``[num_layers, 2, num_blocks,
    block_size, num_kv_heads, head_dim]``.
    """

    def __init__(
        self,
        connector: KVConnector,
        kv_cache: torch.Tensor,
        *,
        model_identity: bytes,
        role: str = "both",
        failure_threshold: int = 3,
        backoff_seconds: float = 10.0,
        max_pending_saves: int = 256,
        clock: Callable[[], float] = time.monotonic,
        name: str | None = None,
    ) -> None:
        """``name`` is the connector's registry name, for the log lines of its failures."""
        if role not in ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(ROLES)}, got {role!r}")
        for option, value in (("failure_threshold", failure_threshold), ("max_pending_saves", max_pending_saves)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{option} must be a positive integer, got {value!r}")
        if isinstance(backoff_seconds, bool) or not isinstance(backoff_seconds, (int, float)) or backoff_seconds < 0:
            raise ValueError(f"backoff_seconds must be a non-negative number, got {backoff_seconds!r}")
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        self.connector = connector
        self.kv_cache = kv_cache
        self.layout = BlockLayout(num_layers, block_size, num_kv_heads, head_dim, kv_cache.dtype, model_identity)
        self.loads = role in ("consumer", "both")
        self.saves = role in ("producer", "both")
        self.role = role
        self.name = name
        self.breaker = CircuitBreaker(failure_threshold, backoff_seconds, clock)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # counts and _stored: the engine and the saver thread
        self._stored: OrderedDict[bytes, None] = OrderedDict()  # keys known to be in the store (bounded)
        self._pending: queue.Queue = queue.Queue()
        self._max_pending_blocks = max_pending_saves  # copies waiting to be saved, in blocks
        self._pending_blocks = 0
        self._saver: threading.Thread | None = None
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))  # queued saves are not lost at exit

    # ------------------------------------------------------------------ connector calls

    def _call(self, kind: str, fn, *args) -> tuple[bool, object]:
        """Run one connector call under the breaker: ``(True, result)``, or ``(False,
        None)`` when the breaker is open or the call raised (counted either way)."""
        if not self.breaker.allow():
            self._count(f"{kind}_skipped")
            return False, None
        try:
            result = fn(*args)
        except Exception as exc:  # any store error is a miss, never a failed request
            self._count(f"{kind}_failures")
            self.breaker.failure()
            logger.warning(
                "%s; counted as a miss (%d failures in a row pause the connector for %gs)",
                describe_failure("kv_connector", self.name or type(self.connector).__name__, getattr(fn, "__name__", kind), exc),
                self.breaker.threshold, self.breaker.backoff,
            )
            return False, None
        self.breaker.success()
        return True, result

    # ------------------------------------------------------------------ scheduler side

    def load_prefix(self, seq: Sequence, pool: BlockPool) -> int:
        """After the local prefix cache: load the run of ``seq``'s next full prompt
        blocks the store has, into newly allocated blocks; returns the tokens loaded
        (counted as computed, and filed in the local prefix cache)."""
        if not self.loads or seq.params.prompt_logprobs is not None:
            return 0
        bs = self.layout.block_size
        eligible = (seq.num_tokens - 1) // bs  # one prompt token is always computed
        start = len(seq.block_hashes)
        if start >= eligible or seq.num_computed_tokens != start * bs or len(seq.block_ids) != start:
            return 0
        parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(pool.model_key, seq.cache_salt, pool.hash_algorithm, seq.lora_key)
        keys = []
        for i in range(start, eligible):
            parent = block_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]), pool.hash_algorithm)
            keys.append(parent)
        self._count("lookup_blocks", len(keys))
        ok, present = self._call("lookup", self.connector.contains, keys)
        if not ok or len(present) != len(keys):
            return 0
        run = next((i for i, found in enumerate(present) if not found), len(keys))
        if run == 0 or not pool.allocate(seq, (start + run) * bs):
            return 0
        ok, values = self._call("load", self.connector.get, keys[:run])
        if not ok or len(values) != run:
            return 0
        loaded = 0
        for key, value in zip(keys[:run], values):
            if value is None:
                self._count("load_missing")
                break
            try:
                block = decode_block(self.layout, key, value)
            except BlockError as exc:
                self._count(f"load_rejected_{exc.reason}")
                logger.warning("kv connector: block rejected (%s): %s", exc.reason, exc)
                break
            target = seq.block_ids[start + loaded]
            self.kv_cache[:, :, target].copy_(block.to(self.kv_cache.device), non_blocking=False)
            self._remember(key)
            loaded += 1
        self._count("loaded_blocks", loaded)
        if loaded:
            seq.num_computed_tokens = (start + loaded) * bs
            pool.cache_full_blocks(seq)  # files them: later sequences hit them locally
        return loaded * bs

    # ------------------------------------------------------------------ worker side

    def save(self, filed: list[tuple[bytes, int]]) -> None:
        """Queue newly filed blocks ``(hash, block id)`` for saving: their contents are
        copied now (the blocks may be reused by the next step), framed and stored by
        the background saver."""
        if not self.saves or not filed or self._closed:
            return
        with self._lock:
            todo = [(key, block) for key, block in filed if key not in self._stored]
        if not todo:
            return
        if not self.breaker.allow():
            self._count("save_skipped", len(todo))
            return
        with self._lock:  # the copies wait in memory: at most max_pending_saves blocks of them
            room = self._max_pending_blocks - self._pending_blocks
            dropped, todo = todo[max(0, room):], todo[: max(0, room)]
            self._pending_blocks += len(todo)
            if dropped:
                self.counts["save_dropped"] += len(dropped)
        if not todo:
            return
        index = torch.tensor([block for _, block in todo], device=self.kv_cache.device)
        # Through bytes: torch cannot index_select an fp8 tensor on the CPU.
        raw = self.kv_cache.view(torch.uint8).index_select(2, index).view(self.kv_cache.dtype)
        copies = raw.movedim(2, 0).to("cpu")  # [n, layers, 2, bs, kvh, d]
        if self._saver is None:
            self._saver = threading.Thread(target=self._save_loop, name="pyagent-kv-saver", daemon=True)
            self._saver.start()
        self._pending.put(([key for key, _ in todo], copies))

    def _save_loop(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is None:
                    return
                keys, copies = item
                values = {key: encode_block(self.layout, key, copies[i]) for i, key in enumerate(keys)}
                ok, _ = self._call("save", self.connector.put, values)
                if ok:
                    for key in keys:
                        self._remember(key)
                    self._count("saved_blocks", len(keys))
            except Exception:  # a bug here must not kill the saver thread
                logger.exception("kv connector: saving blocks failed")
                self._count("save_failures")
            finally:
                if item is not None:
                    with self._lock:
                        self._pending_blocks -= len(item[0])
                self._pending.task_done()

    def _remember(self, key: bytes) -> None:
        """Note a key the store holds, so it is not saved again (the last 65,536)."""
        with self._lock:
            self._stored[key] = None
            self._stored.move_to_end(key)
            if len(self._stored) > 1 << 16:
                self._stored.popitem(last=False)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is done (True), or ``timeout`` passes."""
        if self._saver is None:
            return True
        if timeout is None:
            self._pending.join()
            return True
        deadline = time.monotonic() + timeout
        while self._pending.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._saver is not None:
            self._pending.put(None)
            self._saver.join(timeout=10)
        try:
            self.connector.close()
        except Exception as exc:
            logger.warning("kv connector close failed: %s", exc)

    def stats(self) -> dict[str, int | float | str]:
        out: dict[str, int | float | str] = {"kv_connector_role": self.role}
        with self._lock:
            out.update({f"kv_connector_{name}": count for name, count in sorted(self.counts.items())})
        out["kv_connector_breaker_opened"] = self.breaker.times_opened
        out["kv_connector_pending_saves"] = self._pending_blocks
        return out


def _close_at_exit(ref: weakref.ref) -> None:
    transfer = ref()
    if transfer is not None:
        transfer.close()

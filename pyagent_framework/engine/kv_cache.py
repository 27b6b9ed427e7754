"""The paged KV cache's block pool: fixed-size blocks, per-sequence block lists, and
the prefix cache.

Blocks are allocated as tokens are scheduled, so a sequence never holds more blocks
than ``ceil(computed_tokens / block_size)``.

Prefix caching: once every token of a sequence's block has been computed, the block
is filed under a chained content hash (sha256 by default, ``xxh3_128`` opt-in, over
the parent block's hash and the block's token ids; the chain's root mixes in the hash
name, the model and the request's ``cache_salt``). A new sequence starts from the longest run of its prompt's full
blocks found filed, sharing them (reference counts) instead of recomputing them; a hit
is confirmed against the block's token ids, never taken on the hash alone. A released
block whose content is filed stays in the cache, handed to the eviction policy, until
a block is needed and none is free: then the policy picks the victim. A block in use
is never evicted.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import deque

from pyagent_framework.engine.faults import describe_failure, is_builtin
from pyagent_framework.engine.sequence import Sequence
from pyagent_framework.interfaces import EvictionPolicy

logger = logging.getLogger("pyagent_framework.engine")

_HASH_DOMAIN = b"pyagent-framework kv-block v1"
HASH_ALGORITHMS = ("sha256", "xxh3_128")


def _hasher(algorithm: str):
    """A fresh hash object for ``algorithm`` (``xxh3_128`` needs the xxhash package)."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise ValueError("prefix_cache_hash 'xxh3_128' needs the xxhash package (pip install xxhash)") from None
        return xxhash.xxh3_128()
    raise ValueError(f"prefix_cache_hash must be one of {', '.join(HASH_ALGORITHMS)}, got {algorithm!r}")


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _encode(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<Q", len(data)) + data  # length-prefixed: no two keys collide by concatenation


def root_hash(model_key: str, cache_salt: str | None, algorithm: str = "sha256", adapter: str | None = None) -> bytes:
    """Where a sequence's hash chain starts: the hash, the model, the tenant's salt and
    the LoRA adapter's identity (none for the base model)."""
    digest = _hasher(algorithm)
    digest.update(_HASH_DOMAIN)
    digest.update(_encode(algorithm))
    digest.update(_encode(model_key))
    digest.update(b"\x00" if cache_salt is None else b"\x01" + _encode(cache_salt))
    if adapter is not None:
        digest.update(b"\x02" + _encode(adapter))
    return digest.digest()


def block_hash(parent: bytes, token_ids: tuple[int, ...] | list[int], algorithm: str = "sha256") -> bytes:
    """hash(parent hash, token ids as little-endian int64)."""
    digest = _hasher(algorithm)
    digest.update(parent)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        eviction_policy: EvictionPolicy | None = None,
        model_key: str = "",
        hash_algorithm: str = "sha256",
        policy_name: str | None = None,
    ) -> None:
        """``eviction_policy`` turns prefix caching on (``None``: off); a policy plugin
        (``policy_name``: its registry name) that fails is replaced by LRU."""
        _hasher(hash_algorithm)  # unknown name or missing package: ValueError now, not mid-step
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.policy = eviction_policy
        self.policy_name = policy_name  # the entry that runs ("lru" once a plugin's failed)
        if eviction_policy is not None and policy_name is not None and not is_builtin("eviction_policy", policy_name):
            self.policy = GuardedPolicy(eviction_policy, policy_name, self)
        self.model_key = model_key
        self.hash_algorithm = hash_algorithm
        # Blocks that hold nothing worth keeping, in reuse order.
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        # The prefix cache: filed blocks, by hash and by id.
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        # Metrics (tokens looked up / found, blocks evicted).
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0

    @property
    def caching(self) -> bool:
        return self.policy is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus cached ones nobody uses."""
        return len(self._free) + (len(self.policy) if self.policy is not None else 0)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_of)

    # ------------------------------------------------------------------ allocation

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still lacks to hold its first ``num_tokens`` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_ids))

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` enough blocks for ``num_tokens`` tokens; False (and no change)
        when the pool cannot."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            return False
        seq.block_ids.extend(self._take() for _ in range(needed))
        return True

    def reserve(self) -> int:
        """A free block taken out of circulation for good (never handed to a sequence,
        cached or evicted): where the CUDA graphs' padding rows write."""
        if not self._free:
            raise ValueError("no free block to reserve")
        return self._take()

    def _take(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block = self.policy.evict()  # a cached block nobody uses
            self._unfile(block)
            self.evictions += 1
        self._refs[block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks, last block first (so, among its filed
        blocks, the prefix is released last and evicted last under LRU)."""
        for block in reversed(seq.block_ids):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self.policy.release(block)
                else:
                    self._free.append(block)
        seq.block_ids = []
        seq.block_hashes = []

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past those ``seq``'s tokens need (blocks that held only
        a rejected speculative draft's keys; never filed, so they go to the free list)."""
        keep = blocks_for(seq.num_tokens, self.block_size)
        while len(seq.block_ids) > keep:
            block = seq.block_ids.pop()
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self.policy.release(block)
                else:
                    self._free.append(block)

    # ------------------------------------------------------------------ prefix cache

    def match_prefix(self, seq: Sequence) -> int:
        """Share the longest filed run of ``seq``'s full prompt blocks; returns the
        number of tokens found (now counted as computed). At least one prompt token
        is always left to compute, whose logits sample the first output token.
        Requests asking for prompt logprobs compute their whole prompt."""
        if self.policy is None or seq.block_ids or seq.num_computed_tokens:
            return 0
        if seq.params.prompt_logprobs is not None:
            return 0
        bs = self.block_size
        eligible = (seq.num_tokens - 1) // bs
        self.prefix_queries += eligible * bs
        parent = root_hash(self.model_key, seq.cache_salt, self.hash_algorithm, seq.lora_key)
        hashes: list[bytes] = []
        blocks: list[int] = []
        for i in range(eligible):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            digest = block_hash(parent, tokens, self.hash_algorithm)
            block = self._by_hash.get(digest)
            if block is None or self._tokens_of[block] != tokens:
                break
            hashes.append(digest)
            blocks.append(block)
            parent = digest
        for block in blocks:
            if self._refs[block] == 0:
                self.policy.touch(block)
            self._refs[block] += 1
        seq.block_ids = blocks
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(blocks) * bs
        self.prefix_hits += seq.num_computed_tokens
        return seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> list[tuple[bytes, int]]:
        """File the blocks of ``seq`` whose tokens are all computed (call after a step);
        returns the ``(hash, block id)`` pairs this call filed."""
        if self.policy is None:
            return []
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_ids))
        if full <= len(seq.block_hashes):
            return []  # nothing new to file (most decode steps)
        filed = []
        parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(self.model_key, seq.cache_salt, self.hash_algorithm, seq.lora_key)
        for i in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            digest = block_hash(parent, tokens, self.hash_algorithm)
            seq.block_hashes.append(digest)
            parent = digest
            block = seq.block_ids[i]
            if block in self._hash_of or digest in self._by_hash:
                continue  # already filed (a shared hit), or the same content lies in another block
            self._by_hash[digest] = block
            self._hash_of[block] = digest
            self._tokens_of[block] = tokens
            self.policy.insert(block)
            filed.append((digest, block))
        return filed

    def evictable_blocks(self) -> list[int]:
        """Filed blocks nobody uses: what the eviction policy may evict."""
        return [block for block in self._hash_of if self._refs[block] == 0]

    def is_evictable(self, block: object) -> bool:
        return isinstance(block, int) and block in self._hash_of and self._refs[block] == 0

    def _unfile(self, block: int) -> None:
        digest = self._hash_of.pop(block)
        del self._by_hash[digest]
        del self._tokens_of[block]

    def stats(self) -> dict[str, float | int]:
        return {
            "prefix_cache_queries": self.prefix_queries,
            "prefix_cache_hits": self.prefix_hits,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            "prefix_cache_evictions": self.evictions,
            "num_cached_kv_blocks": self.num_cached_blocks,
        }


class GuardedPolicy(EvictionPolicy):
    """An eviction-policy plugin behind a guard. The policy serves the whole engine, so
    its failure must not fail requests: the first call that raises, or an ``evict``
    that names a block that is not evictable (which would hand one request's blocks
    to another), disables it, logs it by name, and the built-in LRU takes over, rebuilt
    from the pool's evictable blocks (filed, nobody using them)."""

    def __init__(self, policy: EvictionPolicy, name: str, pool: BlockPool) -> None:
        self.policy = policy
        self.name = name
        self.pool = pool
        self.failed = False

    def _fall_back(self, call: str, error: BaseException | str) -> None:
        from pyagent_framework import registries

        logger.error(
            "%s; the policy is disabled and prefix caching goes on with the built-in 'lru'",
            describe_failure("eviction_policy", self.name, call, error),
        )
        lru = registries.eviction_policies.load("lru")(self.pool.num_blocks)
        for block in self.pool.evictable_blocks():
            lru.release(block)
        self.policy, self.failed = lru, True
        self.pool.policy_name = "lru"

    def _call(self, call: str, *args):
        try:
            return getattr(self.policy, call)(*args)
        except Exception as exc:
            if self.failed:
                raise  # the built-in policy itself: a bug to surface, not to hide
            self._fall_back(call, exc)
            return getattr(self.policy, call)(*args)

    def insert(self, block: int) -> None:
        self._call("insert", block)

    def touch(self, block: int) -> None:
        self._call("touch", block)

    def release(self, block: int) -> None:
        self._call("release", block)

    def remove(self, block: int) -> None:
        self._call("remove", block)

    def evict(self) -> int:
        block = self._call("evict")
        if not self.failed and not self.pool.is_evictable(block):
            self._fall_back("evict", f"it chose block {block!r}, which is not evictable")
            block = self.policy.evict()
        return block

    def __len__(self) -> int:
        return int(self._call("__len__"))

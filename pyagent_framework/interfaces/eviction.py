from __future__ import annotations

from abc import ABC, abstractmethod


class EvictionPolicy(ABC):
    """Chooses which cached, unreferenced KV block to evict.

    The block manager owns ref counts; the policy only sees events, with blocks named
    by integer id. A block is *evictable* between ``release`` and the next ``touch``.
    Built as ``cls(capacity)`` where ``capacity`` is the number of blocks in the pool.
    Every operation should be O(1) or O(log n).

    - ``insert(block)``: the block now holds cached content and is in use.
    - ``touch(block)``: a request reuses the cached block; it is in use again.
    - ``release(block)``: its last user let go; it may now be evicted.
    - ``remove(block)``: the block left the cache without ``evict`` (invalidated).
    - ``evict()``: pick a victim among evictable blocks, forget it and return its id;
      raise ``LookupError`` when none is evictable.
    - ``len(policy)``: number of evictable blocks.
    """

    @abstractmethod
    def insert(self, block: int) -> None: ...

    @abstractmethod
    def touch(self, block: int) -> None: ...

    @abstractmethod
    def release(self, block: int) -> None: ...

    @abstractmethod
    def remove(self, block: int) -> None: ...

    @abstractmethod
    def evict(self) -> int: ...

    @abstractmethod
    def __len__(self) -> int: ...

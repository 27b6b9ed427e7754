from __future__ import annotations

from collections import OrderedDict

from pyagent_framework.interfaces import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the block released longest ago. O(1) per operation.

    Only released blocks are tracked: insert/touch mark a block in use (so it drops
    out of the eviction order), release appends it as most recent.
    """

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self._evictable: OrderedDict[int, None] = OrderedDict()

    def insert(self, block: int) -> None:
        self._evictable.pop(block, None)

    def touch(self, block: int) -> None:
        self._evictable.pop(block, None)

    def release(self, block: int) -> None:
        self._evictable.pop(block, None)
        self._evictable[block] = None

    def remove(self, block: int) -> None:
        self._evictable.pop(block, None)

    def evict(self) -> int:
        if not self._evictable:
            raise LookupError("no evictable block")
        block, _ = self._evictable.popitem(last=False)
        return block

    def __len__(self) -> int:
        return len(self._evictable)

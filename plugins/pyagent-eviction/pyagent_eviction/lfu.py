"""Least-frequently-used eviction for the prefix cache."""

from __future__ import annotations

import heapq
from collections import OrderedDict

from pyagent_framework.interfaces import EvictionPolicy


class LFUPolicy(EvictionPolicy):
    """Evicts the evictable block whose content was used the fewest times (LFU).

    Use counts: ``insert`` starts a block's count at 1 (its content was just computed
    for one request) and every ``touch`` adds 1 (one more request reuses it). Counts
    are kept while a block is in use and forgotten when it is evicted or removed, so a
    block id filed again with new content starts over at 1. Among evictable blocks with
    the same count, the one released longest ago goes first.

    Data structures: evictable blocks sit in one bucket per count (an ``OrderedDict``
    in release order); a min-heap holds the counts that have a bucket, with lazy
    deletion (a count whose bucket emptied is dropped when it reaches the top). The
    heap is rebuilt when stale counts outnumber live ones, so every operation is O(1)
    or amortized O(log n).

    Lenient on misuse, like the built-in ``lru``: ``insert`` of a tracked block starts
    it over as new content (in use), ``touch`` of an unknown block counts as an
    ``insert``, ``release`` of an unknown block as ``insert`` then ``release``, and
    ``remove`` of an unknown block does nothing.

    When it wins: workloads where a few prefixes (system prompts, few-shot examples)
    are reused far more often than the rest and must survive bursts of one-off
    requests. Its weakness is the classic one of LFU: a prefix that was hot long ago
    keeps its high count after it goes cold.
    """

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self._count: dict[int, int] = {}  # every tracked block (in use or evictable)
        self._buckets: dict[int, OrderedDict[int, None]] = {}  # count -> evictable blocks
        self._heap: list[int] = []  # counts that have (or had) a bucket
        self._in_heap: set[int] = set()
        self._len = 0

    # ------------------------------------------------------------------ helpers

    def _unlist(self, block: int) -> bool:
        """Take ``block`` out of its bucket if it is evictable; True if it was."""
        count = self._count.get(block)
        if count is None:
            return False
        bucket = self._buckets.get(count)
        if bucket is None or block not in bucket:
            return False
        del bucket[block]
        if not bucket:
            del self._buckets[count]  # its heap entry goes stale, dropped lazily
        self._len -= 1
        return True

    def _list(self, block: int) -> None:
        count = self._count[block]
        bucket = self._buckets.get(count)
        if bucket is None:
            bucket = self._buckets[count] = OrderedDict()
            if count not in self._in_heap:
                if len(self._heap) > 2 * len(self._buckets) + 16:
                    self._compact()
                heapq.heappush(self._heap, count)
                self._in_heap.add(count)
        bucket[block] = None
        self._len += 1

    def _compact(self) -> None:
        self._heap = list(self._buckets)
        heapq.heapify(self._heap)
        self._in_heap = set(self._heap)

    # ------------------------------------------------------------------ interface

    def insert(self, block: int) -> None:
        self._unlist(block)
        self._count[block] = 1

    def touch(self, block: int) -> None:
        if block not in self._count:
            self.insert(block)
            return
        self._unlist(block)
        self._count[block] += 1

    def release(self, block: int) -> None:
        if block not in self._count:
            self.insert(block)
        self._unlist(block)  # a second release re-lists it as most recent
        self._list(block)

    def remove(self, block: int) -> None:
        self._unlist(block)
        self._count.pop(block, None)

    def evict(self) -> int:
        if not self._len:
            raise LookupError("no evictable block")
        heap = self._heap
        while heap[0] not in self._buckets:
            self._in_heap.discard(heapq.heappop(heap))
        count = heap[0]
        bucket = self._buckets[count]
        block, _ = bucket.popitem(last=False)
        if not bucket:
            del self._buckets[count]
        self._len -= 1
        del self._count[block]
        return block

    def __len__(self) -> int:
        return self._len

    def count(self, block: int) -> int | None:
        """The use count of a tracked block (None if untracked); for tests and tools."""
        return self._count.get(block)

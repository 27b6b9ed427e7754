"""S3-FIFO eviction (Yang et al., SOSP 2023), adapted to the prefix cache's block ids."""

from __future__ import annotations

import heapq

from pyagent_framework.interfaces import EvictionPolicy

SMALL, MAIN = 0, 1


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO: a small probation FIFO, a main FIFO with CLOCK-like reinsertion.

    - Every cached block has a small use counter, capped at 3 (two bits): 0 when its
      content is filed (``insert``), +1 on each ``touch`` (a request reuses it).
    - ``insert`` puts a block at the head of the *small* queue S. Nothing moves on
      ``touch`` or ``release`` (lazy promotion): a block keeps its queue position
      whether it is in use or not.
    - ``evict`` works on S when S holds at least ``max(1, capacity // 10)`` blocks
      (in use included), else on the main queue M; a queue with no evictable block is
      passed over for the other. From S, the oldest evictable block is evicted if its
      counter is 0, else moved to the head of M with its counter reset to 0 (it must
      be reused again to survive M's next pass). From M, the oldest evictable block is
      evicted if its counter is 0, else reinserted at M's head with its counter
      decremented. This repeats until a victim is found; each step either returns or
      spends one unit of some counter, so the work is amortized over the touches.
    - Blocks in use are never returned and never moved: the eviction scan passes over
      them and they keep their positions, so when released they are as old as their
      queue position says. Each queue keeps its evictable blocks in a min-heap keyed by
      queue position (lazy deletion, rebuilt when stale entries dominate), so every
      operation is O(1) or amortized O(log n).

    **No ghost queue.** S3-FIFO's ghost FIFO remembers content recently evicted from S
    and admits it straight to M when it is requested again. This policy only sees
    integer block ids, and the block pool hands an evicted id to new content at once:
    an ``insert`` of an id recently evicted is different content, and content re-filed
    after eviction arrives under an unrelated id. A ghost keyed by id would never hit
    truthfully, so there is none; every ``insert`` enters S.

    Lenient on misuse, like the built-in ``lru``: ``insert`` of a tracked block starts
    it over in S (in use), ``touch`` of an unknown block counts as an ``insert``,
    ``release`` of an unknown block as ``insert`` then ``release``, and ``remove`` of an
    unknown block does nothing.
    """

    MAX_FREQ = 3
    SMALL_FRACTION = 0.1

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self.small_target = max(1, int(capacity * self.SMALL_FRACTION))
        self._queue: dict[int, int] = {}  # tracked block -> SMALL or MAIN
        self._pos: dict[int, int] = {}  # tracked block -> queue position (larger = newer)
        self._freq: dict[int, int] = {}
        self._size = [0, 0]  # tracked blocks per queue, in use included
        self._evictable: tuple[set[int], set[int]] = (set(), set())
        self._heaps: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
        self._clock = 0

    # ------------------------------------------------------------------ introspection

    def queue_of(self, block: int) -> str | None:
        """``"small"``, ``"main"`` or None (not tracked); for tests and tools."""
        q = self._queue.get(block)
        return None if q is None else ("small", "main")[q]

    def freq(self, block: int) -> int | None:
        return self._freq.get(block)

    # ------------------------------------------------------------------ helpers

    def _enter(self, block: int, q: int) -> None:
        """Put a tracked block at the head of queue ``q`` (keeps its evictability)."""
        old = self._queue.get(block)
        evictable = old is not None and block in self._evictable[old]
        if old is not None:
            self._size[old] -= 1
            self._evictable[old].discard(block)
        self._clock += 1
        self._queue[block] = q
        self._pos[block] = self._clock
        self._size[q] += 1
        if evictable:
            self._list(block)

    def _list(self, block: int) -> None:
        """Mark a tracked block evictable at its current queue position."""
        q = self._queue[block]
        self._evictable[q].add(block)
        heap = self._heaps[q]
        if len(heap) > 2 * len(self._evictable[q]) + 16:
            heap[:] = [(self._pos[b], b) for b in self._evictable[q] if b != block]
            heapq.heapify(heap)
        heapq.heappush(heap, (self._pos[block], block))

    def _oldest(self, q: int) -> int:
        """The oldest evictable block of queue ``q`` (which has one); stays listed."""
        heap = self._heaps[q]
        evictable = self._evictable[q]
        while True:
            pos, block = heap[0]
            if block in evictable and self._pos[block] == pos:
                return block
            heapq.heappop(heap)

    def _forget(self, block: int) -> None:
        q = self._queue.pop(block, None)
        if q is None:
            return
        del self._pos[block], self._freq[block]
        self._size[q] -= 1
        self._evictable[q].discard(block)  # its heap entries go stale

    # ------------------------------------------------------------------ interface

    def insert(self, block: int) -> None:
        self._forget(block)
        self._freq[block] = 0
        self._enter(block, SMALL)

    def touch(self, block: int) -> None:
        q = self._queue.get(block)
        if q is None:
            self.insert(block)
            return
        self._evictable[q].discard(block)
        self._freq[block] = min(self._freq[block] + 1, self.MAX_FREQ)

    def release(self, block: int) -> None:
        q = self._queue.get(block)
        if q is None:
            self.insert(block)
        elif block in self._evictable[q]:
            return  # already evictable: its position is unchanged
        self._list(block)

    def remove(self, block: int) -> None:
        self._forget(block)

    def evict(self) -> int:
        small, main = self._evictable
        if not small and not main:
            raise LookupError("no evictable block")
        while True:
            small, main = self._evictable
            if small and (self._size[SMALL] >= self.small_target or not main):
                block = self._oldest(SMALL)
                if self._freq[block] > 0:
                    self._freq[block] = 0
                    self._enter(block, MAIN)  # promoted: reused while on probation
                    continue
            else:
                block = self._oldest(MAIN)
                if self._freq[block] > 0:
                    self._freq[block] -= 1
                    self._enter(block, MAIN)  # second chance at the head of M
                    continue
            self._forget(block)
            return block

    def __len__(self) -> int:
        return len(self._evictable[SMALL]) + len(self._evictable[MAIN])

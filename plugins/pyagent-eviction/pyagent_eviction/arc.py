"""Adaptive Replacement Cache (Megiddo & Modha), adapted to the prefix cache's block ids."""

from __future__ import annotations

from collections import OrderedDict

from pyagent_framework.interfaces import EvictionPolicy

T1, T2 = 0, 1


class ARCPolicy(EvictionPolicy):
    """ARC adapted to an eviction policy that sees block ids, not content.

    State, as in ARC:

    - ``T1``: cached blocks whose content has been used once (filed by ``insert``,
      never reused since); ``T2``: blocks whose content was reused at least once (a
      ``touch`` moves a block from T1 to T2). Both count blocks in use and evictable
      ones; only evictable ones (released, not touched since) can be victims, taken in
      release order (oldest first) within each list.
    - ``p``: the adaptive target size of T1, between 0 and the capacity, starting at 0.
    - ``B1``/``B2``: the ghost lists, history of content evicted from T1/T2, trimmed
      with ARC's bounds (``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c``,
      ``c`` the capacity).

    Replacement, as in ARC: the victim is T1's oldest evictable block when T1 holds
    more than ``p`` blocks (in use included), else T2's; when the preferred list has no
    evictable block, the other list's is taken.

    **The adaptation.** ARC moves ``p`` on ghost hits: a request for content that was
    recently evicted from T1 (grow T1) or T2 (shrink it). This policy only sees integer
    block ids, and the block pool hands an evicted id to new content straight away: an
    ``insert`` of an id found in a ghost list is *different* content, so a ghost hit by
    id would be a false signal, and content re-filed after eviction arrives under an
    unrelated id. True ghost hits cannot be observed here, so ghosts are kept as their
    lengths only (the number of recent evictions from each list, within ARC's bounds)
    and never hit. ``p`` moves instead on the nearest observable event: a *rescue*, a
    ``touch`` of a block that was evictable, i.e. content the cache could have dropped
    and that a request wanted again. A rescue from T1 grows ``p`` by
    ``max(1, |B2| / |B1|)``, a rescue from T2 shrinks it by ``max(1, |B1| / |B2|)``
    (ARC's step sizes, an empty ghost list counted as 1). Touches of blocks in use
    move them to T2 without adapting ``p``. With ``p`` at 0, once-used blocks are
    evicted before reused ones (scan resistance); when once-used content keeps
    getting reused, ``p`` grows and T1 is kept longer.

    Lenient on misuse, like the built-in ``lru``: ``insert`` of a tracked block starts
    it over in T1 (in use), ``touch`` of an unknown block counts as an ``insert``,
    ``release`` of an unknown block as ``insert`` then ``release``, and ``remove`` of an
    unknown block does nothing. Every operation is O(1).
    """

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self.p = 0.0
        self._where: dict[int, int] = {}  # resident block -> T1 or T2
        self._evictable: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (OrderedDict(), OrderedDict())
        self._size = [0, 0]  # resident blocks per list, in use included
        self._ghost = [0, 0]  # |B1|, |B2|

    # ------------------------------------------------------------------ introspection

    @property
    def t1_size(self) -> int:
        return self._size[T1]

    @property
    def t2_size(self) -> int:
        return self._size[T2]

    @property
    def ghost_sizes(self) -> tuple[int, int]:
        return self._ghost[T1], self._ghost[T2]

    def list_of(self, block: int) -> str | None:
        """``"T1"``, ``"T2"`` or None (not resident); for tests and tools."""
        where = self._where.get(block)
        return None if where is None else ("T1", "T2")[where]

    # ------------------------------------------------------------------ helpers

    def _c(self) -> int:
        return max(self.capacity, self._size[T1] + self._size[T2], 1)

    def _forget(self, block: int) -> int | None:
        where = self._where.pop(block, None)
        if where is not None:
            self._evictable[where].pop(block, None)
            self._size[where] -= 1
        return where

    def _trim_ghosts(self) -> None:
        c = self._c()
        self._ghost[T1] = min(self._ghost[T1], max(0, c - self._size[T1]))
        excess = sum(self._size) + sum(self._ghost) - 2 * c
        for q in (T2, T1):
            if excess <= 0:
                break
            cut = min(self._ghost[q], excess)
            self._ghost[q] -= cut
            excess -= cut

    def _adapt(self, rescued_from: int) -> None:
        b1, b2 = self._ghost
        if rescued_from == T1:
            self.p = min(float(self._c()), self.p + max(1.0, b2 / max(b1, 1)))
        else:
            self.p = max(0.0, self.p - max(1.0, b1 / max(b2, 1)))

    # ------------------------------------------------------------------ interface

    def insert(self, block: int) -> None:
        self._forget(block)
        self._where[block] = T1
        self._size[T1] += 1
        self._trim_ghosts()

    def touch(self, block: int) -> None:
        where = self._where.get(block)
        if where is None:
            self.insert(block)
            return
        evictable = self._evictable[where]
        if block in evictable:  # it could have been evicted: a rescue
            del evictable[block]
            self._adapt(where)
        if where == T1:
            self._where[block] = T2
            self._size[T1] -= 1
            self._size[T2] += 1

    def release(self, block: int) -> None:
        if block not in self._where:
            self.insert(block)
        evictable = self._evictable[self._where[block]]
        evictable.pop(block, None)
        evictable[block] = None  # most recently released

    def remove(self, block: int) -> None:
        self._forget(block)  # invalidated, not evicted: no ghost
        self._trim_ghosts()

    def evict(self) -> int:
        t1, t2 = self._evictable
        if not t1 and not t2:
            raise LookupError("no evictable block")
        q = T1 if t1 and (not t2 or self._size[T1] > self.p) else T2
        block, _ = self._evictable[q].popitem(last=False)
        del self._where[block]
        self._size[q] -= 1
        self._ghost[q] += 1
        self._trim_ghosts()
        return block

    def __len__(self) -> int:
        return len(self._evictable[T1]) + len(self._evictable[T2])

"""The paged KV cache's block pool: fixed-size blocks, per-sequence block lists.

Blocks are allocated as tokens are scheduled, so a sequence never holds more blocks
than ``ceil(computed_tokens / block_size)``. Freed blocks return to the free queue
tail-first, so the blocks most likely to be reused by a shared prefix are the last
to be overwritten.
"""

from __future__ import annotations

from collections import deque

from pyagent_framework.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` still lacks to hold its first ``num_tokens`` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_ids))

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Give ``seq`` enough blocks for ``num_tokens`` tokens; False (and no change)
        when the pool cannot."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            return False
        seq.block_ids.extend(self._free.popleft() for _ in range(needed))
        return True

    def free(self, seq: Sequence) -> None:
        self._free.extend(reversed(seq.block_ids))
        seq.block_ids = []

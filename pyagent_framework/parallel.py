"""Tensor parallelism for model builders: which slice of each layer a rank holds, and
the collectives that join the slices (``torch.distributed``: gloo on a CPU, NCCL on
CUDA).

A model reads :func:`current` while it is built (the engine's worker sets it with
:func:`building`), so architectures keep their ``cls(config, attention_backend)``
constructor. The split follows Megatron-LM's, as vLLM and SGLang do:

- attention: each rank holds whole query heads and the key/value heads they read
  (:meth:`TensorParallel.heads`; key/value heads are replicated when there are fewer
  than ranks), so the attention itself needs no communication;
- column-parallel linears (q/k/v, gate/up) hold a slice of the output features,
  row-parallel ones (o, down) the matching slice of the input features, followed by
  one :meth:`TensorParallel.all_reduce` each;
- the embedding and the LM head hold a range of the vocabulary
  (:meth:`TensorParallel.vocab_range`): a lookup sums the ranks' rows, the logits
  are gathered.

A size of 1 (the default) makes every collective a no-op, so a model built outside a
tensor-parallel worker runs as before.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pyagent_framework.errors import ConfigError


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds: query heads ``[q_start, q_start +
    num_heads)`` and key/value heads ``[kv_start, kv_start + num_kv_heads)`` of the
    model's."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group of ``size`` ranks; ``group`` is
    its ``torch.distributed`` process group (None: the default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in a group of {self.size}")

    def split(self, total: int, what: str) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``total`` (``what`` names it in the error),
        split evenly: a size that does not divide it is a :class:`ConfigError`."""
        if total % self.size:
            raise ConfigError(
                f"tensor_parallel_size {self.size} does not divide the model's {what} ({total})",
                field="tensor_parallel_size",
            )
        share = total // self.size
        return self.rank * share, (self.rank + 1) * share

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        """This rank's query and key/value heads. The size must divide the query
        heads, and divide or be a multiple of the key/value heads; with fewer key/value
        heads than ranks each rank holds the one its query heads read."""
        size, rank = self.size, self.rank
        if num_heads % size or (num_kv_heads % size and size % num_kv_heads):
            raise ConfigError(
                f"tensor_parallel_size {size} must divide the model's {num_heads} attention heads and divide, or be "
                f"a multiple of, its {num_kv_heads} key/value heads",
                field="tensor_parallel_size",
            )
        local = num_heads // size
        if num_kv_heads >= size:
            local_kv = num_kv_heads // size
            return HeadShard(local, local_kv, rank * local, rank * local_kv)
        return HeadShard(local, 1, rank * local, rank // (size // num_kv_heads))

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows of the embedding and the LM head: ``ceil(vocab / size)``
        each, the last rank's range possibly shorter (or empty)."""
        share = -(-vocab_size // self.size)
        return min(vocab_size, self.rank * share), min(vocab_size, (self.rank + 1) * share)

    def all_reduce(self, tensor: Any) -> Any:
        """The sum of ``tensor`` over the group, in place; returns it."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: Any) -> Any:
        """The ranks' ``tensor`` (all of the same shape) side by side along the last
        dimension, in rank order."""
        if self.size == 1:
            return tensor
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_SINGLE = TensorParallel()
_current: contextvars.ContextVar[TensorParallel] = contextvars.ContextVar("pyagent_tensor_parallel", default=_SINGLE)


def current() -> TensorParallel:
    """The tensor-parallel place of the model being built (size 1 outside a worker)."""
    return _current.get()


@contextlib.contextmanager
def building(parallel: TensorParallel) -> Iterator[TensorParallel]:
    """Models built inside this block read ``parallel`` from :func:`current`."""
    token = _current.set(parallel)
    try:
        yield parallel
    finally:
        _current.reset(token)

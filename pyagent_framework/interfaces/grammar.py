from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from pyagent_framework.types import GrammarSpec, TokenizerInfo

#: What :meth:`GrammarBackend.memory_bytes` assumes when a backend cannot say.
DEFAULT_COMPILED_BYTES = 1 << 20


def bitmask_words(vocab_size: int) -> int:
    """``int32`` words in one bitmask row (see :class:`GrammarMatcher`) for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: Any, bitmask: Any) -> None:
    """In place: set to -inf every logit whose bit is clear. ``logits`` is
    ``[batch, vocab]``, ``bitmask`` packed ``int32`` ``[batch, ceil(vocab / 32)]``
    (bit ``t % 32`` of word ``t // 32`` allows token ``t``). The plain definition of
    :meth:`LayerOps.apply_token_bitmask <pyagent_framework.interfaces.LayerOps.apply_token_bitmask>`."""
    import sys

    import numpy as np
    import torch

    batch, vocab = logits.shape
    if sys.byteorder == "little" and logits.device.type == "cpu" and logits.is_contiguous():
        # numpy's single-threaded loops: torch's ops here would each open an OpenMP
        # region whose spinning workers then slow the next forward pass (2 cores).
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, count=vocab, bitorder="little")
        np.putmask(logits.numpy(), bits == 0, -np.inf)
        return
    bitmask = bitmask.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(batch, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))


class GrammarMatcher(ABC):
    """Per-request state of a compiled grammar.

    The bitmask is a packed ``int32`` tensor of shape ``[batch, ceil(vocab_size / 32)]``;
    bit ``t % 32`` of word ``t // 32`` set means token ``t`` is allowed.
    """

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance over the tokens; False (and no change) if one is not allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (all clear once terminated)."""

    @abstractmethod
    def is_terminated(self) -> bool: ...

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding)."""

    @abstractmethod
    def reset(self) -> None: ...


class GrammarBackend(ABC):
    """Compiles structured-output specs and makes matchers.

    Built as ``cls()``. ``supported_kinds`` names the :class:`GrammarSpec` kinds it
    handles; ``compile`` raises ``ValueError`` naming the problem for a bad spec and
    ``NotImplementedError`` for a feature it does not support (so ``auto`` can fall
    back to another backend). ``compile`` runs off the engine loop, on a worker thread
    or in a worker process; it may be called from several threads at once.

    Optional: ``serialize(compiled) -> bytes`` and ``deserialize(data, tokenizer_info)
    -> compiled``, the compiled grammar as bytes and back, bound to the same
    ``TokenizerInfo`` ``compile`` was given (``deserialize`` gets one equal to it). A
    backend with both is compiled in a worker process (the backend built there by its
    registered name), which the engine kills when a compile runs past its timeout; the
    bytes cross that process boundary, so they must not be a pickle. Without them,
    compiles run on threads of the engine's process, and one that runs past its
    timeout is abandoned, still running.
    """

    __required_attributes__ = ("supported_kinds",)
    supported_kinds: frozenset[str]

    @abstractmethod
    def compile(self, spec: GrammarSpec, tokenizer_info: TokenizerInfo) -> Any: ...

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    def memory_bytes(self, compiled: Any) -> int:
        """About how much memory a compiled grammar holds; the engine's compiled-grammar
        cache is bounded by the sum. Backends that can measure it should override this
        conservative flat estimate."""
        return DEFAULT_COMPILED_BYTES

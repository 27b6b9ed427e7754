from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any


class ModelArchitecture(ABC):
    """A causal language model as a plain ``torch.nn.Module``.

    Built as ``cls(config, quantizer=...)`` from the checkpoint's HF-style config
    mapping. ``forward(input_ids, positions, context)`` takes the flattened new tokens
    of a batch and a forward context (attention metadata and per-layer KV caches) and
    returns hidden states; ``compute_logits`` maps hidden states to vocabulary logits;
    ``load_weights`` consumes ``(checkpoint_name, tensor)`` pairs and returns the names
    it loaded. Real entries subclass ``torch.nn.Module``; listing this interface keeps
    the kernel free of torch.
    """

    @abstractmethod
    def forward(self, input_ids: Any, positions: Any, context: Any) -> Any: ...

    @abstractmethod
    def compute_logits(self, hidden_states: Any) -> Any: ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]: ...

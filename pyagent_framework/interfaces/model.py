from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any


class ModelArchitecture(ABC):
    """A causal language model as a plain ``torch.nn.Module``.

    Built as ``cls(config, attention_backend=backend_cls)`` from the checkpoint's
    HF-style config mapping; each attention layer builds its own backend instance as
    ``backend_cls(num_heads, head_size, num_kv_heads, scale)``. Linear layers are
    ordinary ``torch.nn.Linear`` modules; after loading, the engine swaps each for
    ``quantizer.make_linear(weight, bias)`` (see :mod:`pyagent_framework.engine.loader`).

    - ``forward(input_ids, positions, context)``: the flattened new tokens of a batch
      (``[num_tokens]``), their positions, and a
      :class:`~pyagent_framework.types.ForwardContext`; returns hidden states
      ``[num_tokens, hidden_size]``.
    - ``compute_logits(hidden_states)``: vocabulary logits for the given rows.
    - ``load_weights(pairs)``: consumes ``(checkpoint_name, tensor)`` pairs with HF
      names and returns the set of names it loaded; an unexpected name or shape is a
      ``ValueError`` naming it.
    - Optional ``packed_weights()``: a model that accepts
      :class:`~pyagent_framework.interfaces.PackedWeight` values in ``load_weights``
      for its linear and embedding weights returns them after loading, by parameter
      name; the engine builds those layers from them with the quantizer (no
      dequantize on load).

    Real entries subclass ``torch.nn.Module``; this interface keeps the kernel free of
    torch.
    """

    @abstractmethod
    def forward(self, input_ids: Any, positions: Any, context: Any) -> Any: ...

    @abstractmethod
    def compute_logits(self, hidden_states: Any) -> Any: ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]: ...

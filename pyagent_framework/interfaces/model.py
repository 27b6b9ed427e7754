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
    - ``kv_cache_shape(num_blocks, block_size)``: the shape of the paged KV cache the
      engine allocates for it, ``(num_layers, 2, num_blocks, block_size,
      num_kv_heads, head_dim)``; layer ``i``'s ``[2, num_blocks, ...]`` slice is
      ``context.kv_caches[i]``. A model without attention layers returns 0 layers.
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

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]: ...


class EncoderArchitecture(ABC):
    """A bidirectional encoder (BERT and its kin) whose hidden states are pooled into
    one vector per sequence (embeddings), as a plain ``torch.nn.Module``.

    Registered in the same registry as :class:`ModelArchitecture`, by the
    checkpoint's HF ``architectures`` name; built as ``cls(config)``. No KV cache:
    every sequence is whole in one forward pass, and attends to all of itself.

    - ``forward(input_ids, positions, query_start_loc, token_type_ids=None)``: the
      flattened tokens of a batch (``[num_tokens]``), their positions within their
      sequence (from 0), ``[num_seqs + 1]`` prefix sums of the sequences' lengths, and
      each token's segment (0 when None); returns hidden states
      ``[num_tokens, hidden_size]``.
    - ``load_weights(pairs)``: as :meth:`ModelArchitecture.load_weights`.
    """

    @abstractmethod
    def forward(self, input_ids: Any, positions: Any, query_start_loc: Any, token_type_ids: Any = None) -> Any: ...

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]: ...


class CrossEncoderArchitecture(EncoderArchitecture):
    """An encoder with a sequence-classification head (a cross-encoder: BERT's or
    RoBERTa's ``...ForSequenceClassification``), which reads a pair of texts as one
    sequence and scores it. The engine serves it for ``/v1/score`` and ``/rerank``.

    - ``num_labels``: how many numbers :meth:`classify` gives per sequence.
    - ``classify(hidden, query_start_loc)``: the head over :meth:`forward`'s hidden
      states; returns float32 logits ``[num_seqs, num_labels]`` (no activation).
    """

    num_labels: int

    @abstractmethod
    def classify(self, hidden: Any, query_start_loc: Any) -> Any: ...

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pyagent_framework.types import AttentionMetadata


class AttentionBackend(ABC):
    """Attention over the engine's paged KV cache.

    Built as ``cls(num_heads, head_size, num_kv_heads, scale)`` once per layer; a layer
    with a sliding window adds ``sliding_window=W`` (then a query at position ``p``
    sees only keys at ``p - W < k <= p``), so a backend without that keyword serves
    only models without windows.
    ``forward`` first writes ``key``/``value`` (``[num_tokens, num_kv_heads,
    head_size]``) into ``kv_cache`` at ``metadata.slot_mapping``, then returns the
    causal attention output ``[num_tokens, num_heads, head_size]`` of ``query`` over
    each sequence's cached context plus its new tokens.

    Optional: a classmethod ``fuse_decoder(layers, shape)`` returning a callable that
    runs a whole decode step of a Llama-family stack at once, or None. ``layers`` lists
    per layer its norm weights (``input_norm``, ``post_norm``, ``q_norm``, ``k_norm``),
    its linear modules (``qkv``, ``o``, ``gate_up``, ``down``) and ``sliding_window``;
    ``shape`` has ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``intermediate_size``, ``eps`` and ``scale``. The callable, given ``(x, cos, sin,
    kv_caches, metadata)``, advances the residual stream ``x`` in place through every
    layer and returns True, or returns False for a batch it does not take (the model
    then runs its own layers).
    """

    @abstractmethod
    def forward(
        self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata
    ) -> Any: ...

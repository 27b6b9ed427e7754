from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pyagent_framework.types import AttentionMetadata


class AttentionBackend(ABC):
    """Attention over the engine's paged KV cache.

    Built as ``cls(num_heads, head_size, num_kv_heads, scale)`` once per layer; a layer
    with a sliding window adds ``sliding_window=W`` (then a query at position ``p``
    sees only keys at ``p - W < k <= p``), and a layer with attention logit
    soft-capping (Gemma 2) adds ``logit_softcap=C`` (then the scaled scores become
    ``C * tanh(scores / C)`` before the mask and softmax). Each keyword is passed only
    when set, so a backend without it serves only models that do not use it.
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

    Optional: a classmethod ``fuse_experts(experts, hidden, intermediate)`` returning a
    callable that computes a mixture-of-experts layer's experts (modules with a fused
    ``gate_up_proj`` and a ``down_proj``) grouped by expert in one call, or None when it
    cannot read their weights. The callable, given ``(x [T, hidden], expert_ids [T, k],
    routing_weights [T, k])``, returns each token's routing-weighted sum of its experts'
    outputs.

    Optional: a class attribute ``kv_cache_dtypes``, the quantized KV cache dtypes the
    backend reads and writes (``"int8"``, ``"fp8"``: ``kv_cache`` is then ``[2,
    num_blocks, block_size, num_kv_heads, head_size + 4]`` of ``torch.int8`` or
    ``torch.float8_e4m3fn``, each row its codes and a float32 scale, as
    :mod:`pyagent_framework.kv_cache_format` defines). Without it the engine serves the
    backend only a float cache of the model's dtype.

    Optional: a class attribute ``cuda_graphs = True``: the backend's pure-decode path
    asks the device nothing on the host when ``metadata.all_slots_written`` is set, and
    reads as many keys as each sequence's length on the device says (``max_seq_len``
    is then only an upper bound), so the engine may replay its decode steps from CUDA
    graphs (:mod:`pyagent_framework.engine.cuda_graphs`).

    Optional: a class attribute ``layer_ops``, a :class:`LayerOps` whose methods the
    models use for the norms, rotary embedding and gated MLP around attention, and the
    engine for grammar masks (fused kernels for the device the backend runs on).
    """

    @abstractmethod
    def forward(
        self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: AttentionMetadata
    ) -> Any: ...


class LayerOps:
    """The element-wise ops around attention that an attention backend may bring
    fused kernels for: the models call them for their norms, rotary embedding and
    gated MLP, and the engine for grammar masks and LoRA adapters.

    A backend names its ops in the class attribute ``layer_ops`` (see
    :func:`layer_ops`); this base class is the plain-torch definition every override
    must match, so a backend overrides only the methods it has kernels for (and may
    call these to fall back).
    """

    def rms_norm(self, x: Any, weight: Any, eps: float, residual: Any = None) -> Any:
        """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension, computed in
        float32 and cast to ``x.dtype`` before the weight is applied (as transformers
        does). With ``residual``: the residual add between decoder layers fused in front
        of it: returns ``(rms_norm(x + residual), x + residual)``; an override may write
        the sum into ``residual`` in place, so the caller must use the returned one."""
        import torch
        import torch.nn.functional as F

        if residual is not None:
            summed = x + residual
            return self.rms_norm(summed, weight, eps), summed
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)  # the same math, one kernel
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def rotary_embedding(self, x: Any, cos: Any, sin: Any) -> Any:
        """Rotate ``x [tokens, heads, head_dim]`` by ``cos``/``sin`` ``[tokens,
        head_dim // 2]``, "rotate half" (NeoX/Llama) style: with ``x1, x2`` the two
        halves of the last dimension, ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``.
        Returns the result; an override may rotate ``x`` in place."""
        import torch

        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def silu_and_mul(self, x: Any) -> Any:
        """SwiGLU's gate: ``x [tokens, 2 * n]`` -> ``silu(x[:, :n]) * x[:, n:]``."""
        import torch.nn.functional as F

        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def add_lora(self, out: Any, x: Any, lora_a: Any, lora_b: Any, groups: Any, row_slots: Any) -> None:
        """In place, each row's LoRA adapter (a batch may mix several and the base
        model): ``out[r] += lora_b[s] @ (lora_a[s] @ x[r])`` for every row ``r`` whose
        slot ``s = row_slots[r]`` is not -1. ``x`` is ``[T, in]``, ``out`` ``[T, out]``,
        ``lora_a`` ``[slots, R, in]``, ``lora_b`` ``[slots, out, R]`` (the adapter's scale
        folded in), ``row_slots`` int ``[T]``; ``groups`` is the same as ``[(slot, row
        indices)]``, for implementations that batch by adapter (this one: one gather,
        two GEMMs and one scatter-add per adapter)."""
        for slot, rows in groups:
            whole = rows.numel() == x.shape[0]
            xs = x if whole else x.index_select(0, rows)
            delta = ((xs.to(lora_a.dtype) @ lora_a[slot].T) @ lora_b[slot].T).to(out.dtype)
            if whole:
                out += delta
            else:
                out.index_add_(0, rows, delta)

    def apply_token_bitmask(self, logits: Any, bitmask: Any, indices: Any = None) -> None:
        """In place: set to ``-inf`` every logit whose bit is clear. ``bitmask`` is
        packed ``int32`` ``[rows, ceil(vocab / 32)]`` (bit ``t % 32`` of word ``t // 32``
        allows token ``t``); row ``r`` masks ``logits[indices[r]]``, or ``logits[r]``
        when ``indices`` is None."""
        from pyagent_framework.interfaces.grammar import apply_token_bitmask

        if indices is None:
            apply_token_bitmask(logits, bitmask)
            return
        subset = logits[indices]
        apply_token_bitmask(subset, bitmask.to(subset.device))
        logits[indices] = subset


_DEFAULT_OPS = LayerOps()


def layer_ops(backend: Any) -> LayerOps:
    """The ops of an attention backend (class or instance): its ``layer_ops``, else
    the plain-torch :class:`LayerOps`."""
    return getattr(backend, "layer_ops", None) or _DEFAULT_OPS

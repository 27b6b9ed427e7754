"""Attention backend ``triton`` and the layer ops that come with it.

:class:`TritonAttention` is the built-in ``torch`` backend with its three costly parts
replaced by Triton kernels: writing the new keys/values into their cache slots, the
decode batch (split-K grouped-query attention straight from the paged cache) and
everything else in one varlen launch (prefills, chunked prefills over cached context
and the decodes mixed in with them). :class:`TritonLayerOps` brings the kernels for the
ops around attention (RMSNorm with the residual add, rotary embedding, SiLU-and-mul)
and for the grammar bitmask.

Each op uses its kernel where Triton can run (:func:`pyagent_triton.runtime.usable`:
on a GPU, or on the CPU in Triton's interpreter) and falls back, per op, to the
inherited torch code elsewhere, with one warning per process. A batch with tokens
whose keys are not written (slot ``-1``: the torch backend attends those from the new
keys directly, the kernels read the cache) also takes the torch path.

An int8 or fp8 cache (``--kv-cache-dtype``, :mod:`pyagent_framework.kv_cache_format`)
goes through the same kernels: the write quantizes each row as ``kv_cache_format``
does, bit for bit, and the attention kernels dequantize codes and scales as they load
them; every token, a fresh prompt's included, attends keys and values as the cache
holds them, as in the torch backend.
"""

from __future__ import annotations

import torch

from pyagent_framework.interfaces import LayerOps
from pyagent_framework.paged_attention import TorchAttention, attention_plan
from pyagent_framework.types import AttentionMetadata

from pyagent_triton import runtime


def _kernels():
    """The kernel modules, imported on first use (importing them decorates the kernels,
    which reads ``TRITON_INTERPRET``)."""
    from pyagent_triton import attention, ops

    return attention, ops


class TritonLayerOps(LayerOps):
    """:class:`~pyagent_framework.interfaces.LayerOps` with Triton kernels; each method
    computes with the plain-torch definition where the kernels cannot run."""

    def rms_norm(self, x, weight, eps, residual=None):
        if not runtime.usable(x) or x.stride(-1) != 1:
            return super().rms_norm(x, weight, eps, residual)
        if x.dim() != 2 and residual is None:  # per-head norms (Qwen3's q/k): rows of the last dim
            return _kernels()[1].rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
        return _kernels()[1].rms_norm(x, weight, eps, residual)

    def rotary_embedding(self, x, cos, sin):
        if not runtime.usable(x) or x.stride(-1) != 1:
            return super().rotary_embedding(x, cos, sin)
        return _kernels()[1].rotary_embedding_(x, cos, sin)

    def silu_and_mul(self, x):
        if not runtime.usable(x) or x.stride(-1) != 1:
            return super().silu_and_mul(x)
        return _kernels()[1].silu_and_mul(x)

    def add_lora(self, out, x, lora_a, lora_b, groups, row_slots):
        # One adapter in the batch: its two GEMMs beat the kernels' two launches
        # (benchmarks/lora_kernels.py); several: the kernels, 4-7x the torch grouping.
        if row_slots is None or len(groups) < 2 or not runtime.usable(x) or x.stride(-1) != 1 or out.stride(-1) != 1:
            return super().add_lora(out, x, lora_a, lora_b, groups, row_slots)
        _kernels()[1].add_lora_(out, x, lora_a, lora_b, row_slots)

    def apply_token_bitmask(self, logits, bitmask, indices=None):
        if not runtime.usable(logits) or not logits.is_contiguous():
            return super().apply_token_bitmask(logits, bitmask, indices)
        _kernels()[1].apply_token_bitmask_(logits, bitmask.to(logits.device), indices)


class TritonAttention(TorchAttention):
    """Paged attention in Triton (see the module docstring). Built per layer as
    ``TritonAttention(num_heads, head_size, num_kv_heads, scale, sliding_window=None,
    logit_softcap=None)`` with the torch backend's semantics, which is its reference in
    the tests."""

    layer_ops = TritonLayerOps()
    #: Quantized caches the kernels read and write (and the inherited torch path, where
    #: they cannot run).
    kv_cache_dtypes = ("int8", "fp8")
    #: The decode kernel reads each sequence's length on the device and the plan needs no
    #: host sync with ``all_slots_written``: decode steps may replay from CUDA graphs.
    cuda_graphs = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = query.shape[0]
        if num_tokens == 0 or not kv_cache.numel() or not runtime.usable(kv_cache):
            return super().forward(query, key, value, kv_cache, metadata)
        plan = attention_plan(metadata, kv_cache.device)
        if plan.keep is not None:  # some keys are not written: the torch path attends them directly
            return super().forward(query, key, value, kv_cache, metadata)
        attention, ops = _kernels()
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        ops.reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        if plan.pure_decode:
            return attention.paged_attention_decode(
                query, kv_cache, metadata.seq_lens, metadata.block_tables, self.scale,
                sliding_window=self.sliding_window, logit_softcap=self.logit_softcap,
            )
        return attention.paged_attention_prefill(
            query, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_tables, self.scale,
            max_query_len=metadata.max_query_len, sliding_window=self.sliding_window,
            logit_softcap=self.logit_softcap,
        )

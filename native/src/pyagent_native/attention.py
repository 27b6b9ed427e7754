"""Attention backend ``native``: the built-in ``torch`` backend with its decode path
replaced by a C++ kernel that reads keys and values in place from the paged cache.

The torch backend's decode gathers every sequence's blocks into a contiguous
workspace on every layer before calling SDPA, so a decode step moves the live KV cache
three times (read, write, read again). The kernel reads each block once, where it
lies. Everything else (cache writes, prefill and chunked prefill, mixed batches) is
inherited from :class:`~pyagent_framework.paged_attention.TorchAttention`,
which is also this kernel's reference twin in the tests.

The kernel serves float32 caches on the CPU; any other device or dtype falls back to
the inherited torch path.
"""

from __future__ import annotations

import torch

from pyagent_framework.paged_attention import DecodeBatch, TorchAttention

from pyagent_native import _core


def _as_array(tensor: torch.Tensor):
    """A numpy view sharing the tensor's memory (CPU tensors only; never a copy)."""
    return tensor.detach().numpy()


class NativeAttention(TorchAttention):
    """Paged attention whose decode runs in the native core (see module docstring)."""

    #: Instruction set the kernel uses: "auto" (the best this CPU has), "avx2", "generic".
    isa = "auto"

    @classmethod
    def fuse_decoder(cls, layers: list[dict], shape: dict):
        """A callable running a pure-decode step of the whole decoder stack in the
        native core, or None when some layer cannot run there (see
        :mod:`pyagent_native.fused`)."""
        from pyagent_native.fused import FusedDecoder

        return FusedDecoder.build(layers, shape)

    @classmethod
    def fuse_experts(cls, experts: list, hidden: int, intermediate: int):
        """A callable computing a mixture-of-experts layer's experts grouped by expert
        in one native call, or None when some expert's weights cannot be read there
        (see :mod:`pyagent_native.moe`)."""
        from pyagent_native.moe import NativeExperts

        return NativeExperts.build(experts, hidden, intermediate)

    def decode_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, decode: DecodeBatch) -> torch.Tensor:
        if kv_cache.device.type != "cpu" or kv_cache.dtype != torch.float32 or query.dtype != torch.float32:
            return super().decode_attention(query, kv_cache, decode)
        query = query.contiguous()
        out = torch.empty_like(query)
        _core.paged_decode_attention(
            _as_array(out),
            _as_array(query),
            _as_array(kv_cache[0]),
            _as_array(kv_cache[1]),
            _as_array(decode.block_tables),
            _as_array(decode.seq_lens),
            self.scale,
            torch.get_num_threads(),
            self.isa,
            self.sliding_window or 0,
            self.logit_softcap or 0.0,
        )
        return out

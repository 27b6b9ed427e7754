"""Attention backend ``native``: the built-in ``torch`` backend with its decode path
replaced by a C++ kernel that reads keys and values in place from the paged cache.

The torch backend's decode gathers every sequence's blocks into a contiguous
workspace on every layer before calling SDPA, so a decode step moves the live KV cache
three times (read, write, read again). The kernel reads each block once, where it
lies. Everything else (cache writes, prefill and chunked prefill, mixed batches) is
inherited from :class:`~pyagent_framework.paged_attention.TorchAttention`,
which is also this kernel's reference twin in the tests.

The kernel serves float32 and bfloat16 caches on the CPU (a bfloat16 model's query is
widened to float32, the arithmetic is float32's and the output is rounded back to
bfloat16), and the quantized int8 and fp8 (e4m3fn) caches of
:mod:`pyagent_framework.kv_cache_format` (a float32 or bfloat16 query; each row's codes
read in place and widened with their groups' scales, so the result is the float32
kernel's on the dequantized cache while a row of 64 moves 68 bytes instead of 256);
any other device or dtype falls back to the inherited torch path.
"""

from __future__ import annotations

import torch

from pyagent_framework.paged_attention import DecodeBatch, TorchAttention

from pyagent_native import _core


# Below this many key rows (sequences x longest length x key/value heads) a decode
# called from the model's Python forward runs on the calling thread alone: there the
# kernel sits between torch ops, whose OpenMP workers keep spinning on the other cores
# for a while after each op, and a second thread of ours competes with them. Measured
# with 64 sequences, 3 key/value heads, interleaved with a torch linear: at 56 keys one
# thread takes 0.5 ms, two 0.7-1.2 ms; at 256 keys 1.8-2.0 ms against 2.5-2.7 ms; at
# 1,024 keys two threads win (5.7-9.0 ms against 7.6-10.9 ms). The fused decode step
# runs the kernel inside the native core, with no torch op around it, and is unaffected.
SHARED_THREADS_MIN_ROWS = 1 << 17

# The cache dtypes the kernel reads: the dtype it receives each as, and its kv_dtype.
_CACHE_BITS = {torch.float32: torch.float32, torch.bfloat16: torch.int16}
_CACHE_CODES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
# The query dtypes that may go with a quantized cache (widened to float32).
_CODES_QUERY = (torch.float32, torch.bfloat16)


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

    def _threads(self, decode: DecodeBatch) -> int:
        rows = len(decode.seq_lens) * decode.max_seq_len * self.num_kv_heads
        return torch.get_num_threads() if rows >= SHARED_THREADS_MIN_ROWS else 1

    def decode_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, decode: DecodeBatch) -> torch.Tensor:
        if kv_cache.device.type != "cpu" or query.device.type != "cpu":
            return super().decode_attention(query, kv_cache, decode)
        kv_dtype = _CACHE_CODES.get(kv_cache.dtype)
        if kv_dtype is not None:
            if query.dtype not in _CODES_QUERY:
                return super().decode_attention(query, kv_cache, decode)
            cache = kv_cache.view(torch.uint8)  # numpy has no float8: the bytes, codes and scales
        elif kv_cache.dtype in _CACHE_BITS and query.dtype == kv_cache.dtype:
            kv_dtype = "auto"
            cache = kv_cache.view(_CACHE_BITS[kv_cache.dtype])  # numpy has no bfloat16: its bits
        else:
            return super().decode_attention(query, kv_cache, decode)
        query32 = query.to(torch.float32).contiguous()
        out = torch.empty_like(query32)
        _core.paged_decode_attention(
            _as_array(out),
            _as_array(query32),
            _as_array(cache[0]),
            _as_array(cache[1]),
            _as_array(decode.block_tables),
            _as_array(decode.seq_lens),
            self.scale,
            self._threads(decode),
            self.isa,
            self.sliding_window or 0,
            self.logit_softcap or 0.0,
            kv_dtype,
        )
        return out.to(query.dtype)

"""Small fused Triton ops for the decoder's hot path.

- ``reshape_and_cache(key, value, kv_cache, slot_mapping)``: scatter each token's
  keys and values into the paged cache ``[2, num_blocks, block_size, kv_heads,
  head_dim]`` at flat slot ``block * block_size + offset``; a negative slot (-1)
  skips the token. Values are cast to the cache dtype; an int8 or fp8 (e4m3fn) cache
  of rows ``[..., row_width(head_dim)]`` (codes, then a float16 scale per group) gets
  each row quantized group by group, bit for bit as
  :func:`pyagent_framework.kv_cache_format.quantize`.
- ``rms_norm(x, weight, eps, residual=None)``: ``weight * (x / sqrt(mean(x**2) +
  eps))`` over the last dim, float32 math, in ``x.dtype`` (transformers' rounding:
  the normalised row is cast to ``x.dtype`` before the weight multiplies it). With
  ``residual`` it first adds: ``residual`` becomes ``x + residual`` in place and
  ``(rms_norm(x + residual), residual)`` is returned (vLLM's fused_add_rms_norm).
- ``rotary_embedding_(x, cos, sin)``: NeoX/Llama "rotate half" RoPE in place on
  ``[tokens, heads, head_dim]``: ``cat(x1*cos - x2*sin, x2*cos + x1*sin)`` for the
  halves ``x1, x2`` of each head, float32 math.
- ``silu_and_mul(x)``: ``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[tokens, 2*I]``,
  float32 math, a new ``[tokens, I]`` tensor in ``x.dtype``.
- ``apply_token_bitmask_(logits, bitmask, indices=None)``: in place, ``-inf`` for
  every token whose bit (bit ``t % 32`` of int32 word ``t // 32``) is clear; with
  ``indices``, bitmask row ``r`` applies to logits row ``indices[r]``.
- ``add_lora_(out, x, lora_a, lora_b, row_slots)``: in place, each row's LoRA
  adapter ``out[t] += lora_b[s] @ (lora_a[s] @ x[t])`` (``s = row_slots[t]``; -1:
  none), float32 math: a batch that mixes adapters and the base model in one launch
  pair.

Inputs may be strided views (row and head strides are free) but their last dim
must be contiguous. Slot and index values are not checked on the host (that would
synchronise): the kernels skip those out of range rather than write outside the
tensors, where the torch twins raise IndexError.

Each op has a plain torch twin, ``<name>_reference``, with the same signature
and semantics, written for obvious correctness: the tests compare against it,
and callers without Triton (or without a GPU) can use it as the fallback.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pyagent_framework import kv_cache_format

from pyagent_triton import kv_quant
from pyagent_triton.runtime import next_pow2

__all__ = [
    "add_lora_",
    "add_lora_reference",
    "apply_token_bitmask_",
    "apply_token_bitmask_reference",
    "reshape_and_cache",
    "reshape_and_cache_reference",
    "rms_norm",
    "rms_norm_reference",
    "rotary_embedding_",
    "rotary_embedding_reference",
    "silu_and_mul",
    "silu_and_mul_reference",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_TILE = 4096  # elements of one tensor a tiled program holds at once
_MAX_ROW = 65536  # widest row rms_norm reduces in one program


# --------------------------------------------------------------------------- launch


def _num_warps(tile: int) -> int:
    """About 256 elements a warp, 1 to 8 warps."""
    return max(1, min(8, tile // 256))


def _row_block(width: int) -> int:
    """The whole row in one tile."""
    return next_pow2(width)


def _col_block(width: int) -> int:
    """A column tile for element-wise rows: the row, at most ``_MAX_TILE`` wide."""
    return min(next_pow2(width), _MAX_TILE)


def _head_tile(heads: int, width: int) -> tuple[int, int]:
    """``(BLOCK_H, BLOCK_D)``: all of ``width`` and as many heads as fit ``_MAX_TILE``."""
    block_d = next_pow2(width)
    block_h = min(next_pow2(heads), max(1, _MAX_TILE // block_d))
    return block_h, block_d


# --------------------------------------------------------------------------- checks


def _check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} is not one of float32, float16, bfloat16")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (stride {t.stride(-1)})")


def _check_index(name: str, t: torch.Tensor, length: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} is not int32 or int64")
    if tuple(t.shape) != (length,):
        raise ValueError(f"{name}: expected shape ({length},), got {tuple(t.shape)}")


def _check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, expected {device}")


# --------------------------------------------------------------------------- reshape_and_cache


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h, slot_stride,
    num_slots, num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token * slot_stride).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):  # -1: a padding token; out of range: never written
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)

    # The cache is contiguous, so [block, offset] is the flat slot.
    cache_offs = slot * num_heads * head_dim + heads * head_dim + dims
    k = tl.load(key_ptr + token * key_stride_t + heads * key_stride_h + dims, mask=mask)
    v = tl.load(value_ptr + token * value_stride_t + heads * value_stride_h + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_quant_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    key_stride_t, key_stride_h, value_stride_t, value_stride_h, slot_stride,
    num_slots, num_heads, head_dim, num_groups,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SCALE_GROUP: tl.constexpr,
    QMAX: tl.constexpr, TINY: tl.constexpr, SCALE_MAX: tl.constexpr, QUANT: tl.constexpr,
):
    """The quantized cache's write: one (token, head) row per tile row, held as
    ``[BLOCK_H, groups, SCALE_GROUP]`` and quantized a group at a time in float32 (see
    :mod:`pyagent_triton.kv_quant`); the caches are byte views."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token * slot_stride).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    groups = tl.arange(0, BLOCK_D // SCALE_GROUP)
    cols = (groups[:, None] * SCALE_GROUP + tl.arange(0, SCALE_GROUP)[None, :])[None, :, :]  # [1, groups, GS]
    head_mask = heads < num_heads
    mask = head_mask[:, None, None] & (cols < head_dim)
    scale_mask = head_mask[:, None] & (groups < num_groups)[None, :]

    row = head_dim + 2 * num_groups  # bytes: the codes, then the float16 scales
    rows = slot * num_heads * row + heads * row  # [BLOCK_H] byte offsets of the rows
    codes_at = rows[:, None, None] + cols
    scales_at = (rows + head_dim)[:, None] + 2 * groups[None, :]
    k = tl.load(key_ptr + token * key_stride_t + heads[:, None, None] * key_stride_h + cols, mask=mask, other=0.0)
    codes, scales = kv_quant.quantize_groups(k.to(tl.float32), QMAX, TINY, SCALE_MAX, QUANT)
    tl.store(k_cache_ptr + codes_at, codes, mask=mask)
    kv_quant.store_scales(k_cache_ptr + scales_at, scales, scale_mask)
    v = tl.load(value_ptr + token * value_stride_t + heads[:, None, None] * value_stride_h + cols, mask=mask, other=0.0)
    codes, scales = kv_quant.quantize_groups(v.to(tl.float32), QMAX, TINY, SCALE_MAX, QUANT)
    tl.store(v_cache_ptr + codes_at, codes, mask=mask)
    kv_quant.store_scales(v_cache_ptr + scales_at, scales, scale_mask)


def _check_reshape_and_cache(key, value, kv_cache, slot_mapping) -> None:
    _check_float("key", key, 3)
    _check_float("value", value, 3)
    if value.shape != key.shape:
        raise ValueError(f"value: shape {tuple(value.shape)} differs from key's {tuple(key.shape)}")
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        shape = tuple(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__
        raise ValueError(f"kv_cache: expected [2, num_blocks, block_size, num_kv_heads, head_dim], got {shape}")
    quantized = kv_cache_format.is_quantized(kv_cache.dtype)
    if not quantized and not kv_cache.is_floating_point():
        raise ValueError(f"kv_cache: dtype {kv_cache.dtype} is not a floating-point type, int8 or float8_e4m3fn")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache: must be contiguous")
    row = (key.shape[1], kv_cache_format.row_width(key.shape[2], kv_cache.dtype))
    if tuple(kv_cache.shape[3:]) != row:
        what = "head_dim codes + float16 scales" if quantized else "head_dim"
        raise ValueError(
            f"kv_cache: [num_kv_heads, {what}] {tuple(kv_cache.shape[3:])} should be {row} for key's "
            f"{tuple(key.shape[1:])}"
        )
    _check_index("slot_mapping", slot_mapping, key.shape[0])
    _check_device(key.device, value=value, kv_cache=kv_cache, slot_mapping=slot_mapping)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[T, kv_heads, head_dim]`` into ``kv_cache[0]``/``[1]``
    at ``slot_mapping`` (flat slots; negative skips the token), in place."""
    _check_reshape_and_cache(key, value, kv_cache, slot_mapping)
    tokens, heads, head_dim = key.shape
    if tokens == 0 or heads == 0 or head_dim == 0:
        return
    block_h, block_d = _head_tile(heads, head_dim)
    grid = (tokens, triton.cdiv(heads, block_h))
    if kv_cache_format.is_quantized(kv_cache.dtype):
        cache = kv_cache.view(torch.uint8)
        num_groups, scale_group = kv_quant.scale_tile(head_dim, block_d)
        _reshape_and_cache_quant_kernel[grid](
            key, value, cache[0], cache[1], slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), slot_mapping.stride(0),
            kv_cache.shape[1] * kv_cache.shape[2], heads, head_dim, num_groups,
            BLOCK_H=block_h, BLOCK_D=block_d, SCALE_GROUP=scale_group, QMAX=kv_cache_format.QMAX[kv_cache.dtype],
            TINY=kv_cache_format.TINY, SCALE_MAX=kv_cache_format.SCALE_MAX, QUANT=kv_quant.quant_kind(kv_cache.dtype),
            num_warps=_num_warps(block_h * block_d),
        )  # fmt: skip
        return
    _reshape_and_cache_kernel[grid](
        key, value, kv_cache[0], kv_cache[1], slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), slot_mapping.stride(0),
        kv_cache.shape[1] * kv_cache.shape[2], heads, head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_num_warps(block_h * block_d),
    )


def reshape_and_cache_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    _check_reshape_and_cache(key, value, kv_cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    heads, head_dim = key.shape[1:]
    if kv_cache_format.is_quantized(kv_cache.dtype):
        # Rows by kv_cache_format.quantize, moved as bytes (CPU torch cannot index float8).
        flat = kv_cache.view(torch.uint8).view(2, -1, heads, kv_cache_format.row_width(head_dim, kv_cache.dtype))
        flat[0, slots] = kv_cache_format.quantize(key[keep], kv_cache.dtype).view(torch.uint8)
        flat[1, slots] = kv_cache_format.quantize(value[keep], kv_cache.dtype).view(torch.uint8)
        return
    flat = kv_cache.view(2, -1, heads, head_dim)  # [2, num_blocks * block_size, heads, head_dim]
    flat[0, slots] = key[keep].to(kv_cache.dtype)
    flat[1, slots] = value[keep].to(kv_cache.dtype)


# --------------------------------------------------------------------------- rms_norm


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    x_stride, residual_stride, out_stride,
    width, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * residual_stride + cols
        # Rounded to the dtype first, as `x + residual` in torch is.
        x = (x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
        tl.store(r_ptrs, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    w = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)
    y = (x * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * out_stride + cols, y.to(dtype), mask=mask)


def _check_rms_norm(x, weight, eps, residual) -> None:
    _check_float("x", x, 2)
    _check_float("weight", weight, 1)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight: shape {tuple(weight.shape)}, expected ({x.shape[1]},) to match x")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps: expected a non-negative float, got {eps!r}")
    if x.shape[1] > _MAX_ROW:
        raise ValueError(f"x: rows of {x.shape[1]} elements are wider than the {_MAX_ROW} supported")
    if residual is not None:
        _check_float("residual", residual, 2)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual: {tuple(residual.shape)} {residual.dtype}, expected x's {tuple(x.shape)} {x.dtype}"
            )
        _check_device(x.device, residual=residual)
    _check_device(x.device, weight=weight)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` ``[T, H]`` (a new tensor); with ``residual``, of ``x + residual``,
    which is written into ``residual`` and returned after the normed rows."""
    _check_rms_norm(x, weight, eps, residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, width = x.shape
    if rows and width:
        block = _row_block(width)
        has_residual = residual is not None
        _rms_norm_kernel[(rows,)](
            x, residual if has_residual else x, weight, out,
            x.stride(0), residual.stride(0) if has_residual else 0, out.stride(0),
            width, float(eps),
            HAS_RESIDUAL=has_residual, BLOCK=block, num_warps=_num_warps(block),
        )
    return out if residual is None else (out, residual)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    _check_rms_norm(x, weight, eps, residual)
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight * normed).to(x.dtype)
    return out if residual is None else (out, residual)


# --------------------------------------------------------------------------- rotary_embedding_


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr,
    x_stride_t, x_stride_h, cos_stride, sin_stride,
    num_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    dim_mask = dims < half
    mask = (heads < num_heads) & dim_mask

    cos = tl.load(cos_ptr + token * cos_stride + dims, mask=dim_mask).to(tl.float32)
    sin = tl.load(sin_ptr + token * sin_stride + dims, mask=dim_mask).to(tl.float32)
    p1 = x_ptr + token * x_stride_t + heads * x_stride_h + dims
    p2 = p1 + half
    x1 = tl.load(p1, mask=mask).to(tl.float32)
    x2 = tl.load(p2, mask=mask).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    tl.store(p1, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def _check_rotary(x, cos, sin) -> None:
    _check_float("x", x, 3)
    if x.shape[2] % 2:
        raise ValueError(f"x: head_dim {x.shape[2]} is odd")
    expected = (x.shape[0], x.shape[2] // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        _check_float(name, t, 2)
        if tuple(t.shape) != expected:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {expected} ([tokens, head_dim // 2])")
    _check_device(x.device, cos=cos, sin=sin)


def rotary_embedding_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` in place ("rotate half"); returns ``x``."""
    _check_rotary(x, cos, sin)
    tokens, heads, head_dim = x.shape
    if tokens == 0 or heads == 0 or head_dim == 0:
        return x
    block_h, block_d = _head_tile(heads, head_dim // 2)
    grid = (tokens, triton.cdiv(heads, block_h))
    _rotary_kernel[grid](
        x, cos, sin,
        x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        heads, head_dim // 2,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_num_warps(block_h * block_d),
    )
    return x


def rotary_embedding_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _check_rotary(x, cos, sin)
    x1, x2 = x.float().chunk(2, -1)
    cos, sin = cos.float()[:, None], sin.float()[:, None]
    x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1))
    return x


# --------------------------------------------------------------------------- silu_and_mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_silu_and_mul(x) -> None:
    _check_float("x", x, 2)
    if x.shape[1] % 2:
        raise ValueError(f"x: last dim {x.shape[1]} is odd, expected 2 * intermediate_size")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[T, 2*I]``, a new ``[T, I]`` tensor."""
    _check_silu_and_mul(x)
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows and width:
        block = _col_block(width)
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](
            x, out, x.stride(0), out.stride(0), width, BLOCK=block, num_warps=_num_warps(block)
        )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    _check_silu_and_mul(x)
    gate, up = x.float().chunk(2, -1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


# --------------------------------------------------------------------------- apply_token_bitmask_


@triton.jit
def _bitmask_kernel(
    logits_ptr, bitmask_ptr, indices_ptr,
    logits_stride, bitmask_stride, num_rows, vocab,
    HAS_INDICES: tl.constexpr, BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    row = r
    if HAS_INDICES:
        row = tl.load(indices_ptr + r).to(tl.int64)
        if (row < 0) | (row >= num_rows):  # out of range: never written
            return
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    bits = tl.arange(0, 32)
    tokens = words[:, None] * 32 + bits[None, :]  # [BLOCK_W, 32]
    packed = tl.load(bitmask_ptr + r * bitmask_stride + words, mask=words * 32 < vocab, other=-1)
    allowed = (packed[:, None] >> bits[None, :]) & 1
    # A whole-tile read and write: a store masked by the bits leaves partial sectors,
    # slower on a GPU unless nearly every token is allowed.
    ptrs = logits_ptr + row * logits_stride + tokens
    in_vocab = tokens < vocab
    logits = tl.load(ptrs, mask=in_vocab)
    tl.store(ptrs, tl.where(allowed == 0, float("-inf"), logits), mask=in_vocab)


def _check_bitmask(logits, bitmask, indices) -> None:
    _check_float("logits", logits, 2)
    if not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        what = f"{bitmask.dtype} {tuple(bitmask.shape)}" if isinstance(bitmask, torch.Tensor) else type(bitmask).__name__
        raise ValueError(f"bitmask: expected int32 [rows, ceil(vocab / 32)], got {what}")
    words = (logits.shape[1] + 31) // 32
    if bitmask.shape[1] < words:
        raise ValueError(f"bitmask: {bitmask.shape[1]} words a row, vocab {logits.shape[1]} needs {words}")
    if bitmask.numel() and bitmask.stride(-1) != 1:
        raise ValueError("bitmask: the last dim must be contiguous")
    if indices is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"bitmask: {bitmask.shape[0]} rows, logits has {logits.shape[0]} (and no indices)")
    else:
        _check_index("indices", indices, bitmask.shape[0])
        _check_device(logits.device, indices=indices)
    _check_device(logits.device, bitmask=bitmask)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None) -> None:
    """In place: ``-inf`` for every logit of ``logits`` ``[B, V]`` whose bit is clear in
    ``bitmask`` ``[R, ceil(V / 32)]`` (row ``r`` masks logits row ``indices[r]``, or row
    ``r`` without ``indices``)."""
    _check_bitmask(logits, bitmask, indices)
    rows, vocab = bitmask.shape[0], logits.shape[1]
    if rows == 0 or vocab == 0:
        return
    block_w = _col_block(triton.cdiv(vocab, 32) * 32) // 32
    has_indices = indices is not None
    _bitmask_kernel[(rows, triton.cdiv(vocab, block_w * 32))](
        logits, bitmask, indices if has_indices else bitmask,
        logits.stride(0), bitmask.stride(0), logits.shape[0], vocab,
        HAS_INDICES=has_indices, BLOCK_W=block_w, num_warps=_num_warps(block_w * 32),
    )


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    _check_bitmask(logits, bitmask, indices)
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    rows = torch.arange(logits.shape[0], device=logits.device) if indices is None else indices.long()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


# --------------------------------------------------------------------------- add_lora_


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slots_ptr, tmp_ptr, x_stride, a_slot_stride, a_row_stride, tmp_stride, in_features, rank,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # tmp[row] += lora_a[slot, :, cols] @ x[row, cols] (float32), one program per (row,
    # column block of x): split over the input features, summed with atomics.
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    live_rank = tl.where(slot >= 0, rank, 0)  # a row without an adapter reads and writes nothing
    slot = tl.maximum(slot, 0)
    r = tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    xk = tl.load(x_ptr + row * x_stride + k, mask=k < in_features, other=0.0).to(tl.float32)
    a = tl.load(
        a_ptr + slot * a_slot_stride + r[:, None] * a_row_stride + k[None, :],
        mask=(r[:, None] < live_rank) & (k[None, :] < in_features), other=0.0,
    ).to(tl.float32)
    tl.atomic_add(tmp_ptr + row * tmp_stride + r, tl.sum(a * xk[None, :], axis=1), mask=r < live_rank)


@triton.jit
def _lora_expand_kernel(
    tmp_ptr, b_ptr, slots_ptr, out_ptr, tmp_stride, b_slot_stride, b_row_stride, out_stride, out_features, rank,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # out[row, cols] += lora_b[slot, cols] @ tmp[row], one program per (row, column tile).
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    live_cols = tl.where(slot >= 0, out_features, 0)  # a row without an adapter is left as it is
    live_rank = tl.where(slot >= 0, rank, 0)
    slot = tl.maximum(slot, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, BLOCK_R)
    v = tl.load(tmp_ptr + row * tmp_stride + r, mask=r < live_rank, other=0.0)
    b = tl.load(
        b_ptr + slot * b_slot_stride + n[:, None] * b_row_stride + r[None, :],
        mask=(n[:, None] < live_cols) & (r[None, :] < rank), other=0.0,
    ).to(tl.float32)
    delta = tl.sum(b * v[None, :], axis=1)
    cols = n < live_cols
    current = tl.load(out_ptr + row * out_stride + n, mask=cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + n, (current + delta).to(out_ptr.dtype.element_ty), mask=cols)


def _check_add_lora(out, x, lora_a, lora_b, row_slots) -> None:
    _check_float("out", out, 2)
    _check_float("x", x, 2)
    _check_float("lora_a", lora_a, 3)
    _check_float("lora_b", lora_b, 3)
    _check_index("row_slots", row_slots, x.shape[0])
    tokens, in_features = x.shape
    slots, rank, a_in = lora_a.shape
    if a_in != in_features:
        raise ValueError(f"lora_a: {a_in} input features, x has {in_features}")
    if tuple(lora_b.shape) != (slots, out.shape[1], rank):
        raise ValueError(f"lora_b: expected shape {(slots, out.shape[1], rank)}, got {tuple(lora_b.shape)}")
    if out.shape[0] != tokens:
        raise ValueError(f"out: {out.shape[0]} rows, x has {tokens}")
    _check_device(x.device, out=out, lora_a=lora_a, lora_b=lora_b, row_slots=row_slots)


def add_lora_(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, row_slots: torch.Tensor) -> None:
    """In place: ``out[t] += lora_b[s] @ (lora_a[s] @ x[t])`` with ``s = row_slots[t]``,
    for every row whose slot is not -1 (float32 math; the grouped-GEMV form, for
    decode batches that mix adapters: a shrink launch split over rows and input
    features, then an expand launch split over rows and output features).
    ``x [T, in]``, ``out [T, out]``, ``lora_a [slots, R, in]``, ``lora_b [slots, out, R]``."""
    _check_add_lora(out, x, lora_a, lora_b, row_slots)
    tokens, in_features = x.shape
    rank, out_features = lora_a.shape[1], out.shape[1]
    if tokens == 0 or rank == 0 or out_features == 0:
        return
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    tmp = torch.zeros((tokens, rank), dtype=torch.float32, device=x.device)
    block_r = next_pow2(rank)
    block_k = max(16, min(next_pow2(in_features), _MAX_TILE // block_r, 256))
    _lora_shrink_kernel[(tokens, triton.cdiv(in_features, block_k))](
        x, lora_a, row_slots, tmp, x.stride(0), lora_a.stride(0), lora_a.stride(1), tmp.stride(0), in_features, rank,
        BLOCK_K=block_k, BLOCK_R=block_r, num_warps=_num_warps(block_k * block_r),
    )
    block_n = max(16, min(next_pow2(out_features), _MAX_TILE // block_r))
    _lora_expand_kernel[(tokens, triton.cdiv(out_features, block_n))](
        tmp, lora_b, row_slots, out, tmp.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0), out_features, rank,
        BLOCK_N=block_n, BLOCK_R=block_r, num_warps=_num_warps(block_n * block_r),
    )


def add_lora_reference(
    out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, row_slots: torch.Tensor
) -> None:
    _check_add_lora(out, x, lora_a, lora_b, row_slots)
    for t, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            delta = lora_b[slot].float() @ (lora_a[slot].float() @ x[t].float())
            out[t] = (out[t].float() + delta).to(out.dtype)

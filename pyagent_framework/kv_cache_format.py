"""The quantized KV cache's layout: int8 and fp8 (e4m3) codes with a scale per group.

``--kv-cache-dtype int8`` or ``fp8`` stores each key and each value row (one token, one
key/value head: ``head_dim`` numbers) as ``head_dim`` one-byte codes followed by one
scale per group of ``G = group_size(head_dim)`` consecutive numbers (32 when
``head_dim`` is a multiple of 32, else 16 when it is one of 16, else the whole row),
each a little-endian float16 (2 bytes). A layer's cache is then

    ``kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim + 2 * head_dim / G]``

of dtype ``torch.int8`` (int8) or ``torch.float8_e4m3fn`` (fp8): the dtype says which
code it is, so the cache describes itself and every part that only moves blocks (the
prefix cache, KV connectors, block copies) handles it as it handles a float cache. The
scales' bytes are stored as elements of that dtype; read them with :func:`scales`.

A group ``x`` of ``G`` numbers (float32 arithmetic throughout) is stored as

    ``amax = max |x|``; ``s = float16(min(amax / QMAX, 65504))`` (round to nearest even;
    0 when ``amax <= TINY``); ``inv = 1 / s`` (0 when ``s`` is 0);
    ``code = encode(x * inv)``

where ``QMAX`` is 127 for int8 (``encode``: round half to even, then clamp to
[-127, 127]) and 448 for fp8 (``encode``: clamp to [-448, 448], then round to the
nearest e4m3fn value, ties to even). It reads back as ``decode(code) * s``. Codes are
computed from the stored (rounded) scale, so a group reads back as closely as its codes
allow. The layout is llama.cpp's ``q8_0`` at a head size of 64 (two groups of 32 with a
float16 scale each: 68 bytes per row, against 256 in float32 and 128 in bfloat16). A
scale per group rather than per row keeps a key's outlier channels (which many models'
keys have) from coarsening the rest of the row: on SmolLM2 it halves the logprob drift.

:func:`quantize` and :func:`dequantize` are this definition in torch: the reference
every backend's kernels (native, Triton) are tested against, and what the built-in
``torch`` backend computes with.
"""

from __future__ import annotations

import torch

#: ``--kv-cache-dtype`` names and the cache dtype each stores codes in ("auto": the model's dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
#: The largest code magnitude of each quantized cache dtype.
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
#: Groups whose largest magnitude is at most this are stored as zeros (scale 0).
TINY = 1e-30
#: Bytes of one group's scale (float16), and the largest scale.
SCALE_BYTES = 2
SCALE_MAX = 65504.0


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` holds codes and scales (rather than floats)."""
    return dtype in QMAX


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype that ``--kv-cache-dtype name`` stores (``auto``: ``model_dtype``);
    ValueError naming the choices for any other name."""
    if name == "auto":
        return model_dtype
    try:
        return KV_CACHE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose auto, {', '.join(KV_CACHE_DTYPES)}") from None


def group_size(head_dim: int) -> int:
    """Numbers per scale: 32, else 16, else the whole row (see the module docstring)."""
    return 32 if head_dim % 32 == 0 else 16 if head_dim % 16 == 0 else head_dim


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one cached row: ``head_dim``, plus the scales for a quantized cache."""
    if not is_quantized(dtype):
        return head_dim
    return head_dim + SCALE_BYTES * (head_dim // group_size(head_dim))


def bytes_per_row(head_dim: int, dtype: torch.dtype) -> int:
    return row_width(head_dim, dtype) * torch.empty((), dtype=dtype).element_size()


def scales(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The float32 scales ``[..., head_dim / G]`` of quantized rows ``[..., width]``."""
    raw = rows.view(torch.uint8)[..., head_dim:].clone()  # a copy: the slice may start at an odd byte
    return raw.view(torch.float16).to(torch.float32)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``x [..., D]`` (any float dtype) as cached rows ``[..., row_width(D)]`` of
    ``dtype`` (``torch.int8`` or ``torch.float8_e4m3fn``), by the definition above."""
    qmax = QMAX[dtype]
    head_dim = x.shape[-1]
    group = group_size(head_dim)
    x32 = x.to(torch.float32).reshape(*x.shape[:-1], head_dim // group, group)
    amax = x32.abs().amax(dim=-1, keepdim=True)
    scale = (amax / qmax).clamp_(max=SCALE_MAX).to(torch.float16)
    scale = torch.where(amax > TINY, scale, torch.zeros_like(scale))
    wide = scale.to(torch.float32)
    inv = torch.where(wide > 0, 1.0 / wide.clamp(min=2.0**-24), torch.zeros_like(wide))
    y = x32 * inv
    if dtype == torch.int8:
        codes = torch.round(y).clamp_(-qmax, qmax).to(torch.int8)
    else:
        codes = y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn)
    out = torch.empty((*x.shape[:-1], row_width(head_dim, dtype)), dtype=torch.uint8, device=x.device)
    out[..., :head_dim] = codes.view(torch.uint8).reshape(*x.shape[:-1], head_dim)
    out[..., head_dim:] = scale.reshape(*x.shape[:-1], head_dim // group).view(torch.uint8)
    return out.view(dtype)


def dequantize(rows: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Cached rows ``[..., row_width(head_dim)]`` (int8 or fp8) back as ``[..., head_dim]``
    floats of ``dtype``: ``decode(code) * s`` in float32, then rounded to ``dtype``."""
    if rows.shape[-1] != row_width(head_dim, rows.dtype):
        raise ValueError(f"quantized rows of width {rows.shape[-1]} are not rows of head_dim {head_dim} "
                         f"(width {row_width(head_dim, rows.dtype)})")
    group = group_size(head_dim)
    codes = rows[..., :head_dim].to(torch.float32)
    values = codes.reshape(*codes.shape[:-1], head_dim // group, group) * scales(rows, head_dim).unsqueeze(-1)
    values = values.reshape(codes.shape)
    return values if dtype == torch.float32 else values.to(dtype)

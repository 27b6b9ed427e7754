"""Device functions for the quantized KV cache (int8 and fp8 e4m3fn codes, float16 scales per group).

The layout and the rounding are defined by :mod:`pyagent_framework.kv_cache_format`:
a cached row is ``head_dim`` one-byte codes followed by one float16 scale (2
little-endian bytes) per group of ``G = group_size(head_dim)`` consecutive numbers
(32, else 16, else the whole row), and number ``d`` reads back as ``decode(code) *
scale[d // G]``. The kernels see such a cache as bytes (a ``torch.uint8`` view), so one
pointer type serves codes and scales, and the scales need no 2-byte alignment (a row
of ``head_dim`` 13 is 15 bytes).

Everything here is integer and exactly rounded float32 arithmetic, so it gives the same
bits compiled on any GPU and in Triton's interpreter:

- a scale is rounded to float16 and read back from its bits, by integer arithmetic
  (round to nearest even, subnormal float16 scales included), not with casts;
- fp8 is encoded and decoded from its bits, not with Triton's ``float8e4nv`` casts:
  those need a GPU with native fp8 conversions (sm89+), and the interpreter rounds
  some values wrongly when it casts to fp8 (a mantissa that rounds up does not carry
  into the exponent) and decodes the NaN code (0x7F) as 480;
- the two divisions (``amax / QMAX`` and ``1 / scale``) are ``div_rn`` (a plain ``/``
  on float32 compiles to an approximate division on NVIDIA GPUs);
- int8 rounds half to even with an exact floor-and-fraction test (no ``rint``).

``QUANT`` constexpr values: :data:`NONE` (a float cache), :data:`INT8`, :data:`FP8`.

Tiles hold a row's ``BLOCK_D`` columns (``head_dim`` padded to a power of two) as
``BLOCK_D // SCALE_GROUP`` groups of ``SCALE_GROUP`` columns (:func:`scale_tile`):
``SCALE_GROUP`` is ``G`` when a row has several groups (``G`` is then 16 or 32, so it
divides ``BLOCK_D``) and ``BLOCK_D`` when it has one (its ``G = head_dim`` need not be
a power of two), so column ``d`` of a tile is always in group ``d // SCALE_GROUP``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from pyagent_framework import kv_cache_format

NONE, INT8, FP8 = 0, 1, 2
_KINDS = {torch.int8: INT8, torch.float8_e4m3fn: FP8}
if set(_KINDS) != set(kv_cache_format.QMAX):  # a new cache dtype must not be read as floats
    raise ImportError(f"pyagent_triton.kv_quant has no code for the KV cache dtypes {set(kv_cache_format.QMAX) - set(_KINDS)}")
if kv_cache_format.SCALE_BYTES != 2 or kv_cache_format.SCALE_MAX != 65504.0:  # the code reads float16 scales
    raise ImportError("pyagent_triton.kv_quant reads float16 scales; kv_cache_format changed its scales")


def quant_kind(dtype: torch.dtype) -> int:
    """The ``QUANT`` constexpr of a cache of ``dtype`` (:data:`NONE` for a float cache)."""
    return _KINDS.get(dtype, NONE)


def scale_tile(head_dim: int, block_d: int) -> tuple[int, int]:
    """``(num_groups, SCALE_GROUP)`` for rows of ``head_dim`` in tiles of ``block_d``
    columns (a power of two, at least ``head_dim``): the row's scales, and the columns
    per group in the tile (see the module docstring)."""
    group = kv_cache_format.group_size(head_dim)
    num_groups = head_dim // group
    scale_group = group if num_groups > 1 else block_d
    assert block_d >= head_dim and block_d % scale_group == 0, (head_dim, block_d)
    return num_groups, scale_group


# --------------------------------------------------------------------------- float16 scales


@triton.jit
def f16_bits_to_f32(h):
    """float16 bits (int32 in [0, 0xFFFF]) as the float32 they encode, exactly."""
    mag = h & 0x7FFF
    # Normal: exponent and mantissa land in float32's fields, rebiased from 15 to 127
    # (+112); all-ones exponent (inf, NaN): float32's all-ones. Subnormal: m * 2^-24.
    normal = tl.where(mag >= 0x7C00, (mag << 13) | 0x7F800000, (mag << 13) + (112 << 23))
    value = tl.where(mag < 0x400, mag.to(tl.float32) * 5.9604644775390625e-08, normal.to(tl.float32, bitcast=True))
    return tl.where(h >= 0x8000, -value, value)


@triton.jit
def f32_to_f16_bits(v):
    """float32 ``v`` in [0, 65504] rounded to the nearest float16 (ties to even), as its
    bits (int32)."""
    bits = v.to(tl.int32, bitcast=True)
    # Normal (v >= 2^-14): rebias the exponent from 127 to 15 and drop 13 mantissa
    # bits, rounding to nearest even; a carry moves into the exponent. v <= 65504
    # (0x7BFF) cannot round up to infinity.
    normal = (bits - (112 << 23) + 0xFFF + ((bits >> 13) & 1)) >> 13
    # Subnormal: multiples of 2^-24 (the product is exact; v is capped so that the
    # branch not taken stays in int32); rounding up to 1024 * 2^-24 gives 0x400, the
    # smallest normal, so it needs no special case.
    subnormal = _round_half_even(tl.minimum(v, 6.103515625e-05) * 16777216.0)
    return tl.where(v >= 6.103515625e-05, normal, subnormal)


@triton.jit
def load_scales(ptr, stride, mask):
    """The float32 value of the little-endian float16 at byte pointers ``ptr`` (any
    shape), its two bytes ``stride`` apart; 0.0 where ``mask`` is false."""
    b0 = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    b1 = tl.load(ptr + stride, mask=mask, other=0).to(tl.int32)
    return f16_bits_to_f32(b0 | (b1 << 8))


@triton.jit
def column_scales(
    row_ptr, offset, stride, num_groups, mask,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SCALE_GROUP: tl.constexpr, TRANSPOSED: tl.constexpr,
):
    """Each column's scale (float32) for the ``BLOCK_N`` rows starting at byte pointers
    ``row_ptr`` (their first scale ``offset`` bytes in, bytes ``stride`` apart): ``[BLOCK_N,
    BLOCK_D]``, or ``[BLOCK_D, BLOCK_N]`` when ``TRANSPOSED`` (a key tile), column ``d``
    holding group ``d // SCALE_GROUP``'s scale; 0.0 for rows where ``mask`` is false and
    for padding groups. One group a row: the scales broadcast instead (``[BLOCK_N, 1]``
    or ``[1, BLOCK_N]``)."""
    if SCALE_GROUP == BLOCK_D:
        s = load_scales(row_ptr + offset, stride, mask)
        if TRANSPOSED:
            return s[None, :]
        else:
            return s[:, None]
    else:
        groups = tl.arange(0, BLOCK_D // SCALE_GROUP)
        live = groups < num_groups
        if TRANSPOSED:
            ptrs = row_ptr[None, :] + offset + (2 * stride * groups)[:, None]
            s = load_scales(ptrs, stride, mask[None, :] & live[:, None])  # [groups, BLOCK_N]
            s = tl.broadcast_to(s[:, None, :], (BLOCK_D // SCALE_GROUP, SCALE_GROUP, BLOCK_N))
            return tl.reshape(s, (BLOCK_D, BLOCK_N))
        else:
            ptrs = row_ptr[:, None] + offset + (2 * stride * groups)[None, :]
            s = load_scales(ptrs, stride, mask[:, None] & live[None, :])  # [BLOCK_N, groups]
            s = tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_D // SCALE_GROUP, SCALE_GROUP))
            return tl.reshape(s, (BLOCK_N, BLOCK_D))


# --------------------------------------------------------------------------- codes


@triton.jit
def decode_codes(codes, QUANT: tl.constexpr):
    """Code bytes (uint8) as the float32 numbers they encode (before the scale)."""
    b = codes.to(tl.int32)
    if QUANT == 1:  # int8: two's complement
        return tl.where(b >= 128, b - 256, b).to(tl.float32)
    else:  # fp8 e4m3fn: s eeee mmm, bias 7, no infinities, NaN at s1111111
        mag = b & 0x7F
        # Normal: the exponent and mantissa bits land in float32's fields, rebiased
        # from 7 to 127 (+120). Subnormal (exponent 0): mantissa * 2^-9.
        normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        subnormal = (mag & 7).to(tl.float32) * 0.001953125
        value = tl.where(mag < 8, subnormal, normal)
        value = tl.where(mag == 0x7F, float("nan"), value)
        return tl.where(b >= 128, -value, value)


@triton.jit
def _round_half_even(a):
    """``a >= 0`` (float32, below 2^31) rounded to the nearest int32, ties to even."""
    t = a.to(tl.int32)  # truncation is floor for a >= 0
    frac = a - t.to(tl.float32)  # exact
    up = (frac > 0.5) | ((frac == 0.5) & ((t & 1) == 1))
    return t + up.to(tl.int32)


@triton.jit
def encode_int8(y):
    """float32 ``y`` (already divided by the scale) as int8 code bytes (uint8): round
    half to even, clamp to [-127, 127]."""
    # Clamped to 256 first (beyond the clamp either way) so the rounding stays in int32:
    # a scale held at 65504 leaves y unbounded.
    q = tl.minimum(_round_half_even(tl.minimum(tl.abs(y), 256.0)), 127)
    q = tl.where(y < 0, -q, q)
    return (q & 0xFF).to(tl.uint8)


@triton.jit
def encode_fp8(y):
    """float32 ``y`` (already divided by the scale) as fp8 e4m3fn code bytes (uint8):
    clamp to [-448, 448], then round to nearest, ties to even (as torch's cast)."""
    c = tl.minimum(tl.maximum(y, -448.0), 448.0)
    bits = c.to(tl.int32, bitcast=True)
    sign = (bits < 0).to(tl.int32) << 7  # -0.0 keeps its sign, as in torch
    mag_bits = bits & 0x7FFFFFFF
    a = tl.abs(c)
    # Normal (a >= 2^-6): keep 3 of float32's 23 mantissa bits, rounding the 20
    # dropped ones to nearest even; a carry moves into the exponent. Then rebias the
    # exponent from 127 to 7 (-120 in units of 2^3 codes).
    lsb = (mag_bits >> 20) & 1
    normal = ((mag_bits + 0x7FFFF + lsb) >> 20) - (120 << 3)
    # Subnormal (a < 2^-6): multiples of 2^-9; 8 * 2^-9 = 2^-6 is code 0x08, the
    # smallest normal, so rounding up into it needs no special case.
    subnormal = _round_half_even(a * 512.0)
    code = tl.where(a >= 0.015625, normal, subnormal)
    return (code | sign).to(tl.uint8)


# --------------------------------------------------------------------------- write


@triton.jit
def quantize_groups(x, QMAX: tl.constexpr, TINY: tl.constexpr, SCALE_MAX: tl.constexpr, QUANT: tl.constexpr):
    """Groups ``x [R, NG, GS]`` (float32; padding 0) as ``(codes [R, NG, GS] uint8,
    scale bits [R, NG] int32)``: ``amax = max |x|``, ``s = float16(min(amax / QMAX,
    SCALE_MAX))`` (0 when ``amax <= TINY``), ``code = encode(x * (1 / s))`` (``x * 0``
    when ``s`` is 0)."""
    amax = tl.max(tl.abs(x), 2)
    qmax = tl.full(amax.shape, QMAX, tl.float32)
    h = f32_to_f16_bits(tl.minimum(tl.math.div_rn(amax, qmax), SCALE_MAX))
    h = tl.where(amax > TINY, h, 0)
    s = f16_bits_to_f32(h)
    inv = tl.where(h > 0, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), tl.where(h > 0, s, 1.0)), 0.0)
    y = x * inv[:, :, None]
    if QUANT == 1:
        codes = encode_int8(y)
    else:
        codes = encode_fp8(y)
    return codes, h


@triton.jit
def store_scales(ptr, h, mask):
    """Store float16 bits ``h`` (int32) as 2 little-endian bytes at byte pointers ``ptr``
    (contiguous bytes)."""
    tl.store(ptr, (h & 0xFF).to(tl.uint8), mask=mask)
    tl.store(ptr + 1, ((h >> 8) & 0xFF).to(tl.uint8), mask=mask)

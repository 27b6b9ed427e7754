"""Matrix products with packed (quantized) weights: the blocks are decoded in
registers, one tile at a time, and multiplied; the float weight never exists in memory.

- ``packed_linear(x, data, encoding, bias=None)``: ``x [M, K] @ W.T + bias`` as
  ``[M, N]`` in ``x``'s dtype (float32, float16 or bfloat16), for ``W`` packed as
  ``data`` ``uint8 [N, row_bytes]`` in ``encoding``. The layouts are
  :mod:`pyagent_quant.encodings`' (its module docstring tables them): ``I8``,
  ``I4_G32``/``I4_G64``/``I4_G128`` and the GGUF block types ``Q8_0``, ``Q4_0``,
  ``Q4_1``, ``Q5_0``, ``Q5_1``, ``IQ4_NL``, ``Q2_K``, ``Q3_K``, ``Q4_K``, ``Q5_K`` and
  ``Q6_K``. :func:`supports` says whether an encoding has a kernel; any other is
  refused with a ``ValueError`` naming those that do.
- ``dequantize(data, encoding, columns, dtype=torch.float32)``: the ``[N, columns]``
  values of a packed weight (the same decoders, written out).

Each encoding has one decoder (``_decode_<encoding>``) that turns a tile of weight
positions ``[BLOCK_N rows, BLOCK_K columns]`` into float32 values: every position finds
its block, loads its code and its block's scale fields (f16 fields through 16-bit
loads; each block's fields are at even offsets of rows of an even byte count) and
computes in the reference's float32 operation order (``d * q + m``, ``(d * scale) * q -
dmin * min``), so in Triton's interpreter the decoded values equal the torch twin's
bit for bit. Positions in a row are columns in order, so ``x`` loads contiguously and
``tl.dot`` takes the tile as it is; the bytes two columns share (a 4-bit code's
neighbour, a block's scale) are re-read from the L1 cache, not from memory.

Two kernels share the decoders:

- ``M <= GEMV_MAX_ROWS`` (decode): a GEMV, float32 products on the CUDA cores; grid
  ``(cdiv(N, BLOCK_N), splits)``: each program holds ``BLOCK_N`` weight rows and one of
  ``splits`` contiguous ranges of ``K`` and reads its packed bytes once for all ``M``
  rows of ``x``.
- larger ``M``: a tiled GEMM, grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), splits)``,
  ``tl.dot`` on the tensor cores (16-bit ``x``: the decoded tile is rounded to ``x``'s
  dtype and accumulated in float32; float32 ``x``: ``tf32x3`` products, about float32
  accuracy). Up to 16 rows it is the GEMV shape again (one row tile, split over ``N``
  and ``K``); above, the prefill shape.

With more than one split, each program writes float32 partial sums and a second
kernel adds them, the bias, and rounds to the output dtype; with one, the program
writes the output directly. :func:`_splits` picks the count from the number of
programs and of ``K`` tiles (the GPU's streaming multiprocessors want several
programs each to keep enough bytes in flight).

``packed_linear_reference`` is the twin: the torch decoders of
:mod:`pyagent_quant.encodings` (an optional import: pyagent-quant owns the layouts),
then ``F.linear`` in float32.

The 16-bit loads of the f16 fields need ``data``'s rows at even addresses; a view
that starts at an odd byte is copied first. In Triton's interpreter, ``tl.dot`` of
bfloat16 operands is computed wrongly, so there the GEMM multiplies the same (rounded)
values in float32; the interpreter also truncates float32 to bfloat16 where a GPU
rounds to nearest. The tile sizes and split counts are first choices, not yet tuned on
a GPU; ``benchmarks/quant_gemm_gpu.py`` times them against bfloat16 ``F.linear``.
"""

from __future__ import annotations

import functools
import math
import re

import torch
import triton
import triton.language as tl

from pyagent_triton import runtime
from pyagent_triton.runtime import next_pow2

__all__ = [
    "GEMV_MAX_ROWS",
    "dequantize",
    "encodings",
    "packed_linear",
    "packed_linear_reference",
    "row_bytes",
    "supports",
    "usable",
]

#: Rows of ``x`` up to which :func:`packed_linear` runs the GEMV kernel.
GEMV_MAX_ROWS = 4

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Kernel codes of the encodings (constexpr), and each GGUF block's (values, bytes).
_I8, _I4, _Q8_0, _Q4_0, _Q5_0, _Q5_1, _IQ4_NL, _Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K = range(12)
_GGUF = {
    "Q8_0": (_Q8_0, 32, 34),
    "Q4_0": (_Q4_0, 32, 18),
    "Q4_1": (_I4, 32, 20),  # Q4_1 is I4_G32: f16 d, f16 m, 16 bytes of nibbles
    "Q5_0": (_Q5_0, 32, 22),
    "Q5_1": (_Q5_1, 32, 24),
    "IQ4_NL": (_IQ4_NL, 32, 18),
    "Q2_K": (_Q2_K, 256, 84),
    "Q3_K": (_Q3_K, 256, 110),
    "Q4_K": (_Q4_K, 256, 144),
    "Q5_K": (_Q5_K, 256, 176),
    "Q6_K": (_Q6_K, 256, 210),
}
_INT4_GROUPS = (32, 64, 128)
_I4_NAME = re.compile(r"I4_G(\d+)")
#: The 16 values an IQ4_NL code stands for (as pyagent_quant.gguf_blocks.IQ4_NL_VALUES).
_IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def encodings() -> tuple[str, ...]:
    """The encodings :func:`packed_linear` has kernels for."""
    return ("I8", *(f"I4_G{g}" for g in _INT4_GROUPS), *_GGUF)


def supports(encoding: str) -> bool:
    """Whether :func:`packed_linear` has a kernel for ``encoding``."""
    try:
        _kernel_code(encoding)
    except ValueError:
        return False
    return True


def _kernel_code(encoding: str) -> tuple[int, int]:
    """``(ENC, GROUP)`` of a supported encoding, else ``ValueError``."""
    if not isinstance(encoding, str):
        raise ValueError(f"encoding: expected a name such as 'Q4_K', got {type(encoding).__name__}")
    return _code_of(encoding)


@functools.cache
def _code_of(encoding: str) -> tuple[int, int]:
    if encoding == "I8":
        return _I8, 0
    m = _I4_NAME.fullmatch(encoding)
    if m and int(m.group(1)) in _INT4_GROUPS:
        return _I4, int(m.group(1))
    if encoding in _GGUF:
        code = _GGUF[encoding][0]
        return code, 32 if code == _I4 else 0
    raise ValueError(f"packed_linear has no kernel for encoding {encoding!r}; it has {', '.join(encodings())}")


def row_bytes(encoding: str, columns: int) -> int:
    """Bytes of one packed row of ``columns`` values (``ValueError`` if it cannot be)."""
    code, group = _kernel_code(encoding)
    if code == _I8:
        return 4 + columns
    if encoding in _GGUF:
        _, block, size = _GGUF[encoding]
        if columns % block:
            raise ValueError(f"{encoding} codes rows of a multiple of {block} columns, not {columns}")
        return columns // block * size
    return -(-columns // group) * (4 + group // 2)


def usable(tensor: torch.Tensor) -> bool:
    """Whether the kernels can run on ``tensor``'s device here (compiled on a GPU, or on
    CPU tensors in the interpreter), without warning."""
    if runtime._triton_problem() is not None:
        return False
    device = tensor.device.type
    return device == "cpu" if runtime.interpreted() else device == "cuda"


# --------------------------------------------------------------------------- decoders
# Each takes the weight's base pointer, ``rows`` ([BLOCK_N, 1] int64: each row's byte
# offset), ``cols`` ([1, BLOCK_K] int32 columns) and ``mask`` (I8 also the rows' own
# mask, for its per-row scale), and returns float32
# [BLOCK_N, BLOCK_K]. Masked positions load zero bytes and decode to finite values.


@triton.jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(ptr, mask):
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _decode_i8(w_ptr, rows, row_mask, cols, mask):
    # f32 scale (row bytes 0-3, assembled: a row of 4 + K bytes need not be 4-aligned), int8 q[K].
    bits = _u8(w_ptr + rows, row_mask).to(tl.uint32)
    bits |= _u8(w_ptr + rows + 1, row_mask).to(tl.uint32) << 8
    bits |= _u8(w_ptr + rows + 2, row_mask).to(tl.uint32) << 16
    bits |= _u8(w_ptr + rows + 3, row_mask).to(tl.uint32) << 24
    scale = bits.to(tl.float32, bitcast=True)
    q = tl.load(w_ptr + rows + 4 + cols, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return scale * q


@triton.jit
def _decode_i4(w_ptr, rows, cols, mask, GROUP: tl.constexpr):
    # Blocks of GROUP values: f16 d, f16 m, GROUP/2 bytes (low nibbles: the first half).
    HALF: tl.constexpr = GROUP // 2
    i = cols % GROUP
    base = w_ptr + rows + (cols // GROUP) * (4 + HALF)
    q = (_u8(base + 4 + i % HALF, mask) >> ((i // HALF) * 4)) & 15
    return _f16(base, mask) * q.to(tl.float32) + _f16(base + 2, mask)


@triton.jit
def _decode_q8_0(w_ptr, rows, cols, mask):
    base = w_ptr + rows + (cols // 32) * 34
    q = tl.load(base + 2 + cols % 32, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return _f16(base, mask) * q


@triton.jit
def _decode_q4_0(w_ptr, rows, cols, mask):
    i = cols % 32
    base = w_ptr + rows + (cols // 32) * 18
    q = ((_u8(base + 2 + i % 16, mask) >> ((i // 16) * 4)) & 15) - 8
    return _f16(base, mask) * q.to(tl.float32)


@triton.jit
def _q5_code(qh, qs, i, mask):
    """A Q5_0/Q5_1 block's 5-bit code of value ``i``: the nibble of ``qs`` and, as bit 4,
    bit ``i`` of the 32-bit ``qh``."""
    high = (_u8(qh + i // 8, mask) >> (i % 8)) & 1
    return ((_u8(qs + i % 16, mask) >> ((i // 16) * 4)) & 15) | (high << 4)


@triton.jit
def _decode_q5_0(w_ptr, rows, cols, mask):
    i = cols % 32
    base = w_ptr + rows + (cols // 32) * 22
    q = _q5_code(base + 2, base + 6, i, mask) - 16
    return _f16(base, mask) * q.to(tl.float32)


@triton.jit
def _decode_q5_1(w_ptr, rows, cols, mask):
    i = cols % 32
    base = w_ptr + rows + (cols // 32) * 24
    q = _q5_code(base + 4, base + 8, i, mask)
    return _f16(base, mask) * q.to(tl.float32) + _f16(base + 2, mask)


@triton.jit
def _decode_iq4_nl(w_ptr, rows, cols, mask, table_ptr):
    i = cols % 32
    base = w_ptr + rows + (cols // 32) * 18
    code = (_u8(base + 2 + i % 16, mask) >> ((i // 16) * 4)) & 15
    return _f16(base, mask) * tl.load(table_ptr + code)


@triton.jit
def _decode_q2_k(w_ptr, rows, cols, mask):
    # u8 scales[16] (scale low nibble, min high, per 16 values), u8 qs[64], f16 d, f16 dmin.
    # Value 128 h + 32 j + l is bits 2j, 2j+1 of qs[32 h + l].
    i = cols % 256
    base = w_ptr + rows + (cols // 256) * 84
    sc = _u8(base + i // 16, mask)
    q = (_u8(base + 16 + (i // 128) * 32 + i % 32, mask) >> (((i % 128) // 32) * 2)) & 3
    dl = _f16(base + 80, mask) * (sc & 15).to(tl.float32)
    ml = _f16(base + 82, mask) * (sc >> 4).to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _decode_q3_k(w_ptr, rows, cols, mask):
    # u8 hmask[32], u8 qs[64] (as Q2_K's), u8 scales[12] (16 signed 6-bit), f16 d.
    i = cols % 256
    base = w_ptr + rows + (cols // 256) * 110
    low = (_u8(base + 32 + (i // 128) * 32 + i % 32, mask) >> (((i % 128) // 32) * 2)) & 3
    high = (_u8(base + i % 32, mask) >> (i // 32)) & 1
    q = low - ((high ^ 1) << 2)
    s = i // 16
    scale_low = (_u8(base + 96 + s % 8, mask) >> ((s // 8) * 4)) & 15
    scale_high = (_u8(base + 104 + s % 4, mask) >> ((s // 4) * 2)) & 3
    scale = (scale_low | (scale_high << 4)) - 32
    return (_f16(base + 108, mask) * scale.to(tl.float32)) * q.to(tl.float32)


@triton.jit
def _k_scale_min(packed, j, mask):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block ``j`` from the 12 bytes at ``packed``."""
    a = _u8(packed + j, mask)
    b = _u8(packed + j + 4, mask)
    c = _u8(packed + j - 4, mask)  # for j >= 4: the byte holding scale j's top bits (in the block for j < 4)
    first = j < 4
    scale = tl.where(first, a & 63, (b & 15) | ((c >> 6) << 4))
    minimum = tl.where(first, b & 63, (b >> 4) | ((a >> 6) << 4))
    return scale, minimum


@triton.jit
def _decode_q4_k(w_ptr, rows, cols, mask):
    # f16 d, f16 dmin, u8 scales[12], u8 qs[128]: sub-block j (32 values) is the low
    # (even j) or high (odd j) nibbles of the run of 32 bytes qs[32 (j // 2):].
    i = cols % 256
    base = w_ptr + rows + (cols // 256) * 144
    j = i // 32
    q = (_u8(base + 16 + (j // 2) * 32 + i % 32, mask) >> ((j % 2) * 4)) & 15
    scale, minimum = _k_scale_min(base + 4, j, mask)
    dl = _f16(base, mask) * scale.to(tl.float32)
    ml = _f16(base + 2, mask) * minimum.to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _decode_q5_k(w_ptr, rows, cols, mask):
    # As Q4_K with u8 qh[32] before qs: bit 4 of value 32 j + l is bit j of qh[l].
    i = cols % 256
    base = w_ptr + rows + (cols // 256) * 176
    j = i // 32
    low = (_u8(base + 48 + (j // 2) * 32 + i % 32, mask) >> ((j % 2) * 4)) & 15
    q = low | (((_u8(base + 16 + i % 32, mask) >> j) & 1) << 4)
    scale, minimum = _k_scale_min(base + 4, j, mask)
    dl = _f16(base, mask) * scale.to(tl.float32)
    ml = _f16(base + 2, mask) * minimum.to(tl.float32)
    return dl * q.to(tl.float32) - ml


@triton.jit
def _decode_q6_k(w_ptr, rows, cols, mask):
    # u8 ql[128], u8 qh[64], int8 scales[16], f16 d. Value 128 h + 32 j + l: the nibble
    # (low for j < 2) of ql[64 h + 32 (j % 2) + l], bits 2j..2j+1 of qh[32 h + l], minus 32.
    i = cols % 256
    base = w_ptr + rows + (cols // 256) * 210
    h = i // 128
    j = (i % 128) // 32
    low = (_u8(base + h * 64 + (j % 2) * 32 + i % 32, mask) >> ((j // 2) * 4)) & 15
    high = (_u8(base + 128 + h * 32 + i % 32, mask) >> (j * 2)) & 3
    q = (low | (high << 4)) - 32
    scale = tl.load(base + 192 + i // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return (_f16(base + 208, mask) * scale) * q.to(tl.float32)


@triton.jit
def _decode(w_ptr, rows, row_mask, cols, mask, table_ptr, ENC: tl.constexpr, GROUP: tl.constexpr):
    """float32 weights ``[BLOCK_N, BLOCK_K]`` at ``rows`` x ``cols`` (encoding ``ENC``);
    ``row_mask`` ``[BLOCK_N, 1]`` marks the rows that exist, ``mask`` the positions."""
    if ENC == 0:
        w = _decode_i8(w_ptr, rows, row_mask, cols, mask)
    elif ENC == 1:
        w = _decode_i4(w_ptr, rows, cols, mask, GROUP)
    elif ENC == 2:
        w = _decode_q8_0(w_ptr, rows, cols, mask)
    elif ENC == 3:
        w = _decode_q4_0(w_ptr, rows, cols, mask)
    elif ENC == 4:
        w = _decode_q5_0(w_ptr, rows, cols, mask)
    elif ENC == 5:
        w = _decode_q5_1(w_ptr, rows, cols, mask)
    elif ENC == 6:
        w = _decode_iq4_nl(w_ptr, rows, cols, mask, table_ptr)
    elif ENC == 7:
        w = _decode_q2_k(w_ptr, rows, cols, mask)
    elif ENC == 8:
        w = _decode_q3_k(w_ptr, rows, cols, mask)
    elif ENC == 9:
        w = _decode_q4_k(w_ptr, rows, cols, mask)
    elif ENC == 10:
        w = _decode_q5_k(w_ptr, rows, cols, mask)
    else:
        w = _decode_q6_k(w_ptr, rows, cols, mask)
    return w


# --------------------------------------------------------------------------- kernels


@triton.jit
def _dequantize_kernel(
    w_ptr, table_ptr, out_ptr, N, K, stride_wn, stride_on,
    ENC: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (cols[None, :] < K)
    rows = offs_n.to(tl.int64)[:, None] * stride_wn
    w = _decode(w_ptr, rows, offs_n[:, None] < N, cols[None, :], mask, table_ptr, ENC, GROUP)
    ptrs = out_ptr + offs_n.to(tl.int64)[:, None] * stride_on + cols[None, :]
    tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_result(
    acc, offs_m, offs_n, M, N, bias_ptr, out_ptr, stride_om, stride_os, split,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
):
    """``acc [BLOCK_M, BLOCK_N]`` (float32): a partial sum into ``split``'s slice of the
    scratch buffer, or (one split) plus the bias into the output."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT:
        ptrs = out_ptr + split.to(tl.int64) * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, table_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_os, k_per_split,
    ENC: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = offs_n.to(tl.int64)[:, None] * stride_wn
    n_mask = offs_n[:, None] < N
    k_start = tl.program_id(1) * k_per_split
    k_stop = tl.minimum(K, k_start + k_per_split)
    if BLOCK_M == 1:
        # One row of x: keep per-lane sums across the loop, reduce once at the end.
        wide = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            k_mask = cols < k_stop
            w = _decode(w_ptr, rows, n_mask, cols[None, :], n_mask & k_mask[None, :], table_ptr, ENC, GROUP)
            x = tl.load(x_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
            wide += w * x[None, :]
        acc = tl.sum(wide, axis=1)[None, :]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_stop, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            k_mask = cols < k_stop
            w = _decode(w_ptr, rows, n_mask, cols[None, :], n_mask & k_mask[None, :], table_ptr, ENC, GROUP)
            x_mask = (offs_m[:, None] < M) & k_mask[None, :]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=x_mask, other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    _store_result(acc, offs_m, offs_n, M, N, bias_ptr, out_ptr, stride_om, stride_os, tl.program_id(1), HAS_BIAS, SPLIT)


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, table_ptr, bias_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_os, k_per_split,
    ENC: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n.to(tl.int64)[:, None] * stride_wn
    n_mask = offs_n[:, None] < N
    m_mask = offs_m[:, None] < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    k_start = tl.program_id(2) * k_per_split
    k_stop = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        k_mask = cols[None, :] < k_stop
        w = _decode(w_ptr, rows, n_mask, cols[None, :], n_mask & k_mask, table_ptr, ENC, GROUP)
        x = tl.load(x_rows + cols[None, :], mask=m_mask & k_mask, other=0.0)
        w = w.to(x.dtype)
        if DOT_F32:  # the interpreter: 16-bit operands multiplied as the float32 values they hold
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    _store_result(acc, offs_m, offs_n, M, N, bias_ptr, out_ptr, stride_om, stride_os, tl.program_id(2), HAS_BIAS, SPLIT)


@triton.jit
def _split_sum_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, splits, stride_pm, stride_ps, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * stride_ps + row * stride_pm + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- host side


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100's count: in the interpreter the choice only needs to be stable


@functools.cache
def _iq4_nl_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(_IQ4_NL_VALUES, dtype=torch.float32, device=device)


def _splits(programs: int, k_tiles: int, sms: int, most: int) -> int:
    """Ranges to cut ``K`` into: enough programs for about four per multiprocessor,
    each range at least two ``BLOCK_K`` tiles, at most ``most`` ranges."""
    if programs >= 4 * sms or k_tiles < 4:
        return 1
    return max(1, min(-(-4 * sms // programs), k_tiles // 2, most))


def _gemv_blocks(m: int) -> tuple[int, int, int]:
    block_m = next_pow2(m)
    return block_m, 16, max(32, 256 // block_m)


def _gemm_blocks(m: int, x_dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)``."""
    if m <= 16:
        return 16, 64, 64, 4
    if m <= 64:
        return next_pow2(m), 64, 64, 4
    return 128, 128, 32 if x_dtype == torch.float32 else 64, 8


def _dot_precision(dtype: torch.dtype) -> str:
    # float32: three tf32 products, about float32 accuracy on the tensor cores (as the
    # attention kernels do); 16-bit operands ignore the setting.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _check_weight(data, encoding: str, columns: int, device: torch.device, name: str = "data") -> torch.Tensor:
    expected = row_bytes(encoding, columns)
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 2:
        what = f"{data.dtype} {tuple(data.shape)}" if isinstance(data, torch.Tensor) else type(data).__name__
        raise ValueError(f"{name}: expected uint8 [N, bytes per row], got {what}")
    if data.shape[1] != expected:
        raise ValueError(f"{name}: {encoding} rows of {columns} columns take {expected} bytes, got {data.shape[1]}")
    if data.device != device:
        raise ValueError(f"{name}: on {data.device}, expected {device}")
    if data.numel() and (data.stride(1) != 1 or (encoding != "I8" and (data.stride(0) % 2 or data.data_ptr() % 2))):
        data = data.clone(memory_format=torch.contiguous_format)  # fresh storage: aligned rows
    return data


def _check_x(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected 2 dims [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x: dtype {x.dtype} is not one of float32, float16, bfloat16")


def _check_bias(bias, n: int, device: torch.device) -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != (n,):
        what = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias: expected a float tensor of shape ({n},), got {what}")
    if bias.device != device:
        raise ValueError(f"bias: on {bias.device}, expected {device}")


def _contiguous(bias: torch.Tensor | None) -> torch.Tensor | None:
    return bias if bias is None or bias.stride(0) == 1 else bias.contiguous()


def packed_linear(
    x: torch.Tensor,
    data: torch.Tensor,
    encoding: str,
    bias: torch.Tensor | None = None,
    *,
    splits: int | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` as ``[M, N]`` in ``x.dtype``, ``W`` packed as ``data``
    ``uint8 [N, row_bytes(encoding, K)]``. ``splits`` (tests, tuning) fixes how many
    ranges ``K`` is cut into; by default :func:`_splits` chooses."""
    _kernel_code(encoding)  # refuses an encoding without a kernel
    _check_x(x)
    m, k = x.shape
    data = _check_weight(data, encoding, k, x.device)
    n = data.shape[0]
    _check_bias(bias, n, x.device)
    bias = _contiguous(bias)
    if splits is not None and (type(splits) is not int or splits < 1):
        raise ValueError(f"splits: expected a positive int, got {splits!r}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_((torch.zeros(n, device=x.device) if bias is None else bias.float()).expand(m, n))
    if x.stride(1) != 1:
        x = x.contiguous()
    code, group = _kernel_code(encoding)
    table = _iq4_nl_table(x.device)
    sms = _num_sms(x.device)
    if m <= GEMV_MAX_ROWS:
        block_m, block_n, block_k = _gemv_blocks(m)
        grid_mn, num_warps = (triton.cdiv(n, block_n),), 4
    else:
        block_m, block_n, block_k, num_warps = _gemm_blocks(m, x.dtype)
        grid_mn = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    k_tiles = triton.cdiv(k, block_k)
    count = splits if splits is not None else _splits(math.prod(grid_mn), k_tiles, sms, most=8)
    count = min(count, k_tiles)
    k_per_split = triton.cdiv(k_tiles, count) * block_k
    count = triton.cdiv(k, k_per_split)  # no empty ranges
    target = out if count == 1 else torch.empty((count, m, n), dtype=torch.float32, device=x.device)
    stride_om, stride_os = target.stride(-2), target.stride(0) if count > 1 else 0
    has_bias = bias is not None
    args = (
        x, data, table, bias if has_bias else table, target,
        m, n, k, x.stride(0), data.stride(0), stride_om, stride_os, k_per_split,
    )
    if m <= GEMV_MAX_ROWS:
        _gemv_kernel[grid_mn + (count,)](
            *args, ENC=code, GROUP=group, HAS_BIAS=has_bias, SPLIT=count > 1,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        )
    else:
        _gemm_kernel[grid_mn + (count,)](
            *args, ENC=code, GROUP=group, HAS_BIAS=has_bias, SPLIT=count > 1,
            DOT_F32=runtime.interpreted() and x.dtype != torch.float32, DOT_PRECISION=_dot_precision(x.dtype),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        )
    if count > 1:
        block = min(next_pow2(n), 1024)
        _split_sum_kernel[(m, triton.cdiv(n, block))](
            target, bias if has_bias else target, out, m, n, count, target.stride(1), target.stride(0), out.stride(0),
            HAS_BIAS=has_bias, BLOCK=block, num_warps=4,
        )
    return out


def dequantize(data: torch.Tensor, encoding: str, columns: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[N, columns]`` values (in ``dtype``) of ``data`` packed in ``encoding``."""
    _kernel_code(encoding)
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype: {dtype} is not one of float32, float16, bfloat16")
    if type(columns) is not int or columns < 0:
        raise ValueError(f"columns: expected a non-negative int, got {columns!r}")
    device = data.device if isinstance(data, torch.Tensor) else torch.device("cpu")
    data = _check_weight(data, encoding, columns, device)
    n = data.shape[0]
    out = torch.empty((n, columns), dtype=dtype, device=device)
    if n and columns:
        code, group = _kernel_code(encoding)
        block_n, block_k = 16, 128
        _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(columns, block_k))](
            data, _iq4_nl_table(device), out, n, columns, data.stride(0), out.stride(0),
            ENC=code, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )
    return out


def packed_linear_reference(
    x: torch.Tensor, data: torch.Tensor, encoding: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The twin: pyagent-quant's torch decoders, then ``F.linear`` in float32, rounded
    to ``x.dtype``."""
    _kernel_code(encoding)
    _check_x(x)
    try:
        from pyagent_quant import encodings as layouts
    except ImportError as exc:  # pragma: no cover - pyagent-quant is a test dependency
        raise RuntimeError("packed_linear_reference decodes with pyagent-quant, which is not installed") from exc
    from pyagent_framework.interfaces import PackedWeight

    data = _check_weight(data, encoding, x.shape[1], x.device)
    _check_bias(bias, data.shape[0], x.device)
    weight = layouts.dequantize(PackedWeight(encoding, (data.shape[0], x.shape[1]), data, layouts.dequantize))
    out = torch.nn.functional.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)

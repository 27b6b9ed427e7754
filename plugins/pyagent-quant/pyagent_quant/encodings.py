"""The packed encodings the quantizers compute from, in plain torch: the reference
twin of the native kernels, and the fallback where the native core is not installed.

A packed weight is ``uint8 [rows, bytes_per_row]``; each row is a run of blocks that
code consecutive columns. Little-endian; f16 is IEEE half precision.

| encoding | block | bytes | a block codes |
| --- | --- | --- | --- |
| ``Q8_0`` (GGUF) | 32 | 34 | f16 d, int8 q[32]: ``d*q`` |
| ``Q4_0`` (GGUF) | 32 | 18 | f16 d, u8 qs[16]: ``d*((qs & 15) - 8)``, then ``d*((qs >> 4) - 8)`` |
| ``Q4_1`` (GGUF) | 32 | 20 | f16 d, f16 m, u8 qs[16]: ``d*(qs & 15) + m``, then ``d*(qs >> 4) + m`` |
| ``Q6_K`` (GGUF) | 256 | 210 | u8 ql[128], u8 qh[64], int8 scales[16], f16 d (ggml's layout) |
| ``Q5_0`` (GGUF) | 32 | 22 | f16 d, u32 qh, u8 qs[16]: ``d*(q - 16)``, q's bit 4 from ``qh`` |
| ``Q5_1`` (GGUF) | 32 | 24 | f16 d, f16 m, u32 qh, u8 qs[16]: ``d*q + m`` |
| ``IQ4_NL`` (GGUF) | 32 | 18 | f16 d, u8 qs[16]: ``d*v[q]``, ``v`` a table of 16 values in [-127, 113] |
| ``Q2_K`` (GGUF) | 256 | 84 | u8 scales[16], u8 qs[64], f16 d, f16 dmin: ``(d*scale)*q - dmin*min`` |
| ``Q3_K`` (GGUF) | 256 | 110 | u8 hmask[32], u8 qs[64], u8 scales[12], f16 d: ``(d*scale)*q``, q in -4..3 |
| ``Q4_K`` (GGUF) | 256 | 144 | f16 d, f16 dmin, u8 scales[12], u8 qs[128]: ``(d*scale)*q - dmin*min`` |
| ``Q5_K`` (GGUF) | 256 | 176 | f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]: as ``Q4_K``, 5-bit q |
| ``I8`` | row | 4 + K | f32 scale, int8 q[K]: ``scale*q`` (per output channel, symmetric) |
| ``I4_G{g}`` | g | 4 + g/2 | as ``Q4_1`` with g columns per block; ``I4_G32`` is ``Q4_1`` |

``I8`` and ``I4_G{g}`` take any column count: the last ``I4`` block is stored whole
and its columns past the end are padding, never read.

The decoders follow the ``gguf`` package's float32 operation order (``d * q + m`` as a
product then a sum, ``(d * scale) * q`` for ``Q6_K``), so they equal it bit for bit.
The decoders of the types listed after ``Q6_K`` live in :mod:`pyagent_quant.gguf_blocks`,
which spells out their bit layouts (k-quant scales and mins are 4- or 6-bit integers per
sub-block of 16 or 32 values).
"""

from __future__ import annotations

import re

import torch

from pyagent_framework.interfaces import PackedWeight

from . import gguf_blocks
from .gguf_blocks import f16 as _f16
from .gguf_blocks import nibbles as _nibbles

#: The GGUF types the engine keeps packed (the native core has kernels for each).
GGUF_ENCODINGS = frozenset({"Q8_0", "Q4_0", "Q4_1", "Q6_K", *gguf_blocks.DECODERS})
INT4_GROUPS = (32, 64, 128)
_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q6_K": (256, 210), **gguf_blocks.BLOCKS}
_I4 = re.compile(r"I4_G(\d+)")


def kernel_encoding(encoding: str) -> tuple[str, int]:
    """The native core's ``(encoding, group)`` for an encoding name."""
    m = _I4.fullmatch(encoding)
    if m:
        return "I4", int(m.group(1))
    return encoding, 0


def row_bytes(encoding: str, columns: int) -> int:
    """Bytes of one packed row of ``columns`` values (``ValueError`` if it cannot be)."""
    if encoding in _BLOCKS:
        block, size = _BLOCKS[encoding]
        if columns % block:
            raise ValueError(f"{encoding} codes rows of a multiple of {block} columns, not {columns}")
        return columns // block * size
    if encoding == "I8":
        return 4 + columns
    group = kernel_encoding(encoding)[1]
    if group in INT4_GROUPS:
        return -(-columns // group) * (4 + group // 2)
    raise ValueError(f"unknown encoding {encoding!r} (known: {', '.join(sorted(_BLOCKS))}, I8, I4_G32/64/128)")


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """The float32 ``[rows, columns]`` values of ``packed`` (any encoding above)."""
    rows, columns = packed.shape
    data = packed.data
    expected = row_bytes(packed.encoding, columns)
    if tuple(data.shape) != (rows, expected) or data.dtype != torch.uint8:
        raise ValueError(
            f"packed weight {packed.name!r}: {packed.encoding} rows of {columns} columns take {expected} bytes; "
            f"got {data.dtype} {tuple(data.shape)}"
        )
    encoding, group = kernel_encoding(packed.encoding)
    if encoding in gguf_blocks.DECODERS:
        return gguf_blocks.DECODERS[encoding](data)
    if encoding == "I8":
        # A fresh [rows, 4] copy: a view of a narrow slice cannot be reinterpreted.
        scale = torch.empty(rows, 4, dtype=torch.uint8, device=data.device).copy_(data[:, :4]).view(torch.float32)
        return scale * data[:, 4:].view(torch.int8).float()
    if encoding == "I4" or encoding == "Q4_1":
        group = group or 32
        blocks = data.reshape(rows, expected // (4 + group // 2), 4 + group // 2)
        q = _nibbles(blocks[..., 4:]).float()
        values = (_f16(blocks, 0) * q + _f16(blocks, 2)).reshape(rows, blocks.shape[1] * group)
        return values[:, :columns].contiguous()
    if encoding == "Q8_0":
        blocks = data.reshape(rows, expected // 34, 34)
        return (_f16(blocks, 0) * blocks[..., 2:].view(torch.int8).float()).reshape(rows, columns)
    if encoding == "Q4_0":
        blocks = data.reshape(rows, expected // 18, 18)
        q = (_nibbles(blocks[..., 2:]).to(torch.int8) - 8).float()
        return (_f16(blocks, 0) * q).reshape(rows, columns)
    # Q6_K: 256 values in two halves of 128; value l + 32*j of a half takes the nibble
    # (low for j = 0, 1; high for j = 2, 3) of ql[l + 32*(j % 2)] and bits 2j..2j+1 of
    # qh[l], minus 32, times d * scales[j*2 + l // 16] (scale index per 16 values).
    n = expected // 210
    blocks = data.reshape(rows, n, 210)
    ql = blocks[..., :128].reshape(rows, n, 2, 64)
    qh = blocks[..., 128:192].reshape(rows, n, 2, 1, 32)
    low = torch.cat([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=-1)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=data.device).view(4, 1)) & 3
    q = (low | (high.reshape(rows, n, 2, 128) << 4)).to(torch.int8) - 32
    scales = blocks[..., 192:208].view(torch.int8).float()
    d = (_f16(blocks, 208) * scales).reshape(rows, n, 16, 1)
    return (d * q.reshape(rows, n, 16, 16).float()).reshape(rows, columns)


def dequantize_rows(packed: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Float32 rows ``ids`` of ``packed`` (an embedding lookup)."""
    data = packed.data[ids.reshape(-1)]
    rows = PackedWeight(packed.encoding, (data.shape[0], packed.shape[1]), data, packed.decode, packed.name)
    return dequantize(rows).reshape(*ids.shape, packed.shape[1])


def _packed(encoding: str, weight: torch.Tensor, data: torch.Tensor, name: str) -> PackedWeight:
    return PackedWeight(encoding, tuple(weight.shape), data.contiguous(), dequantize, name)


def quantize_i8(weight: torch.Tensor, name: str = "") -> PackedWeight:
    """Symmetric int8 per row (output channel): ``scale = max|w| / 127``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    data = torch.cat([scale.contiguous().view(torch.uint8), q.view(torch.uint8)], dim=1)
    return _packed("I8", w, data, name)


def quantize_i4(weight: torch.Tensor, group: int, name: str = "") -> PackedWeight:
    """Asymmetric int4 per group of ``group`` columns: ``m = min``, ``d = (max - min) / 15``
    (both rounded to f16 first, so the codes fit the stored values)."""
    if group not in INT4_GROUPS:
        raise ValueError(f"int4 group size must be one of {INT4_GROUPS}, got {group}")
    w = weight.detach().float()
    rows, columns = w.shape
    groups = -(-columns // group)
    padded = torch.nn.functional.pad(w, (0, groups * group - columns)).reshape(rows, groups, group)
    # The padding columns must not widen a group's range: they take its first value.
    if columns % group:
        last = padded[:, -1]
        last[:, columns % group :] = last[:, :1]
    lo, hi = padded.amin(dim=-1, keepdim=True), padded.amax(dim=-1, keepdim=True)
    m = lo.half()
    d = ((hi - m.float()) / 15).half()
    d = torch.where(d.float() > 0, d, torch.ones_like(d))
    q = torch.round((padded - m.float()) / d.float()).clamp_(0, 15).to(torch.uint8)
    qs = q[..., : group // 2] | (q[..., group // 2 :] << 4)
    data = torch.cat([d.view(torch.uint8), m.view(torch.uint8), qs], dim=-1).reshape(rows, -1)
    return _packed(f"I4_G{group}", w, data, name)

"""Torch decoders of the GGUF block types Q5_0, Q5_1, IQ4_NL and the k-quants Q2_K,
Q3_K, Q4_K, Q5_K: the reference the native kernels are checked against, and their
fallback. :mod:`pyagent_quant.encodings` dispatches to them (its module docstring
tables the layouts); each takes ``uint8 [rows, row bytes]`` and returns float32
``[rows, columns]``.

Each decoder repeats the ``gguf`` package's float32 operations in its order, so it
equals ``gguf.quants.dequantize`` bit for bit: ``d * q`` (Q5_0, and IQ4_NL with ``q``
looked up in :data:`IQ4_NL_VALUES`), ``d * q + m`` (Q5_1), ``(d * scale) * q`` (Q3_K)
and ``(d * scale) * q - dmin * min`` (Q2_K, Q4_K, Q5_K), where ``scale``/``min`` are
the small integers a k-quant keeps per sub-block.
"""

from __future__ import annotations

import torch

#: (values, bytes) per block.
BLOCKS = {
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "IQ4_NL": (32, 18),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
}
#: The 16 values an IQ4_NL code stands for (ggml's ``kvalues_iq4nl``), ascending.
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def f16(data: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte ``at`` of each block (``data [..., block bytes]``) as float32."""
    return data[..., at : at + 2].contiguous().view(torch.float16).float()


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Low nibbles of every byte, then the high ones (the order GGUF blocks use)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(data: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Fields of ``width`` bits of every byte, low first: ``[..., bytes]`` becomes
    ``[..., count, bytes]`` (field ``j`` of byte ``i`` at ``[..., j, i]``)."""
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8, device=data.device).view(count, 1)
    return (data.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _blocks(data: torch.Tensor, encoding: str) -> torch.Tensor:
    """``data [rows, row bytes]`` as ``[rows, blocks, block bytes]``."""
    size = BLOCKS[encoding][1]
    return data.reshape(data.shape[0], data.shape[1] // size, size)


def _rows(values: torch.Tensor, data: torch.Tensor, encoding: str) -> torch.Tensor:
    """Decoded ``values`` (any shape) as ``[rows, columns]`` of ``data``'s rows (an
    explicit shape: zero rows cannot infer one)."""
    block, size = BLOCKS[encoding]
    return values.reshape(data.shape[0], data.shape[1] // size * block)


def _q5_codes(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """The 5-bit codes 0..31 of a Q5_0/Q5_1 block: nibbles of ``qs`` (low, then high)
    and, as bit 4, bit ``i`` of the little-endian 32-bit ``qh`` for value ``i``."""
    high = _bits(qh, 1, 8).transpose(-1, -2).reshape(*qh.shape[:-1], 32)
    return nibbles(qs) | (high << 4)


def decode_q5_0(data: torch.Tensor) -> torch.Tensor:
    """Q5_0: f16 d, u32 qh, u8 qs[16]; ``d * (code - 16)``."""
    blocks = _blocks(data, "Q5_0")
    q = (_q5_codes(blocks[..., 2:6], blocks[..., 6:]).to(torch.int8) - 16).float()
    return _rows(f16(blocks, 0) * q, data, "Q5_0")


def decode_q5_1(data: torch.Tensor) -> torch.Tensor:
    """Q5_1: f16 d, f16 m, u32 qh, u8 qs[16]; ``d * code + m``."""
    blocks = _blocks(data, "Q5_1")
    q = _q5_codes(blocks[..., 4:8], blocks[..., 8:]).float()
    return _rows(f16(blocks, 0) * q + f16(blocks, 2), data, "Q5_1")


def decode_iq4_nl(data: torch.Tensor) -> torch.Tensor:
    """IQ4_NL: f16 d, u8 qs[16]; ``d * IQ4_NL_VALUES[code]``, codes as Q4_0's."""
    blocks = _blocks(data, "IQ4_NL")
    table = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=data.device)
    q = table[nibbles(blocks[..., 2:]).long()]
    return _rows(f16(blocks, 0) * q, data, "IQ4_NL")


def _twin_crumbs(qs: torch.Tensor) -> torch.Tensor:
    """The 2-bit codes of a Q2_K/Q3_K block's ``qs [..., 64]`` in value order: value
    ``128 h + 32 j + l`` is bits ``2j, 2j + 1`` of ``qs[32 h + l]``; as ``[..., 16, 16]``
    (one row per sub-block of 16)."""
    halves = qs.reshape(*qs.shape[:-1], 2, 32)
    return _bits(halves, 2, 4).reshape(*qs.shape[:-1], 16, 16)


def decode_q2_k(data: torch.Tensor) -> torch.Tensor:
    """Q2_K: u8 scales[16] (low nibble scale, high nibble min of each sub-block of 16),
    u8 qs[64] (2-bit codes), f16 d, f16 dmin; ``(d * scale) * q - dmin * min``."""
    blocks = _blocks(data, "Q2_K")
    scales = blocks[..., :16]
    dl = (f16(blocks, 80) * (scales & 15).float()).unsqueeze(-1)
    ml = (f16(blocks, 82) * (scales >> 4).float()).unsqueeze(-1)
    q = _twin_crumbs(blocks[..., 16:80]).float()
    return _rows(dl * q - ml, data, "Q2_K")


def _q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K's 16 signed 6-bit scales from ``packed [..., 12]``: scale ``s`` takes its low
    nibble from byte ``s % 8`` (low nibble for ``s < 8``, high for the rest) and its top
    two bits from bits ``2 (s // 4)`` of byte ``8 + s % 4``; stored plus 32."""
    low = nibbles(packed[..., :8])
    high = _bits(packed[..., 8:], 2, 4).reshape(*packed.shape[:-1], 16)
    return (low | (high << 4)).to(torch.int8) - 32


def decode_q3_k(data: torch.Tensor) -> torch.Tensor:
    """Q3_K: u8 hmask[32], u8 qs[64], u8 scales[12], f16 d; ``(d * scale) * q`` with
    ``q`` the 2-bit code minus 4 unless the value's hmask bit (bit ``j`` of
    ``hmask[l]`` for value ``32 j + l``) is set."""
    blocks = _blocks(data, "Q3_K")
    dl = (f16(blocks, 108) * _q3_k_scales(blocks[..., 96:108]).float()).unsqueeze(-1)
    low = _twin_crumbs(blocks[..., 32:96]).to(torch.int8)
    high = _bits(blocks[..., :32], 1, 8).reshape(*blocks.shape[:-1], 16, 16)
    q = (low - ((high ^ 1) << 2).to(torch.int8)).float()
    return _rows(dl * q, data, "Q3_K")


def k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit scales and mins from ``packed [..., 12]``: bytes 0-3 hold
    scales 0-3 (low six bits), bytes 4-7 mins 0-3; scales and mins 4-7 keep their low
    nibbles in bytes 8-11 (scale low, min high) and their top two bits in the top bits
    of bytes 0-3 (scales) and 4-7 (mins)."""
    sc, mn, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([sc & 63, (extra & 15) | ((sc >> 2) & 48)], dim=-1)
    mins = torch.cat([mn & 63, (extra >> 4) | ((mn >> 2) & 48)], dim=-1)
    return scales, mins


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``(d * scale) * q - dmin * min`` per sub-block of 32 of a Q4_K/Q5_K block
    (``q [rows, blocks, 8, 32]``), in that shape."""
    scales, mins = k_scales_mins(blocks[..., 4:16])
    dl = (f16(blocks, 0) * scales.float()).unsqueeze(-1)
    ml = (f16(blocks, 2) * mins.float()).unsqueeze(-1)
    return dl * q - ml


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of a Q4_K/Q5_K block's ``qs [..., 128]`` as ``[..., 8, 32]``: each
    run of 32 bytes gives two sub-blocks, its low nibbles then its high ones."""
    runs = qs.reshape(*qs.shape[:-1], 4, 32)
    return _bits(runs, 4, 2).reshape(*qs.shape[:-1], 8, 32)


def decode_q4_k(data: torch.Tensor) -> torch.Tensor:
    """Q4_K: f16 d, f16 dmin, u8 scales[12], u8 qs[128]; 8 sub-blocks of 32."""
    blocks = _blocks(data, "Q4_K")
    return _rows(_k_affine(blocks, _k_nibbles(blocks[..., 16:]).float()), data, "Q4_K")


def decode_q5_k(data: torch.Tensor) -> torch.Tensor:
    """Q5_K: f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]; as Q4_K with bit 4
    of value ``32 j + l`` in bit ``j`` of ``qh[l]``."""
    blocks = _blocks(data, "Q5_K")
    high = _bits(blocks[..., 16:48], 1, 8)
    q = (_k_nibbles(blocks[..., 48:]) | (high << 4)).float()
    return _rows(_k_affine(blocks, q), data, "Q5_K")


DECODERS = {
    "Q5_0": decode_q5_0,
    "Q5_1": decode_q5_1,
    "IQ4_NL": decode_iq4_nl,
    "Q2_K": decode_q2_k,
    "Q3_K": decode_q3_k,
    "Q4_K": decode_q4_k,
    "Q5_K": decode_q5_k,
}

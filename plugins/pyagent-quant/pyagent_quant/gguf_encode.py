"""Encoders from float32 weights to GGUF block bytes, numpy-vectorised: tests and
benchmarks re-encode a model to the GGML types the engine reads (see
:mod:`pyagent_quant.gguf_file`), without llama.cpp.

``quantize_gguf(weight, encoding)`` gives ``uint8 [rows, row bytes]`` in ggml's layout
(the one :mod:`pyagent_quant.encodings` and ``gguf.quants.dequantize`` read).

- ``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``: the ``gguf`` package's quantizer,
  which writes llama.cpp's reference bytes exactly.
- ``Q2_K``, ``Q4_K``, ``Q5_K`` (asymmetric): per sub-block (16 values for Q2_K, 32 for
  the others) a step and a minimum fitted to its values, as llama.cpp does: candidate
  steps ``(max - min) / (nmax + s)`` for a few ``s`` around 0 give codes; for each,
  least squares gives the best step and minimum for those codes, and the candidate of
  least squared error wins. The steps and minimums are then rounded to integers (4
  bits for Q2_K, 6 for the others) against the super-block's f16 ``d`` and ``dmin``,
  and the codes recomputed against the rounded values.
- ``Q3_K``, ``Q6_K`` (symmetric): per sub-block of 16 a signed step such that the value
  of largest magnitude maps near ``-nmax``, the longer end of the code range
  ``-nmax..nmax-1`` (candidates refined by least squares as above); the steps rounded
  to signed integers (6 bits, 8 bits) against the f16 ``d``, codes recomputed.
- ``IQ4_NL``: per block of 32 a step ``d`` that maps the value of largest magnitude
  onto the table's end -127; codes the nearest table entries of ``x / f16(d)``.

The k-quant fits weigh every value alike (llama.cpp weighs large ones more): with
nothing known of the activations that is the least expected error of a product, and
on a re-encoded SmolLM2 it did as well (Q4_K, Q5_K, Q6_K) or better (Q3_K: token
log-probabilities 8% closer to the float model's). All-zero blocks
encode to zeros (every step 0), with no division by zero. Steps are f16, as ggml's:
blocks of magnitude below about 1e-5 lose precision to f16 subnormals, as in ggml.
"""

from __future__ import annotations

import numpy as np
import torch

from . import encodings
from .gguf_blocks import IQ4_NL_VALUES

# Encoded by the gguf package, bit-exactly as llama.cpp's reference quantizers do.
_GGUF_PACKAGE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# Values encoded at a time (whole blocks): bounds the candidate search's temporaries,
# a few float32 arrays of candidates x values.
_CHUNK = 1 << 16


def _divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den``, 0 where ``den`` is 0 (an all-zero block's step)."""
    num, den = np.broadcast_arrays(np.asarray(num, np.float32), np.asarray(den, np.float32))
    return np.divide(num, den, out=np.zeros(num.shape, np.float32), where=den != 0)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """Float16 ``values [n]`` as their two bytes each, ``[n, 2]``."""
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _pack_fields(fields: np.ndarray, width: int) -> np.ndarray:
    """Bytes made of ``width``-bit fields, low first: ``[..., count, bytes]`` of small
    integers (field ``j`` of byte ``i`` at ``[..., j, i]``) becomes ``[..., bytes]``."""
    fields = fields.astype(np.uint8)
    out = np.zeros(fields.shape[:-2] + fields.shape[-1:], np.uint8)
    for j in range(fields.shape[-2]):
        out |= fields[..., j, :] << np.uint8(width * j)
    return out


def _peak(x: np.ndarray) -> np.ndarray:
    """The signed value of largest magnitude of each row of ``x [..., k]``."""
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]


# -- fits -------------------------------------------------------------------------------------


def _fit_affine(x: np.ndarray, nmax: int, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block ``x [n, k]``: ``(scale, offset)``, both >= 0, with ``x ~ scale * q -
    offset`` for integer ``q`` in ``0..nmax``, of least squared error among the
    candidates ``(max - min) / (nmax + s)`` for ``s`` in ``steps``, each refined by least
    squares for its codes. The minimum is taken at most 0 (so the offset is a
    non-negative integer multiple of ``dmin`` once rounded)."""
    lo = np.minimum(x.min(-1), 0)
    span = x.max(-1) - lo
    inverse = _divide((nmax + steps)[:, None], span)  # [candidates, n]
    q = np.clip(np.rint(inverse[..., None] * (x - lo[:, None])), 0, nmax)
    count, sx = np.float32(x.shape[-1]), x.sum(-1)
    sq, sq2, sxq = q.sum(-1), (q * q).sum(-1), (x * q).sum(-1)
    det = count * sq2 - sq * sq
    scale = _divide(count * sxq - sx * sq, det)
    base = _divide(sq2 * sx - sq * sxq, det)
    # A positive minimum cannot be stored: refit the scale alone through 0.
    clipped = base > 0
    scale = np.where(clipped, _divide(sxq, sq2), scale)
    base = np.where(clipped, 0, base)
    # Codes all alike (det 0): the plain min/max fit.
    flat = det <= 0
    scale = np.where(flat, _divide(span, np.float32(nmax)), scale)
    base = np.where(flat, lo, base)
    error = ((scale[..., None] * q + base[..., None] - x) ** 2).sum(-1)
    best = error.argmin(0)[None]
    scale, base = (np.take_along_axis(a, best, 0)[0] for a in (scale, base))
    return np.maximum(scale, 0), -base


def _fit_symmetric(x: np.ndarray, nmax: int, steps: np.ndarray) -> np.ndarray:
    """Per sub-block ``x [n, k]``: a signed ``scale`` with ``x ~ scale * q`` for integer
    ``q`` in ``-nmax..nmax-1``, the value of largest magnitude mapped near ``-nmax``:
    candidates ``-peak / (nmax + s)`` for ``s`` in ``steps``, each refined by least
    squares; the one of least squared error."""
    inverse = _divide(-(nmax + steps)[:, None], _peak(x))
    q = np.clip(np.rint(inverse[..., None] * x), -nmax, nmax - 1)
    sxq, sq2 = (x * q).sum(-1), (q * q).sum(-1)
    # The least-squares error is sum(x^2) - sxq^2 / sq2: the largest quotient wins.
    gain = _divide(sxq * sxq, sq2)
    best = gain.argmax(0)[None]
    return np.take_along_axis(_divide(sxq, sq2), best, 0)[0]


def _round_unsigned(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative ``values [n, s]`` as f16 ``d [n]`` times integers ``0..top``, ``d``
    mapping each row's largest value to ``top``."""
    d = (values.max(-1) / np.float32(top)).astype(np.float16)
    ints = np.clip(np.rint(_divide(values, d.astype(np.float32)[:, None])), 0, top)
    return d, ints.astype(np.uint8)


def _round_signed(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed ``values [n, s]`` as f16 ``d [n]`` times integers ``-levels..levels-1``,
    ``d`` mapping each row's value of largest magnitude to ``-levels``."""
    d = (-_peak(values) / np.float32(levels)).astype(np.float16)
    ints = np.clip(np.rint(_divide(values, d.astype(np.float32)[:, None])), -levels, levels - 1)
    return d, ints.astype(np.int8)


def _product(d: np.ndarray, ints: np.ndarray) -> np.ndarray:
    """``d * ints`` in float32, as the decoders form a sub-block's step or minimum."""
    return d.astype(np.float32)[:, None] * ints.astype(np.float32)


# -- asymmetric k-quants ----------------------------------------------------------------------


def _affine_k(blocks: np.ndarray, sub: int, nmax: int, top: int, steps: np.ndarray):
    """The fields of an asymmetric k-quant: ``(d, dmin, scales, mins, codes)`` for
    ``blocks [n, 256]`` in sub-blocks of ``sub`` with codes ``0..nmax`` and integer scales
    and mins ``0..top``."""
    n = blocks.shape[0]
    x = blocks.reshape(n * 256 // sub, sub)
    scale, offset = _fit_affine(x, nmax, steps)
    d, scales = _round_unsigned(scale.reshape(n, -1), top)
    dmin, mins = _round_unsigned(offset.reshape(n, -1), top)
    step, low = _product(d, scales), _product(dmin, mins)
    q = np.rint(_divide(x.reshape(n, -1, sub) + low[..., None], step[..., None]))
    return d, dmin, scales, mins, np.clip(q, 0, nmax).astype(np.uint8).reshape(n, 256)


def _pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and mins (the inverse of
    :func:`pyagent_quant.gguf_blocks.k_scales_mins`)."""
    return np.concatenate(
        [
            scales[:, :4] | ((scales[:, 4:] >> 4) << 6),
            mins[:, :4] | ((mins[:, 4:] >> 4) << 6),
            (scales[:, 4:] & 15) | ((mins[:, 4:] & 15) << 4),
        ],
        axis=-1,
    )


def _encode_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K: scales[16] (scale | min << 4), qs[64], d, dmin."""
    n = blocks.shape[0]
    d, dmin, scales, mins, q = _affine_k(blocks, 16, 3, 15, np.arange(-0.5, 1.01, 0.1))
    qs = _pack_fields(q.reshape(n, 2, 4, 32), 2).reshape(n, 64)
    return np.concatenate([scales | (mins << 4), qs, _f16_bytes(d), _f16_bytes(dmin)], axis=-1)


def _encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K: d, dmin, scales[12], qs[128]."""
    n = blocks.shape[0]
    d, dmin, scales, mins, q = _affine_k(blocks, 32, 15, 63, np.arange(-1.0, 1.01, 0.1))
    qs = _pack_fields(q.reshape(n, 4, 2, 32), 4).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(scales, mins), qs], axis=-1)


def _encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K: d, dmin, scales[12], qh[32] (bit 4 of value 32j + l in bit j of qh[l]), qs[128]."""
    n = blocks.shape[0]
    d, dmin, scales, mins, q = _affine_k(blocks, 32, 31, 63, np.arange(-2, 2.01, 0.2))
    qh = _pack_fields((q >> 4).reshape(n, 8, 32), 1)
    qs = _pack_fields((q & 15).reshape(n, 4, 2, 32), 4).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(scales, mins), qh, qs], axis=-1)


# -- symmetric k-quants -----------------------------------------------------------------------


def _symmetric_k(blocks: np.ndarray, nmax: int, levels: int, steps: np.ndarray):
    """The fields of a symmetric k-quant: ``(d, scales, codes)`` for ``blocks [n, 256]``
    in sub-blocks of 16, codes ``-nmax..nmax-1`` and integer scales ``-levels..levels-1``."""
    n = blocks.shape[0]
    x = blocks.reshape(n * 16, 16)
    scale = _fit_symmetric(x, nmax, steps)
    d, scales = _round_signed(scale.reshape(n, 16), levels)
    q = np.rint(_divide(x.reshape(n, 16, 16), _product(d, scales)[..., None]))
    return d, scales, np.clip(q, -nmax, nmax - 1).astype(np.int8).reshape(n, 256)


def _encode_q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K: hmask[32], qs[64], scales[12], d. A code ``q`` in -4..3 is kept as ``q + 4``:
    its low two bits in ``qs``, its bit 2 in ``hmask`` (set: no -4 offset)."""
    n = blocks.shape[0]
    d, scales, q = _symmetric_k(blocks, 4, 32, np.arange(-0.9, 0.91, 0.1))
    code = (q + 4).astype(np.uint8)
    hmask = _pack_fields((code >> 2).reshape(n, 8, 32), 1)
    qs = _pack_fields((code & 3).reshape(n, 2, 4, 32), 2).reshape(n, 64)
    stored = (scales + 32).astype(np.uint8)  # 0..63
    low = _pack_fields((stored & 15).reshape(n, 2, 8), 4)
    high = _pack_fields((stored >> 4).reshape(n, 4, 4), 2)
    return np.concatenate([hmask, qs, low, high, _f16_bytes(d)], axis=-1)


def _encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: ql[128], qh[64], scales[16] (int8), d. Code ``q + 32`` of value ``128 h +
    32 j + l`` keeps its low nibble in ``ql[64 h + 32 (j % 2) + l]`` (nibble ``j // 2``)
    and its top two bits in bits ``2j`` of ``qh[32 h + l]``."""
    n = blocks.shape[0]
    d, scales, q = _symmetric_k(blocks, 32, 128, np.arange(-3, 3.01, 0.25))
    code = (q.astype(np.int16) + 32).astype(np.uint8).reshape(n, 2, 4, 32)
    ql = _pack_fields((code & 15).reshape(n, 2, 2, 64), 4).reshape(n, 128)
    qh = _pack_fields(code >> 4, 2).reshape(n, 64)
    return np.concatenate([ql, qh, scales.view(np.uint8), _f16_bytes(d)], axis=-1)


# -- IQ4_NL -----------------------------------------------------------------------------------

_IQ4_VALUES = np.array(IQ4_NL_VALUES, np.float32)
_IQ4_MIDPOINTS = (_IQ4_VALUES[1:] + _IQ4_VALUES[:-1]) / 2


def _nearest_iq4(t: np.ndarray) -> np.ndarray:
    """Index of the table entry nearest each of ``t``."""
    return np.searchsorted(_IQ4_MIDPOINTS, t).astype(np.uint8)


def _encode_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL: d, qs[16] (codes as Q4_0's: value i in the low nibble of byte i, value
    16 + i in the high one); a value is ``d * IQ4_NL_VALUES[code]``.

    ``d`` maps the block's value of largest magnitude onto the table's long end, -127,
    so that value is kept (to f16 precision). Candidate ``d``s refined by least squares
    lower the RMS error a little (7.5% against 8.0% on normal weights) by clipping that
    value, and raised a re-encoded SmolLM2's perplexity markedly (+100 to +125%
    against +75 to +80%, all its matrices in IQ4_NL, over a few runs)."""
    n = blocks.shape[0]
    d = (_peak(blocks) / _IQ4_VALUES[0]).astype(np.float16)
    codes = _nearest_iq4(_divide(blocks, d.astype(np.float32)[:, None]))
    return np.concatenate([_f16_bytes(d), _pack_fields(codes.reshape(n, 2, 16), 4)], axis=-1)


# -- entry points -----------------------------------------------------------------------------

_ENCODERS = {
    "Q2_K": (256, _encode_q2_k),
    "Q3_K": (256, _encode_q3_k),
    "Q4_K": (256, _encode_q4_k),
    "Q5_K": (256, _encode_q5_k),
    "Q6_K": (256, _encode_q6_k),
    "IQ4_NL": (32, _encode_iq4_nl),
}


def gguf_encodings() -> tuple[str, ...]:
    """The GGML type names :func:`quantize_gguf` writes."""
    return tuple(sorted(_GGUF_PACKAGE + tuple(_ENCODERS)))


def quantize_gguf(weight: torch.Tensor | np.ndarray, encoding: str) -> np.ndarray:
    """``weight`` (float ``[rows, columns]``) in the GGML type ``encoding``, as ``uint8
    [rows, row bytes]``. ``ValueError`` for another type, a weight that is not a finite
    matrix, or a column count that is not a multiple of the type's block."""
    if encoding not in gguf_encodings():
        raise ValueError(f"quantize_gguf writes {', '.join(gguf_encodings())}, not {encoding!r}")
    if isinstance(weight, torch.Tensor):
        weight = weight.detach().cpu().float().numpy()
    x = np.ascontiguousarray(weight, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize_gguf({encoding}) takes a [rows, columns] weight, got shape {x.shape}")
    rows, columns = x.shape
    size = encodings.row_bytes(encoding, columns)  # raises for a partial block
    if not np.isfinite(x).all():
        raise ValueError(f"quantize_gguf({encoding}): the weight holds inf or NaN")
    if x.size == 0:
        return np.zeros((rows, size), np.uint8)
    if encoding in _GGUF_PACKAGE:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import quantize

        return np.ascontiguousarray(quantize(x, GGMLQuantizationType[encoding]))
    block, encode = _ENCODERS[encoding]
    blocks = x.reshape(-1, block)
    step = max(1, _CHUNK // block)
    with np.errstate(over="ignore"):  # steps beyond f16's range become inf, as in ggml
        parts = [encode(blocks[i : i + step]) for i in range(0, len(blocks), step)]
    return np.concatenate(parts).reshape(rows, size)

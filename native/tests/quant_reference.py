"""What test_quant.py and test_kquants.py share: the block layouts of the GGUF
encodings, random packed weights, the references ``dequantize`` is held to (the
``gguf`` package; numpy for I8/I4), and the float32 rounding bound ``quantized_linear``
is held to.

A plain module, not collected: the tests import it as ``native.tests.quant_reference``
(the repository root is on the path, ``pythonpath = ["."]`` in pyproject.toml), as the
tests in tests/ import ``tests.tiny_models``.
"""

from __future__ import annotations

import numpy as np
import pytest

from pyagent_native import _core

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

# Every build of the kernels this CPU runs (portable, AVX2, AVX-512), each tested by name.
ISAS = tuple(_core.available_isas())
# encoding -> (elements per block, bytes per block, offsets of its f16 fields)
GGUF_LAYOUT = {
    "Q8_0": (32, 34, (0,)),
    "Q4_0": (32, 18, (0,)),
    "Q4_1": (32, 20, (0, 2)),
    "Q6_K": (256, 210, (208,)),
    "Q5_0": (32, 22, (0,)),
    "Q5_1": (32, 24, (0, 2)),
    "IQ4_NL": (32, 18, (0,)),
    "Q2_K": (256, 84, (80, 82)),
    "Q3_K": (256, 110, (108,)),
    "Q4_K": (256, 144, (0, 2)),
    "Q5_K": (256, 176, (0, 2)),
}
GGUF = tuple(GGUF_LAYOUT)


def _halves(rng, shape, scale=0.01):
    """Finite random halves (as uint8 pairs) of about weight-scale size."""
    return (rng.standard_normal(shape) * scale).astype(np.float16).view(np.uint8).reshape(*shape[:-1], -1)


def random_weight(encoding, n, k, group, rng):
    """uint8 [n, row bytes]: random codes (and packed scale bytes), finite random f16
    fields (scales, offsets, minimums); I8's f32 scale likewise."""
    row_bytes = _core.quant_row_bytes(encoding, k, group)
    data = rng.integers(0, 256, (n, row_bytes), dtype=np.uint8)
    if encoding == "I8":
        data[:, :4] = (rng.standard_normal((n, 1)) * 0.01).astype(np.float32).view(np.uint8)
        return data
    if encoding == "I4":
        block, size, fields = group, 4 + group // 2, (0, 2)
    else:
        block, size, fields = GGUF_LAYOUT[encoding]
    blocks = data.reshape(n, -1, size)
    for offset in fields:
        blocks[:, :, offset : offset + 2] = _halves(rng, (n, blocks.shape[1], 1))
    return data


def reference_i8(data, k):
    scale = data[:, :4].copy().view(np.float32)  # [n, 1]
    return scale * data[:, 4 : 4 + k].view(np.int8).astype(np.float32)


def reference_i4(data, k, group):
    n = data.shape[0]
    blocks = data.reshape(n, -1, 4 + group // 2)
    d = blocks[:, :, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, :, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, :, 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
    return (d * q + m).reshape(n, -1)[:, :k]  # float32 ops, separately rounded, as in gguf


def reference_dequantize(data, encoding, k, group=0):
    if encoding == "I8":
        return reference_i8(data, k)
    if encoding == "I4":
        return reference_i4(data, k, group)
    return gguf_quants.dequantize(data, getattr(GGMLQuantizationType, encoding))


def dequantize(data, encoding, k, group=0, isa="auto", threads=1):
    out = np.empty((data.shape[0], k), np.float32)
    _core.dequantize(out, data, encoding, group, threads, isa)
    return out


def assert_bits_equal(got, want):
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, f"{diff.size} of {got.size} differ, first at {np.unravel_index(diff[0], got.shape)}"


# ----------------------------------------------------------------------- quantized_linear


def _half(blocks, offset):
    """[n, blocks] float64: the f16 field at `offset` of every block."""
    return blocks[:, :, offset : offset + 2].copy().view(np.float16).astype(np.float64)[:, :, 0]


def offsets(data, encoding, k, group=0):
    """Per element, the float64 offset a fused kernel splits off and multiplies with a
    sum of x: m (Q4_1, I4, Q5_1), -8d (Q4_0), -dmin * min (Q2_K, Q4_K, Q5_K); none for
    the others, whose kernels scale plain sums of (signed) code * x."""
    n = data.shape[0]
    if encoding in ("Q4_0", "Q4_1", "Q5_1", "I4"):
        block, size, _ = (group, 4 + group // 2, None) if encoding == "I4" else GGUF_LAYOUT[encoding]
        blocks = data.reshape(n, -1, size)
        value = -8.0 * _half(blocks, 0) if encoding == "Q4_0" else _half(blocks, 2)
        return np.repeat(value, block, axis=1)[:, :k]
    if encoding == "Q2_K":
        blocks = data.reshape(n, -1, GGUF_LAYOUT[encoding][1])
        mins = (blocks[:, :, :16] >> 4).astype(np.float64)  # [n, blocks, 16]
        value = _half(blocks, 82)[:, :, None] * mins
        return -np.repeat(value.reshape(n, -1), 16, axis=1)
    if encoding in ("Q4_K", "Q5_K"):
        blocks = data.reshape(n, -1, GGUF_LAYOUT[encoding][1])
        _, mins = gguf_quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, :, 4:16]).reshape(-1, 12))
        value = _half(blocks, 2)[:, :, None] * mins.reshape(n, -1, 8).astype(np.float64)
        return -np.repeat(value.reshape(n, -1), 32, axis=1)
    return None


def tolerance(x, w, offsets, bias, k):
    """Worst-case error of float32 sums (gamma_n = n * 2^-24 times the sum of the terms'
    magnitudes) with n the longest chain of roundings any kernel here takes: K/8 lanes'
    worth of accumulation plus a few dozen for block sums, folds, horizontal sums, the
    bias and the weight's own rounding. The terms are |x_k| * |w_k|, except where the
    kernel splits w into (w - offset) + offset and sums the parts apart."""
    terms = np.abs(w) if offsets is None else np.abs(w - offsets) + np.abs(offsets)
    magnitude = np.abs(x) @ terms.T
    if bias is not None:
        magnitude = magnitude + np.abs(bias)
    return (k / 8 + 32) * 2.0**-24 * magnitude


def check_linear(data, encoding, group, x, bias, threads, isa):
    """``quantized_linear`` against ``x @ w.T + bias`` in float64, w the reference's
    dequantized weight (== ``_core.dequantize``, tested bit for bit in test_quant.py),
    within :func:`tolerance`. Returns the kernel's output."""
    m, k = x.shape
    n = data.shape[0]
    w = reference_dequantize(data, encoding, k, group).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    if bias is not None:
        want = want + bias
    out = np.full((m, n), np.nan, np.float32)
    _core.quantized_linear(out, x, data, encoding, group, bias, threads, isa)
    err = np.abs(out - want)
    tol = tolerance(x.astype(np.float64), w, offsets(data, encoding, k, group), bias, k)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert np.all(err <= tol), f"{encoding} M={m} N={n} K={k}: error {err[worst]:.3g} > {tol[worst]:.3g} at {worst}"
    return out


# The largest rounded |x| of each integer activation (``_core.quantized_linear``'s
# ``activations``): int8, and int16's 255 * 127 + 127 (q = 255 hi + lo, two int8 rows).
LEVELS = {"int8": 127, "int16": 32512}


def round_x(x, activations="int8"):
    """x [M, K] rounded per block of 32 as the kernels do it, in float32:
    d = max|x_b| / LEVELS[activations], q = round-half-even(x * (1 / d)). Returns
    (q int64 [M, K], d float64 [M, K / 32])."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // 32, 32)
    d = (np.abs(blocks).max(axis=2) / np.float32(LEVELS[activations])).astype(np.float32)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d > 0)
    q = np.rint((blocks * inv[:, :, None]).astype(np.float32)).astype(np.int64)
    return q.reshape(m, k), d.astype(np.float64)


def int8_reference(x, data, encoding, activations="int8"):
    """The integer-activation product of Q4_0 / Q4_1 / Q8_0 in float64: per block b,
    (d_w * d_x) * sum(code * q_x), exact in integers, plus the block's offset (Q4_1's m,
    Q4_0's -8 d) times d_x * sum(q_x): the dequantized weight times the dequantized x.
    Returns (value [M, N], and the sum of the terms' magnitudes, the scale of float32
    accumulation error)."""
    m, k = x.shape
    n = data.shape[0]
    blocks = data.reshape(n, k // 32, GGUF_LAYOUT[encoding][1])
    d = _half(blocks, 0)
    if encoding == "Q8_0":
        codes, offset = blocks[:, :, 2:34].view(np.int8).astype(np.int64), np.zeros_like(d)
    else:
        qs = blocks[:, :, 4:20] if encoding == "Q4_1" else blocks[:, :, 2:18]
        codes = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.int64)
        offset = _half(blocks, 2) if encoding == "Q4_1" else -8.0 * d
    q, dx = round_x(x, activations)
    dots = np.einsum("mbk,nbk->mnb", q.reshape(m, k // 32, 32), codes)  # exact integers
    halves = q.reshape(m, k // 32, 2, 16).sum(axis=3) * dx[:, :, None]  # exact integer sums, times d_x
    scaled = dots * d[None] * dx[:, None, :]
    offsets_term = offset[None] * halves.sum(axis=2)[:, None, :]
    # the kernels round d_x times each half's sum before adding the two, so the offset
    # term's rounding scales with both halves (they may cancel)
    offsets_size = np.abs(offset[None]) * np.abs(halves).sum(axis=2)[:, None, :]
    # and the one-row kernels keep a block's integer sums in eight lanes, each
    # converted and scaled, added at the end: the scale of their rounding is the sum
    # of |code * q|, not the block's total
    scaled_size = np.einsum("mbk,nbk->mnb", np.abs(q).reshape(m, k // 32, 32), np.abs(codes)) * np.abs(d[None]) * dx[:, None, :]
    return (scaled + offsets_term).sum(axis=2), (scaled_size + offsets_size).sum(axis=2)


# Encodings the AVX-512 build's integer GEMM reads (``_core.int8_gemm``).
INT8_GEMM = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K")


def int8_unit_offsets(data, encoding, k):
    """Per element, |o| where the integer GEMM reads w = s * u + o with unsigned codes u
    and takes o times a sum of the rounded x in float32 (zero where it corrects for o
    in integers: Q8_0, IQ4_NL)."""
    n = data.shape[0]
    if encoding in ("Q8_0", "IQ4_NL"):
        return np.zeros((n, k))
    if encoding == "Q5_0":
        blocks = data.reshape(n, -1, GGUF_LAYOUT[encoding][1])
        return np.repeat(16.0 * np.abs(_half(blocks, 0)), 32, axis=1)
    if encoding == "Q6_K":
        blocks = data.reshape(n, -1, GGUF_LAYOUT[encoding][1])
        scales = blocks[:, :, 192:208].view(np.int8).astype(np.float64) * _half(blocks, 208)[:, :, None]
        return np.repeat(32.0 * np.abs(scales.reshape(n, -1)), 16, axis=1)
    return np.abs(offsets(data, encoding, k))


def int8_gemm_reference(x, data, encoding, activations="int8"):
    """The integer GEMM's product in float64: the reference's dequantized weight times x
    rounded per block of 32 (``round_x``). Returns (value, and the magnitude sum
    (|w| + |o|) |x8| that scales its float32 rounding)."""
    m, k = x.shape
    q, dx = round_x(x, activations)
    x8 = (q.reshape(m, k // 32, 32) * dx[:, :, None]).reshape(m, k)
    w = reference_dequantize(data, encoding, k).astype(np.float64)
    size = np.abs(w) + int8_unit_offsets(data, encoding, k)
    return x8 @ w.T, np.abs(x8) @ size.T

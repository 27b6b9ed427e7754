"""The GGUF encodings Q5_0, Q5_1, IQ4_NL and the K-quants Q2_K, Q3_K, Q4_K, Q5_K
against their references (test_quant.py covers Q8_0, Q4_0, Q4_1, Q6_K, I8 and I4).

- ``dequantize`` equals the ``gguf`` package's ``gguf.quants.dequantize`` bit for bit,
  in the portable build and the best one, on random bytes with finite half scales.
- ``quantized_linear`` equals ``x @ dequantize(data).T + bias`` computed in float64,
  within the worst-case rounding bound of float32 summation (as in test_quant.py): one
  row of x (the fused kernels of the AVX2 build) and 2-9 rows (the dequantized tile),
  one or two threads, with and without bias, N any count and K any multiple of the
  block up to 2048.
- A wrong K or row size is a ValueError naming the encoding.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyagent_native import _core

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

ISAS = sorted({"generic", _core.best_isa()})
# encoding -> (elements per block, bytes per block, offsets of its f16 fields)
LAYOUT = {
    "Q5_0": (32, 22, (0,)),
    "Q5_1": (32, 24, (0, 2)),
    "IQ4_NL": (32, 18, (0,)),
    "Q2_K": (256, 84, (80, 82)),
    "Q3_K": (256, 110, (108,)),
    "Q4_K": (256, 144, (0, 2)),
    "Q5_K": (256, 176, (0, 2)),
}
ENCODINGS = tuple(LAYOUT)


def random_weight(encoding, n, k, rng):
    """uint8 [n, row bytes]: random codes and scale bytes, finite random f16 fields."""
    block, size, fields = LAYOUT[encoding]
    data = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
    blocks = data.reshape(n, -1, size)
    for offset in fields:
        halves = (rng.standard_normal((n, blocks.shape[1], 1)) * 0.01).astype(np.float16)
        blocks[:, :, offset : offset + 2] = halves.view(np.uint8)
    return data


def reference_dequantize(data, encoding):
    return gguf_quants.dequantize(data, getattr(GGMLQuantizationType, encoding))


def dequantize(data, encoding, k, isa="auto", threads=1):
    out = np.empty((data.shape[0], k), np.float32)
    _core.dequantize(out, data, encoding, 0, threads, isa)
    return out


def assert_bits_equal(got, want):
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, f"{diff.size} of {got.size} differ, first at {np.unravel_index(diff[0], got.shape)}"


def _half(blocks, offset):
    """[n, blocks] float64: the f16 field at `offset` of every block."""
    return blocks[:, :, offset : offset + 2].copy().view(np.float16).astype(np.float64)[:, :, 0]


# ----------------------------------------------------------------------------- dequantize


def test_row_bytes():
    for encoding, (block, size, _) in LAYOUT.items():
        assert _core.quant_row_bytes(encoding, block) == size
        assert _core.quant_row_bytes(encoding, 8 * block) == 8 * size
    assert _core.quant_row_bytes("Q4_K", 4096) == 16 * 144
    assert _core.quant_row_bytes("Q5_0", 576) == 18 * 22


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("n, blocks", [(1, 1), (3, 2), (17, 3), (40, 5)])
def test_dequantize_is_bit_exact(encoding, n, blocks, isa):
    rng = np.random.default_rng(1000 * n + 10 * blocks + ENCODINGS.index(encoding))
    k = LAYOUT[encoding][0] * blocks
    data = random_weight(encoding, n, k, rng)
    want = reference_dequantize(data, encoding)
    assert_bits_equal(dequantize(data, encoding, k, isa=isa), want)
    assert_bits_equal(dequantize(data, encoding, k, isa=isa, threads=2), want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_dequantize_special_halves(encoding, isa):
    """Zeros, subnormals, the extremes of the half range in every f16 field (d, and m
    or dmin), the codes and packed scales random."""
    special = np.array(
        [0.0, -0.0, 2.0**-24, -(2.0**-24), 1023 * 2.0**-24, 2.0**-14, 1.0, -1.5, 65504.0, -65504.0, 3.1e-5],
        dtype=np.float16,
    )
    rng = np.random.default_rng(7)
    block, size, fields = LAYOUT[encoding]
    n = len(special) * len(special)
    data = rng.integers(0, 256, (n, size), dtype=np.uint8)
    pairs = np.stack(np.meshgrid(special, special, indexing="ij"), axis=-1).reshape(n, 2)
    for i, offset in enumerate(fields):
        data[:, offset : offset + 2] = np.ascontiguousarray(pairs[:, i : i + 1]).view(np.uint8)
    assert_bits_equal(dequantize(data, encoding, block, isa=isa), reference_dequantize(data, encoding))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("encoding", ["Q3_K", "Q4_K", "Q5_K"])
def test_every_packed_scale_byte(encoding, isa):
    """Each of the 12 packed scale bytes of Q3_K / Q4_K / Q5_K takes all 256 values
    (the others zero, then 0xff): every bit of every six-bit scale and min is placed."""
    block, size, fields = LAYOUT[encoding]
    start = 96 if encoding == "Q3_K" else 4
    rng = np.random.default_rng(11)
    rows = []
    for fill in (0x00, 0xFF):
        for byte in range(12):
            data = rng.integers(0, 256, (256, size), dtype=np.uint8)
            data[:, start : start + 12] = fill
            data[:, start + byte] = np.arange(256)
            for offset in fields:
                data[:, offset : offset + 2] = np.float16(0.5 + offset).reshape(1, 1).view(np.uint8)
            rows.append(data)
    data = np.concatenate(rows)
    assert_bits_equal(dequantize(data, encoding, block, isa=isa), reference_dequantize(data, encoding))


# ----------------------------------------------------------------------- quantized_linear


def _offsets(data, encoding, k):
    """Per element, the float64 offset a fused kernel splits off and multiplies with a
    sum of x: m (Q5_1), -dmin * min (Q2_K, Q4_K, Q5_K); none for the others, whose
    kernels scale plain sums of (signed) code * x."""
    n = data.shape[0]
    block, size, _ = LAYOUT[encoding]
    blocks = data.reshape(n, -1, size)
    if encoding == "Q5_1":
        return np.repeat(_half(blocks, 2), 32, axis=1)
    if encoding == "Q2_K":
        mins = (blocks[:, :, :16] >> 4).astype(np.float64)  # [n, blocks, 16]
        value = _half(blocks, 82)[:, :, None] * mins
        return -np.repeat(value.reshape(n, -1), 16, axis=1)
    if encoding in ("Q4_K", "Q5_K"):
        _, mins = gguf_quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, :, 4:16]).reshape(-1, 12))
        value = _half(blocks, 2)[:, :, None] * mins.reshape(n, -1, 8).astype(np.float64)
        return -np.repeat(value.reshape(n, -1), 32, axis=1)
    return None


def _tolerance(x, w, offsets, bias, k):
    """test_quant.py's bound: gamma_n = n * 2^-24 times the sum of the terms'
    magnitudes, n = K/8 + 32 roundings; the terms are |x_k| * |w_k|, except where the
    kernel splits w into (w - offset) + offset and sums the parts apart."""
    terms = np.abs(w) if offsets is None else np.abs(w - offsets) + np.abs(offsets)
    magnitude = np.abs(x) @ terms.T
    if bias is not None:
        magnitude = magnitude + np.abs(bias)
    return (k / 8 + 32) * 2.0**-24 * magnitude


def _check_linear(data, encoding, x, bias, threads, isa):
    m, k = x.shape
    n = data.shape[0]
    w = reference_dequantize(data, encoding).astype(np.float64)  # == _core.dequantize, tested above
    want = x.astype(np.float64) @ w.T
    if bias is not None:
        want = want + bias
    out = np.full((m, n), np.nan, np.float32)
    _core.quantized_linear(out, x, data, encoding, 0, bias, threads, isa)
    err = np.abs(out - want)
    tol = _tolerance(x.astype(np.float64), w, _offsets(data, encoding, k), bias, k)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert np.all(err <= tol), f"{encoding} M={m} N={n} K={k}: error {err[worst]:.3g} > {tol[worst]:.3g} at {worst}"
    return out


@st.composite
def encoding_and_k(draw):
    encoding = draw(st.sampled_from(ENCODINGS))
    block = LAYOUT[encoding][0]
    return encoding, block * draw(st.integers(1, 2048 // block))


@settings(max_examples=400, deadline=None)
@given(
    case=encoding_and_k(),
    m=st.one_of(st.just(1), st.integers(2, 9)),
    n=st.integers(1, 160),
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    isa=st.sampled_from(ISAS),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantized_linear_matches_dequantize_then_matmul(case, m, n, bias, threads, isa, seed):
    encoding, k = case
    rng = np.random.default_rng(seed)
    data = random_weight(encoding, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    _check_linear(data, encoding, x, b, threads, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_model_shapes(encoding, isa):
    """SmolLM2-135M's shapes where K allows (K = 576 is no multiple of 256), 257 rows
    (not a multiple of four) and two threads."""
    rng = np.random.default_rng(ENCODINGS.index(encoding))
    shapes = [(576, 1536), (257, 512)] + ([(1536, 576)] if LAYOUT[encoding][0] == 32 else [])
    for n, k in shapes:
        data = random_weight(encoding, n, k, rng)
        for m in (1, 4):
            _check_linear(data, encoding, rng.standard_normal((m, k)).astype(np.float32), None, 2, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_memory_past_x_is_never_used(encoding, isa):
    """One row of x sits in a buffer whose next floats are NaN: the results stay
    finite (and within the bound)."""
    rng = np.random.default_rng(5)
    k = LAYOUT[encoding][0] * 2
    data = random_weight(encoding, 9, k, rng)
    buffer = np.full(k + 64, np.nan, np.float32)
    buffer[:k] = rng.standard_normal(k)
    out = _check_linear(data, encoding, buffer[:k].reshape(1, k), None, 1, isa)
    assert np.isfinite(out).all()


def test_the_builds_agree_closely():
    """The fused one-row kernels (AVX2 build) and the portable build's tiles differ only
    by summation order."""
    if _core.best_isa() == "generic":
        pytest.skip("no AVX2 build on this CPU")
    rng = np.random.default_rng(9)
    for encoding in ENCODINGS:
        k = 1024
        data = random_weight(encoding, 64, k, rng)
        x = rng.standard_normal((1, k)).astype(np.float32)
        outs = []
        for isa in ("generic", "avx2"):
            out = np.empty((1, 64), np.float32)
            _core.quantized_linear(out, x, data, encoding, 0, None, 1, isa)
            outs.append(out)
        w = reference_dequantize(data, encoding).astype(np.float64)
        tol = _tolerance(x.astype(np.float64), w, _offsets(data, encoding, k), None, k)
        assert np.all(np.abs(outs[0] - outs[1]) <= 2 * tol), encoding


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_bad_k_or_row_bytes_name_the_encoding(encoding):
    block, size, _ = LAYOUT[encoding]
    rng = np.random.default_rng(0)
    k = 2 * block
    data = random_weight(encoding, 4, k, rng)
    x = rng.standard_normal((1, k)).astype(np.float32)
    out = np.empty((1, 4), np.float32)
    with pytest.raises(ValueError, match=rf"data\.shape\[1\] is {2 * size - 1}, expected {2 * size} \(bytes per row of {encoding} with K = {k}\)"):
        _core.quantized_linear(out, x, np.ascontiguousarray(data[:, :-1]), encoding)
    with pytest.raises(ValueError, match=rf"data\.shape\[1\] is {2 * size}, expected {size} \(bytes per row of {encoding} with K = {block}\)"):
        _core.dequantize(np.empty((4, block), np.float32), data, encoding)
    bad_k = k + 16
    with pytest.raises(ValueError, match=rf"{encoding} needs K \(input features\) to be a multiple of {block}, got {bad_k}"):
        _core.quantized_linear(out, rng.standard_normal((1, bad_k)).astype(np.float32), data, encoding)
    with pytest.raises(ValueError, match=rf"{encoding} needs K \(input features\) to be a multiple of {block}, got {bad_k}"):
        _core.quant_row_bytes(encoding, bad_k)
    with pytest.raises(ValueError, match=rf"group: only I4 takes a group, got 32 for {encoding}"):
        _core.quantized_linear(out, x, data, encoding, 32)


def test_unknown_encoding_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"encoding: unknown 'Q4_K_M' \(expected 'Q8_0', .*'Q5_0', 'Q5_1', 'IQ4_NL', "
                                         r"'Q2_K', 'Q3_K', 'Q4_K', 'Q5_K', 'Q6_K', 'I8' or 'I4'\)"):
        _core.quant_row_bytes("Q4_K_M", 256)

"""The GGUF encodings Q5_0, Q5_1, IQ4_NL and the K-quants Q2_K, Q3_K, Q4_K, Q5_K
against their references (test_quant.py covers Q8_0, Q4_0, Q4_1, Q6_K, I8 and I4, and
the bit-exact ``dequantize`` of every GGUF encoding, these included: random blocks and
special halves; the layouts, references and bounds are quant_reference.py's).

- ``dequantize`` equals the ``gguf`` package's ``gguf.quants.dequantize`` bit for bit
  whatever the packed scale bytes of Q3_K, Q4_K and Q5_K hold, in the portable build
  and the best one.
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
from native.tests.quant_reference import (
    GGUF_LAYOUT,
    ISAS,
    assert_bits_equal,
    check_linear,
    dequantize,
    offsets,
    random_weight,
    reference_dequantize,
    tolerance,
)

ENCODINGS = ("Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K")
LAYOUT = {encoding: GGUF_LAYOUT[encoding] for encoding in ENCODINGS}


# ----------------------------------------------------------------------------- dequantize


def test_row_bytes():
    for encoding, (block, size, _) in LAYOUT.items():
        assert _core.quant_row_bytes(encoding, block) == size
        assert _core.quant_row_bytes(encoding, 8 * block) == 8 * size
    assert _core.quant_row_bytes("Q4_K", 4096) == 16 * 144
    assert _core.quant_row_bytes("Q5_0", 576) == 18 * 22


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
    assert_bits_equal(dequantize(data, encoding, block, isa=isa), reference_dequantize(data, encoding, block))


# ----------------------------------------------------------------------- quantized_linear


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
    data = random_weight(encoding, n, k, 0, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    check_linear(data, encoding, 0, x, b, threads, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_model_shapes(encoding, isa):
    """SmolLM2-135M's shapes where K allows (K = 576 is no multiple of 256), 257 rows
    (not a multiple of four) and two threads."""
    rng = np.random.default_rng(ENCODINGS.index(encoding))
    shapes = [(576, 1536), (257, 512)] + ([(1536, 576)] if LAYOUT[encoding][0] == 32 else [])
    for n, k in shapes:
        data = random_weight(encoding, n, k, 0, rng)
        for m in (1, 4):
            check_linear(data, encoding, 0, rng.standard_normal((m, k)).astype(np.float32), None, 2, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_memory_past_x_is_never_used(encoding, isa):
    """One row of x sits in a buffer whose next floats are NaN: the results stay
    finite (and within the bound)."""
    rng = np.random.default_rng(5)
    k = LAYOUT[encoding][0] * 2
    data = random_weight(encoding, 9, k, 0, rng)
    buffer = np.full(k + 64, np.nan, np.float32)
    buffer[:k] = rng.standard_normal(k)
    out = check_linear(data, encoding, 0, buffer[:k].reshape(1, k), None, 1, isa)
    assert np.isfinite(out).all()


def test_the_builds_agree_closely():
    """The fused one-row kernels (AVX2 and AVX-512 builds) and the portable build's tiles
    differ only by summation order."""
    if "avx2" not in ISAS:
        pytest.skip("no AVX2 build on this CPU")
    rng = np.random.default_rng(9)
    for encoding in ENCODINGS:
        k = 1024
        data = random_weight(encoding, 64, k, 0, rng)
        x = rng.standard_normal((1, k)).astype(np.float32)
        outs = []
        for isa in ISAS:
            out = np.empty((1, 64), np.float32)
            _core.quantized_linear(out, x, data, encoding, 0, None, 1, isa)
            outs.append(out)
        w = reference_dequantize(data, encoding, k).astype(np.float64)
        tol = tolerance(x.astype(np.float64), w, offsets(data, encoding, k), None, k)
        for out in outs[1:]:
            assert np.all(np.abs(outs[0] - out) <= 2 * tol), encoding


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_bad_k_or_row_bytes_name_the_encoding(encoding):
    block, size, _ = LAYOUT[encoding]
    rng = np.random.default_rng(0)
    k = 2 * block
    data = random_weight(encoding, 4, k, 0, rng)
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

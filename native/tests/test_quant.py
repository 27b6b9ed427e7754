"""The quantized-weight kernels against their references.

- ``dequantize`` of every GGUF encoding (Q8_0, Q4_0, Q4_1, Q6_K, and test_kquants.py's
  Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K) equals the ``gguf`` package's
  ``gguf.quants.dequantize`` bit for bit, special halves in every f16 field included;
  of ours (I8, I4 with groups of 32, 64 and 128, any K) a numpy reference, bit for bit
  too (the references and layouts: quant_reference.py, shared with test_kquants.py).
- ``quantized_linear`` of Q8_0, Q4_0, Q4_1, Q6_K, I8 and I4 equals
  ``x @ dequantize(data).T + bias`` computed in float64, within the worst-case rounding
  bound of float32 summation (see ``quant_reference.tolerance``), over random shapes,
  both instruction-set builds and one or two threads.
- The padding of I4's last group and whatever follows x in memory are never used.
- Bad arguments are ValueErrors that name the problem.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyagent_native import _core
from native.tests.quant_reference import (
    GGUF,
    GGUF_LAYOUT,
    ISAS,
    assert_bits_equal,
    check_linear,
    INT8_GEMM,
    LEVELS,
    dequantize,
    int8_gemm_reference,
    int8_reference,
    random_weight,
    reference_dequantize,
)


# ----------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("encoding", GGUF)
@pytest.mark.parametrize("n, blocks", [(1, 1), (3, 2), (17, 3), (64, 6)])
def test_gguf_dequantize_is_bit_exact(encoding, n, blocks, isa):
    rng = np.random.default_rng(1000 * n + 10 * blocks + GGUF.index(encoding))
    k = GGUF_LAYOUT[encoding][0] * blocks
    data = random_weight(encoding, n, k, 0, rng)
    want = reference_dequantize(data, encoding, k)
    assert_bits_equal(dequantize(data, encoding, k, isa=isa), want)
    assert_bits_equal(dequantize(data, encoding, k, isa=isa, threads=2), want)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("encoding", GGUF)
def test_gguf_dequantize_special_halves(encoding, isa):
    """Zeros, subnormals, the extremes of the half range in every f16 field (d, and m
    or dmin), the codes and packed scales random: the portable build converts halves
    with integer operations, the AVX2 one with F16C; both must be exact."""
    special = np.array(
        [0.0, -0.0, 2.0**-24, -(2.0**-24), 1023 * 2.0**-24, 2.0**-14, 1.0, -1.5, 65504.0, -65504.0, 3.1e-5],
        dtype=np.float16,
    )
    rng = np.random.default_rng(7)
    block, size, fields = GGUF_LAYOUT[encoding]
    n = len(special) * len(special)
    data = rng.integers(0, 256, (n, size), dtype=np.uint8)
    pairs = np.stack(np.meshgrid(special, special, indexing="ij"), axis=-1).reshape(n, 2)
    for i, offset in enumerate(fields):
        data[:, offset : offset + 2] = np.ascontiguousarray(pairs[:, i : i + 1]).view(np.uint8)
    assert_bits_equal(dequantize(data, encoding, block, isa=isa), reference_dequantize(data, encoding, block))


@settings(max_examples=60, deadline=None)
@given(
    encoding_group=st.sampled_from([("I8", 0), ("I4", 32), ("I4", 64), ("I4", 128)]),
    n=st.integers(1, 20),
    k=st.integers(1, 300),
    isa=st.sampled_from(ISAS),
    seed=st.integers(0, 2**31 - 1),
)
def test_our_encodings_dequantize_exactly(encoding_group, n, k, isa, seed):
    encoding, group = encoding_group
    data = random_weight(encoding, n, k, group, np.random.default_rng(seed))
    assert_bits_equal(dequantize(data, encoding, k, group, isa=isa), reference_dequantize(data, encoding, k, group))


def test_quant_row_bytes():
    assert _core.quant_row_bytes("Q8_0", 64) == 68
    assert _core.quant_row_bytes("Q4_0", 64) == 36
    assert _core.quant_row_bytes("Q4_1", 64) == 40
    assert _core.quant_row_bytes("Q6_K", 512) == 420
    assert _core.quant_row_bytes("I8", 5) == 9
    assert _core.quant_row_bytes("I4", 32, 32) == _core.quant_row_bytes("Q4_1", 32)
    assert _core.quant_row_bytes("I4", 65, 64) == 2 * 36  # last group stored whole
    assert _core.quant_row_bytes("I4", 128, 128) == 68


# ----------------------------------------------------------------------- quantized_linear


@st.composite
def linear_cases(draw):
    encoding, group = draw(
        st.sampled_from([("Q8_0", 0), ("Q4_0", 0), ("Q4_1", 0), ("Q6_K", 0), ("I8", 0), ("I4", 32), ("I4", 64), ("I4", 128)])
    )
    if encoding == "Q6_K":
        k = 256 * draw(st.integers(1, 3))
    elif encoding in GGUF:
        k = 32 * draw(st.integers(1, 24))
    else:
        k = draw(st.integers(1, 300))
    return encoding, group, k


@settings(max_examples=150, deadline=None)
@given(
    case=linear_cases(),
    m=st.one_of(st.just(1), st.integers(1, 64)),
    n=st.integers(1, 300),
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    isa=st.sampled_from(ISAS),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantized_linear_matches_dequantize_then_matmul(case, m, n, bias, threads, isa, seed):
    encoding, group, k = case
    rng = np.random.default_rng(seed)
    data = random_weight(encoding, n, k, group, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    check_linear(data, encoding, group, x, b, threads, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("encoding, group", [("Q4_1", 0), ("Q8_0", 0), ("I8", 0), ("I4", 32), ("I4", 128)])
@pytest.mark.parametrize("n, k", [(576, 576), (1536, 576), (576, 1536)])
def test_model_shapes(encoding, group, n, k, isa):
    """SmolLM2-135M's shapes, the builds' agreement with each other included."""
    rng = np.random.default_rng(n + k)
    data = random_weight(encoding, n, k, group, rng)
    for m in (1, 4):
        check_linear(data, encoding, group, rng.standard_normal((m, k)).astype(np.float32), None, 2, isa)


@pytest.mark.parametrize("isa", ISAS)
def test_q6_k_model_shape(isa):
    rng = np.random.default_rng(3)
    data = random_weight("Q6_K", 576, 1536, 0, rng)
    for m in (1, 3):
        check_linear(data, "Q6_K", 0, rng.standard_normal((m, 1536)).astype(np.float32), None, 2, isa)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("encoding, group", [("I8", 0), ("I4", 32), ("I4", 64), ("I4", 128)])
@pytest.mark.parametrize("k", [1, 7, 9, 31, 33, 100, 129, 300])
def test_padding_and_memory_past_x_are_never_used(encoding, group, k, isa):
    """One row of x sits in a buffer whose next floats are NaN, and I4's padding codes
    are changed: the results stay finite and bit-identical."""
    rng = np.random.default_rng(k)
    n = 9
    data = random_weight(encoding, n, k, group, rng)
    buffer = np.full(k + 64, np.nan, np.float32)
    buffer[:k] = rng.standard_normal(k)
    x = buffer[:k].reshape(1, k)
    first = check_linear(data, encoding, group, x, None, 1, isa)
    if encoding == "I4" and k % group:
        size, rest = 4 + group // 2, k % group
        last = data.reshape(n, -1, size)[:, -1, 4:]  # a view: writes go to data
        for j in range(group // 2):
            if j >= rest:
                last[:, j] |= 0x0F  # low nibble: element j of the last group
            if j + group // 2 >= rest:
                last[:, j] |= 0xF0  # high nibble: element j + group/2
        again = check_linear(data, encoding, group, x, None, 1, isa)
        assert_bits_equal(again, first)


# ------------------------------------------------------------------------------ bad input


def _linear_args(encoding="Q4_1", m=2, n=4, k=64, group=0):
    rng = np.random.default_rng(0)
    return (
        np.empty((m, n), np.float32),
        rng.standard_normal((m, k)).astype(np.float32),
        random_weight(encoding, n, k, group, rng),
    )


def test_bad_arguments_name_the_problem():
    out, x, data = _linear_args()
    with pytest.raises(ValueError, match=r"data\.shape\[1\] is 39, expected 40 \(bytes per row of Q4_1 with K = 64\)"):
        _core.quantized_linear(out, x, np.ascontiguousarray(data[:, :39]), "Q4_1")
    with pytest.raises(ValueError, match=r"data\.shape\[1\] is 40, expected 68 \(bytes per row of Q8_0 with K = 64\)"):
        _core.quantized_linear(out, x, data, "Q8_0")
    with pytest.raises(ValueError, match=r"data\.shape\[1\] is 40, expected 36 \(bytes per row of I4 group 64 with K = 64\)"):
        _core.quantized_linear(out, x, data, "I4", 64)
    with pytest.raises(ValueError, match=r"data\.shape\[0\] is 4, expected 5"):
        _core.quantized_linear(np.empty((2, 5), np.float32), x, data, "Q4_1")
    with pytest.raises(ValueError, match="data: expected dtype uint8, got int8"):
        _core.quantized_linear(out, x, data.view(np.int8), "Q4_1")
    with pytest.raises(ValueError, match="x: expected dtype float32, got float64"):
        _core.quantized_linear(out, x.astype(np.float64), data, "Q4_1")
    with pytest.raises(ValueError, match="x: must be C-contiguous"):
        _core.quantized_linear(out, np.asfortranarray(x), data, "Q4_1")
    with pytest.raises(ValueError, match=r"out\.shape\[0\] is 3, expected 2 \(x's rows\)"):
        _core.quantized_linear(np.empty((3, 4), np.float32), x, data, "Q4_1")
    with pytest.raises(ValueError, match=r"bias\.shape\[0\] is 3, expected 4"):
        _core.quantized_linear(out, x, data, "Q4_1", 0, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="Q4_1 needs K \\(input features\\) to be a multiple of 32, got 40"):
        _core.quantized_linear(out, x[:, :40].copy(), data, "Q4_1")
    with pytest.raises(ValueError, match="Q6_K needs K \\(input features\\) to be a multiple of 256, got 64"):
        _core.quantized_linear(out, x, data, "Q6_K")
    with pytest.raises(ValueError, match="encoding: unknown 'IQ2_XXS'"):
        _core.quantized_linear(out, x, data, "IQ2_XXS")
    with pytest.raises(ValueError, match="group: I4 takes 32, 64 or 128, got 16"):
        _core.quantized_linear(out, x, data, "I4", 16)
    with pytest.raises(ValueError, match="group: only I4 takes a group, got 32 for Q4_1"):
        _core.quantized_linear(out, x, data, "Q4_1", 32)
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        _core.quantized_linear(out, x, data, "Q4_1", num_threads=0)
    with pytest.raises(ValueError, match="unknown isa 'sse9'"):
        _core.quantized_linear(out, x, data, "Q4_1", isa="sse9")
    readonly = out.copy()
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="out: must be writable"):
        _core.quantized_linear(readonly, x, data, "Q4_1")


def test_bad_dequantize_arguments():
    _, _, data = _linear_args()
    with pytest.raises(ValueError, match=r"data\.shape\[1\] is 40, expected 20 \(bytes per row of Q4_1 with K = 32\)"):
        _core.dequantize(np.empty((4, 32), np.float32), data, "Q4_1")
    with pytest.raises(ValueError, match=r"data\.shape\[0\] is 4, expected 3 \(out's rows\)"):
        _core.dequantize(np.empty((3, 64), np.float32), data, "Q4_1")
    with pytest.raises(ValueError, match="out: expected dtype float32, got float16"):
        _core.dequantize(np.empty((4, 64), np.float16), data, "Q4_1")
    with pytest.raises(ValueError, match="data: expected 2 dimensions, got 1"):
        _core.dequantize(np.empty((4, 64), np.float32), data.reshape(-1), "Q4_1")
    with pytest.raises(ValueError, match="K \\(input features\\) must be >= 1, got 0"):
        _core.quant_row_bytes("I8", 0)
    with pytest.raises(ValueError, match="encoding: unknown 'q4_1'"):
        _core.quant_row_bytes("q4_1", 32)


# --------------------------------------------------------------------------- integer activations


def _rounding_bound(x, w, activations):
    """|sum w (xr - x)| where xr rounds x per block of 32 (scale max|x_b| / LEVELS):
    each element moves at most half a step, weighted by |w| (the kernels compute
    dequantized w times dequantized xr), plus float32 slack."""
    k = x.shape[1]
    step = np.abs(x.reshape(x.shape[0], k // 32, 32)).max(axis=2) / LEVELS[activations]  # [M, blocks]
    per_block = np.abs(w).reshape(w.shape[0], k // 32, 32).sum(axis=2)  # [N, blocks]
    exact = np.abs(x.astype(np.float64)) @ np.abs(w.T)
    return (step / 2) @ per_block.T * (1 + 1e-3) + 1e-5 * exact + 1e-6


@settings(max_examples=60, deadline=None)
@given(
    activations=st.sampled_from(["int8", "int16"]),
    encoding=st.sampled_from(["Q4_0", "Q4_1", "Q8_0"]),
    m=st.integers(1, 9),
    n=st.integers(1, 70),
    blocks=st.integers(1, 20),
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_integer_activations_stay_within_the_rounding_of_x(activations, encoding, m, n, blocks, bias, threads, seed):
    """Against the exact float64 product: no worse than rounding x per block."""
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    data = random_weight(encoding, n, k, 0, rng)
    w = reference_dequantize(data, encoding, k).astype(np.float64)
    x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 50.0])).astype(np.float32)
    x[0, rng.integers(0, k)] = 0.0
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    out = np.empty((m, n), np.float32)
    _core.quantized_linear(out, x, data, encoding, 0, b, threads, "auto", activations)
    want = x.astype(np.float64) @ w.T + (0 if b is None else b)
    assert (np.abs(out - want) <= _rounding_bound(x, w, activations)).all()


def _takes_integers(isa, encoding, m, activations):
    """Whether `isa`'s build rounds x for this product. int8: the one-row Q4_0/Q4_1
    kernels (AVX2 and AVX-512 builds) and the AVX-512 build's VNNI GEMM for the
    encodings of INT8_GEMM, from two rows of x on (Q4_0/Q4_1/Q8_0) or eight (the rest).
    int16: the AVX-512 GEMM alone, each row of x taking two int8 rows; one row of x
    against Q8_0 stays in float32."""
    rows = 2 * m if activations == "int16" else m
    if activations == "int8" and m == 1:
        return isa in ("avx2", "avx512") and encoding in ("Q4_0", "Q4_1")
    if activations == "int16" and m == 1 and encoding == "Q8_0":
        return False
    if rows < 8 and encoding not in ("Q4_0", "Q4_1", "Q8_0"):  # decoded tiles: from 8 int8 rows on
        return False
    return isa == "avx512" and encoding in INT8_GEMM


def test_int8_gemm_names_its_encodings():
    for isa in ISAS:
        for encoding in GGUF + ("I8",):
            assert _core.int8_gemm(encoding, isa) == (isa == "avx512" and encoding in INT8_GEMM)


@settings(max_examples=200, deadline=None)
@given(
    activations=st.sampled_from(["int8", "int16"]),
    encoding=st.sampled_from(INT8_GEMM),
    m=st.integers(1, 64),
    n=st.integers(1, 70),
    blocks=st.integers(1, 20),
    bias=st.booleans(),
    threads=st.sampled_from([1, 2]),
    isa=st.sampled_from(ISAS),
    seed=st.integers(0, 2**31 - 1),
)
def test_integer_activations_match_the_float64_twin_of_the_same_rounding(
    activations, encoding, m, n, blocks, bias, threads, isa, seed
):
    """With integer activations the kernels compute the dequantized weight times x
    rounded per block of 32 (int8: to 127 levels each side; int16: to 32512, multiplied
    as two int8 rows hi and lo with q = 255 hi + lo). Q4_0/Q4_1/Q8_0 against the integer
    arithmetic itself in float64 (``int8_reference``: per block, (d_w d_x) * the exact
    integer sum, plus the offset times d_x * sum(q)); every GEMM encoding against the
    reference's dequantized weight times the rounded x (``int8_gemm_reference``); both
    exact up to float32 rounding. Cases a build leaves in float32 give the float path's
    bits."""
    rng = np.random.default_rng(seed)
    per_block = GGUF_LAYOUT[encoding][0]
    k = per_block * (blocks if per_block == 32 else 1 + blocks % 4)
    data = random_weight(encoding, n, k, 0, rng)
    x = (rng.standard_normal((m, k)) * rng.choice([1e-3, 1.0, 50.0])).astype(np.float32)
    x[rng.integers(0, m), rng.integers(0, k)] = 0.0
    x[rng.integers(0, m), :32] = 0.0  # an all-zero block: scale 0
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    out = np.full((m, n), np.nan, np.float32)
    _core.quantized_linear(out, x, data, encoding, 0, b, threads, isa, activations)
    if not _takes_integers(isa, encoding, m, activations):
        plain = np.empty_like(out)
        _core.quantized_linear(plain, x, data, encoding, 0, b, threads, isa)
        assert np.array_equal(out.view(np.uint32), plain.view(np.uint32))
        return
    _assert_twins_agree(out, x, data, encoding, activations, b, f"{encoding} {isa} {activations} M={m}")


def _assert_twins_agree(out, x, data, encoding, activations, b, case):
    """out against the float64 twins of the integer arithmetic (see above)."""
    units = x.shape[1] // 32
    twins = [int8_gemm_reference(x, data, encoding, activations)]
    if encoding in ("Q4_0", "Q4_1", "Q8_0"):
        twins.append(int8_reference(x, data, encoding, activations))
    for want, magnitude in twins:
        if b is not None:
            want, magnitude = want + b, magnitude + np.abs(b)
        err = np.abs(out - want)
        tol = (units + 10) * 2.0**-23 * magnitude + 1e-30
        worst = np.unravel_index(np.argmax(err - tol), err.shape)
        assert np.all(err <= tol), f"{case}: error {err[worst]:.3g} > {tol[worst]:.3g} at {worst}"


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("encoding", ["Q4_1", "Q8_0", "Q6_K", "Q4_K"])
@pytest.mark.parametrize("threads", [1, 2])
def test_many_rows_of_x_go_through_in_chunks(activations, encoding, threads):
    """Prefill-sized x (over 256 KiB as int8 rows) goes past groups of prebuilt tiles
    (1 MiB each) in chunks of rows: 300 rows of 1,024 features make two chunks in int8
    and three in int16, and 850 output features two groups of tiles on one thread,
    the second ending in a partial tile. The result is the twins' as for a few rows."""
    if "avx512" not in ISAS:
        pytest.skip("the integer GEMM is the AVX-512 build's (this machine has no AVX-512 VNNI)")
    rng = np.random.default_rng(23)
    m, n, k = 300, 850, 1024
    data = random_weight(encoding, n, k, 0, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    out = np.full((m, n), np.nan, np.float32)
    _core.quantized_linear(out, x, data, encoding, 0, b, threads, "avx512", activations)
    _assert_twins_agree(out, x, data, encoding, activations, b, f"{encoding} {activations} {threads} threads")


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize(
    "encoding, group, m", [("Q8_0", 0, 1), ("Q6_K", 0, 1), ("I4", 32, 1), ("I4", 32, 5), ("Q3_K", 0, 3), ("I8", 0, 3)]
)
def test_integer_activations_leave_other_cases_in_float32(activations, encoding, group, m):
    """Encodings without an integer kernel (and products too small for the integer
    GEMM: one row against Q8_0 or a decoded encoding) give the float32 path's bits."""
    rng = np.random.default_rng(1)
    k = 256 if encoding in ("Q6_K", "Q3_K") else 96
    data = random_weight(encoding, 40, k, group, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    plain, flagged = np.empty((m, 40), np.float32), np.empty((m, 40), np.float32)
    _core.quantized_linear(plain, x, data, encoding, group, None, 2)
    _core.quantized_linear(flagged, x, data, encoding, group, None, 2, "auto", activations)
    assert np.array_equal(plain.view(np.uint32), flagged.view(np.uint32))


@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_integer_activations_are_ignored_by_the_portable_build(activations):
    rng = np.random.default_rng(2)
    data = random_weight("Q4_1", 12, 64, 0, rng)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    plain, flagged = np.empty((3, 12), np.float32), np.empty((3, 12), np.float32)
    _core.quantized_linear(plain, x, data, "Q4_1", 0, None, 1, "generic")
    _core.quantized_linear(flagged, x, data, "Q4_1", 0, None, 1, "generic", activations)
    assert np.array_equal(plain.view(np.uint32), flagged.view(np.uint32))


@pytest.mark.parametrize("activations", ["int8", "int16"])
def test_integer_activations_leave_non_finite_x_to_float32(activations):
    """x with an infinity or a NaN has no integer scale: the float32 path computes it."""
    rng = np.random.default_rng(3)
    data = random_weight("Q4_1", 8, 64, 0, rng)
    for bad in (np.inf, np.nan):
        for m in (1, 6):  # the one-row kernel and the GEMM
            x = rng.standard_normal((m, 64)).astype(np.float32)
            x[m - 1, 5] = bad
            plain, flagged = np.empty((m, 8), np.float32), np.empty((m, 8), np.float32)
            _core.quantized_linear(plain, x, data, "Q4_1", 0, None, 1)
            _core.quantized_linear(flagged, x, data, "Q4_1", 0, None, 1, "auto", activations)
            assert np.array_equal(plain.view(np.uint32), flagged.view(np.uint32))


def test_unknown_activations_are_value_errors():
    data = random_weight("Q4_1", 8, 64, 0, np.random.default_rng(4))
    out, x = np.empty((2, 8), np.float32), np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match="activations: unknown 'int4' \\(expected 'float32', 'int8' or 'int16'\\)"):
        _core.quantized_linear(out, x, data, "Q4_1", 0, None, 1, "auto", "int4")

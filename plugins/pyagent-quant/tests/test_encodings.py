"""The torch decoders of pyagent_quant.encodings against the ``gguf`` package, bit for
bit (every GGUF type: Q8_0, Q4_0, Q4_1, Q6_K here, and pyagent_quant.gguf_blocks'
Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, whose other tests are in
test_gguf_blocks.py); the I8/I4 quantizers' round-trip error against its derived
bound; row_bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyagent_framework.interfaces import PackedWeight
from pyagent_quant import encodings

U32 = 2.0**-24  # float32 unit roundoff
TINY = 2.0**-150  # half the spacing of float32 subnormals: the absolute rounding error there
SHAPES = {  # (rows, columns): one block, several blocks, odd row counts
    "Q8_0": [(1, 32), (3, 64), (7, 96), (16, 256), (5, 1024)],
    "Q4_0": [(1, 32), (3, 64), (7, 96), (16, 256), (5, 1024)],
    "Q4_1": [(1, 32), (3, 64), (7, 96), (16, 256), (5, 1024)],
    "Q6_K": [(1, 256), (3, 512), (7, 768), (2, 2048)],
    # the types of pyagent_quant.gguf_blocks (test_gguf_blocks.py): 1, 2, 3 and 8 blocks
    "Q5_0": [(1, 32), (3, 64), (7, 96), (2, 256)],
    "Q5_1": [(1, 32), (3, 64), (7, 96), (2, 256)],
    "IQ4_NL": [(1, 32), (3, 64), (7, 96), (2, 256)],
    "Q2_K": [(1, 256), (3, 512), (7, 768), (2, 2048)],
    "Q3_K": [(1, 256), (3, 512), (7, 768), (2, 2048)],
    "Q4_K": [(1, 256), (3, 512), (7, 768), (2, 2048)],
    "Q5_K": [(1, 256), (3, 512), (7, 768), (2, 2048)],
}
GGUF_TYPES = tuple(SHAPES)  # every GGUF type the decoders read
QUANTIZED_BY_GGUF = ("Q8_0", "Q4_0", "Q4_1", "Q6_K")  # the others' encoders: test_gguf_blocks.py
HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- GGUF decoders: bit for bit -----------------------------------------------------------


@pytest.mark.parametrize("encoding", GGUF_TYPES)
def test_gguf_decoders_equal_gguf_package_bit_for_bit(quant_helpers, encoding):
    h = quant_helpers
    rng = np.random.default_rng(sum(map(ord, encoding)))
    for rows, columns in SHAPES[encoding]:
        shape = (rows, columns)
        for _ in range(3):  # random f16 bit patterns: subnormals, signed zeros, +-65504
            data = h.random_gguf_bytes(encoding, rows, columns, rng)
            h.assert_same_bits(h.ours(data, encoding, shape), h.reference(data, encoding, shape))
        data = h.random_gguf_bytes(encoding, rows, columns, rng, scale=(-0.01, 0.01))  # realistic scales
        h.assert_same_bits(h.ours(data, encoding, shape), h.reference(data, encoding, shape))


@pytest.mark.parametrize("encoding", QUANTIZED_BY_GGUF)
def test_gguf_decoders_on_quantized_floats(quant_helpers, encoding):
    """Bytes a quantizer wrote (not only random ones), and they decode near the input."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal((5, 512)).astype(np.float32)
    data = quant_helpers.gguf_quantize(values, encoding)
    got = quant_helpers.ours(data, encoding, values.shape)
    quant_helpers.assert_same_bits(got, quant_helpers.reference(data, encoding, values.shape))
    # A coarse sanity check that the layout is right (a wrong one is off by O(|w|)).
    assert float((got - torch.from_numpy(values)).abs().max()) < 0.3


@pytest.mark.parametrize("encoding", GGUF_TYPES)
@HYPOTHESIS
@given(data=st.data())
def test_gguf_decoders_hypothesis(quant_helpers, encoding, data):
    h = quant_helpers
    block = h.GGUF_BLOCKS[encoding][0]
    rows = data.draw(st.integers(1, 9), label="rows")
    columns = block * data.draw(st.integers(1, 6 if block == 32 else 3), label="blocks")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    raw = h.random_gguf_bytes(encoding, rows, columns, np.random.default_rng(seed))
    h.assert_same_bits(h.ours(raw, encoding, (rows, columns)), h.reference(raw, encoding, (rows, columns)))


def test_q6_k_layout_by_hand(quant_helpers):
    """One Q6_K block built value by value in ggml's layout decodes to d * scale * q."""
    rng = np.random.default_rng(3)
    q = rng.integers(-32, 32, 256)
    scales = rng.integers(-128, 128, 16).astype(np.int8)
    d = np.float16(0.001)
    codes = (q + 32).astype(np.uint8)
    ql, qh = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
    for i, code in enumerate(codes):  # dequantize_row_q6_K, inverted
        half, rest = divmod(i, 128)
        j, lane = divmod(rest, 32)
        byte = half * 64 + lane + 32 * (j % 2)
        ql[byte] |= (code & 15) << (4 * (j // 2))
        qh[half * 32 + lane] |= (code >> 4) << (2 * j)
    block = np.concatenate([ql, qh, scales.view(np.uint8), np.array([d]).view(np.uint8)])[None]
    got = quant_helpers.ours(block, "Q6_K", (1, 256))[0]
    want = torch.tensor([float(np.float32(d) * np.float32(scales[i // 16])) * float(q[i]) for i in range(256)])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- I8 / I4 round trips --------------------------------------------------------------------


def i8_scales(packed: PackedWeight) -> torch.Tensor:
    """The f32 scale of each I8 row, copied out first (a view of one row's bytes may
    have a stride or offset float32 cannot be viewed at)."""
    fresh = torch.empty(packed.data.shape[0], 4, dtype=torch.uint8).copy_(packed.data[:, :4])
    return fresh.view(torch.float32)


def i8_bound(weight: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """Per row: ``|scale*q - w| <= scale * (1/2 + 256 u)``.

    With ``scale`` the stored f32 scale: ``t = fl(w / scale) = (w/scale)(1 + e1)`` with
    ``|w/scale| <= 127(1 + u)``, so ``|round(t) - w/scale| <= 1/2 + 128u`` (no clamp
    bites: ``|t| < 127.5``); the decoded product ``fl(scale * q)`` adds ``|scale q| u
    <= 127 scale u``. Sum: ``scale (1/2 + 255u)``, rounded up to 256u."""
    scale = i8_scales(packed).double()
    return scale * (0.5 + 256 * U32) + TINY


def i4_expected_fields(weight: torch.Tensor, group: int):
    """The ``m`` and ``d`` quantize_i4 must store per group, from the real columns only
    (a padded last group's padding must not widen its range)."""
    rows, columns = weight.shape
    groups = -(-columns // group)
    lo = torch.empty(rows, groups)
    hi = torch.empty(rows, groups)
    for g in range(groups):
        part = weight[:, g * group : (g + 1) * group]
        lo[:, g], hi[:, g] = part.amin(dim=1), part.amax(dim=1)
    m = lo.half()
    d = ((hi - m.float()) / 15).half()
    d = torch.where(d.float() > 0, d, torch.ones_like(d))
    return lo, hi, m, d


def i4_stored_fields(packed: PackedWeight, group: int):
    rows = packed.shape[0]
    blocks = packed.data.reshape(rows, -1, 4 + group // 2)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
    return m, d


def i4_bound(weight: torch.Tensor, packed: PackedWeight, group: int) -> torch.Tensor:
    """Per value: ``|d*q + m - w| <= d/2 + |m - lo| + 15 |d - (hi - m)/15| + 8u(|w| + |m| + 16d)``.

    ``m = f16(lo)`` and ``d = f16((hi - m)/15)`` are rounded, so the real ``t = (w - m)/d``
    of a value in ``[lo, hi]`` lies in ``[(lo - m)/d, (hi - m)/d]``. Inside
    ``[-1/2, 15 + 1/2]`` rounding (and the clamp) move it at most 1/2: error ``d/2``.
    Below (``m`` rounded above ``lo`` by more than half a step) ``q = 0`` and the error is
    ``m - w <= m - lo``; above (``d`` rounded down) ``q = 15`` and it is ``w - m - 15d <=
    15((hi - m)/15 - d)``. So the largest error is at most the sum of the three, plus
    float32 rounding in ``w - m``, the division, ``d*q`` and ``+ m`` (a few ``u`` of the
    magnitudes involved). With d = 1 stored for an all-equal group the bound is 1/2."""
    columns = weight.shape[1]
    lo, hi, _, _ = i4_expected_fields(weight, group)
    m, d = i4_stored_fields(packed, group)
    m, d, lo, hi = m.double(), d.double(), lo.double(), hi.double()
    per_group = d / 2 + (m - lo).abs() + 15 * (d - (hi - m) / 15).abs()
    expand = lambda t: t.repeat_interleave(group, dim=1)[:, :columns]  # noqa: E731
    return expand(per_group) + 8 * U32 * (weight.double().abs() + expand(m.abs()) + 16 * expand(d)) + TINY


def check_i8(weight: torch.Tensor) -> None:
    packed = encodings.quantize_i8(weight, "w")
    assert packed.encoding == "I8" and packed.shape == tuple(weight.shape)
    assert tuple(packed.data.shape) == (weight.shape[0], encodings.row_bytes("I8", weight.shape[1]))
    # The stored scale is max|w| / 127 (1 where that is 0: an all-zero row, or one so
    # small the quotient underflows).
    want = weight.abs().amax(dim=1, keepdim=True) / 127
    scale = i8_scales(packed)
    torch.testing.assert_close(scale, torch.where(want > 0, want, torch.ones_like(want)), rtol=0, atol=0)
    error = (encodings.dequantize(packed).double() - weight.double()).abs()  # exact in float64
    bound = i8_bound(weight, packed)
    assert bool((error <= bound).all()), float((error / bound).max())


def check_i4(weight: torch.Tensor, group: int) -> None:
    packed = encodings.quantize_i4(weight, group, "w")
    rows, columns = weight.shape
    assert packed.encoding == f"I4_G{group}" and packed.shape == (rows, columns)
    assert tuple(packed.data.shape) == (rows, -(-columns // group) * (4 + group // 2))
    _, _, m_want, d_want = i4_expected_fields(weight, group)
    m, d = i4_stored_fields(packed, group)
    # (Compared as values: amin over 0.0 and -0.0 may return either.)
    assert torch.equal(m, m_want), "m is not f16(min) of the real columns"
    assert torch.equal(d, d_want), "d is not f16((max - m)/15) of the real columns"
    decoded = encodings.dequantize(packed)
    assert decoded.shape == (rows, columns)
    error = (decoded.double() - weight.double()).abs()  # exact in float64
    bound = i4_bound(weight, packed, group)
    assert bool((error <= bound).all()), float((error / bound).max())


@pytest.mark.parametrize("columns", [1, 2, 31, 32, 33, 64, 100, 128, 129, 256, 300])
def test_i8_round_trip_within_half_a_step(columns):
    gen = torch.Generator().manual_seed(columns)
    weight = torch.randn(9, columns, generator=gen) * torch.logspace(-3, 2, 9).unsqueeze(1)
    weight[4] = 0  # an all-zero row: scale 1, codes 0
    check_i8(weight)


@pytest.mark.parametrize("group", encodings.INT4_GROUPS)
@pytest.mark.parametrize("columns", [1, 2, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 256, 300])
def test_i4_round_trip_within_half_a_step(group, columns):
    gen = torch.Generator().manual_seed(group * 1000 + columns)
    weight = torch.randn(9, columns, generator=gen) * torch.logspace(-3, 2, 9).unsqueeze(1)
    weight[2] += 50.0  # far from zero: m's f16 rounding (ulp 2^-5 at 50) is part of the error
    weight[4] = 0.25  # constant rows: d = 1 stored, decoded exactly
    weight[5] = 0
    check_i4(weight, group)
    decoded = encodings.dequantize(encodings.quantize_i4(weight, group))
    assert torch.equal(decoded[4], weight[4]) and torch.equal(decoded[5], weight[5])


def test_i4_padding_is_never_read(quant_helpers):
    """The padding columns of the last block may hold anything: decoding ignores them."""
    weight = torch.randn(4, 40)
    packed = encodings.quantize_i4(weight, 32)
    blocks = packed.data.clone().reshape(4, 2, 20)
    before = encodings.dequantize(packed)
    # The second block codes columns 32..63: low nibbles of its bytes 0..15 are columns
    # 32..47, high nibbles columns 48..63. Only columns 32..39 exist (low nibbles of bytes
    # 0..7); flip every other nibble.
    blocks[:, 1, 4 : 4 + 8] ^= 0xF0
    blocks[:, 1, 4 + 8 :] ^= 0xFF
    changed = PackedWeight("I4_G32", (4, 40), blocks.reshape(4, -1), encodings.dequantize)
    quant_helpers.assert_same_bits(encodings.dequantize(changed), before)


@HYPOTHESIS
@given(
    rows=st.integers(1, 5),
    columns=st.integers(1, 300),
    group=st.sampled_from(encodings.INT4_GROUPS),
    seed=st.integers(0, 2**31 - 1),
    magnitude=st.sampled_from([1e-3, 0.05, 1.0, 30.0, 1000.0]),
    offset=st.sampled_from([0.0, 0.5, -7.0, 300.0]),
)
def test_i4_round_trip_hypothesis(rows, columns, group, seed, magnitude, offset):
    gen = torch.Generator().manual_seed(seed)
    check_i4(torch.randn(rows, columns, generator=gen) * magnitude + offset, group)


@HYPOTHESIS
@given(
    values=st.lists(
        st.floats(min_value=-1000, max_value=1000, allow_nan=False, width=32) | st.just(0.0), min_size=1, max_size=400
    ),
    columns=st.integers(1, 200),
    group=st.sampled_from(encodings.INT4_GROUPS),
)
def test_quantizers_hypothesis_on_arbitrary_values(values, columns, group):
    """Arbitrary float32 values (ties, repeats, signed zeros, tiny magnitudes), as rows."""
    rows = max(1, len(values) // columns)
    weight = torch.tensor((values * (rows * columns // len(values) + 1))[: rows * columns], dtype=torch.float32)
    weight = weight.reshape(rows, columns)
    check_i8(weight)
    check_i4(weight, group)


@HYPOTHESIS
@given(
    values=st.lists(
        st.floats(min_value=2.0**-100, max_value=2.0**100, width=32), min_size=1, max_size=64
    ),
    signs=st.lists(st.booleans(), min_size=64, max_size=64),
)
def test_i8_round_trip_across_magnitudes(values, signs):
    """I8 keeps an f32 scale: any normal magnitude round-trips within half a step."""
    row = torch.tensor([v if s else -v for v, s in zip(values, signs)], dtype=torch.float32)
    check_i8(torch.stack([row, row.flip(0) / 3]))


@pytest.mark.parametrize("columns", [1, 33, 99])
def test_i8_single_row_of_odd_width(quant_helpers, columns):
    """One I8 row (an embedding lookup of one token, a prefill slice of one row) of a
    column count that is not a multiple of 4."""
    weight = torch.randn(5, columns)
    packed = encodings.quantize_i8(weight)
    full = encodings.dequantize(packed)
    quant_helpers.assert_same_bits(encodings.dequantize(packed.rows(2, 3)), full[2:3])
    quant_helpers.assert_same_bits(encodings.dequantize_rows(packed, torch.tensor([4])), full[4:5])


def test_i4_g32_is_q4_1(quant_helpers):
    """I4_G32 bytes relabelled Q4_1 decode identically (ours and the gguf package's)."""
    h = quant_helpers
    gen = torch.Generator().manual_seed(5)
    for columns in (32, 64, 256):
        weight = torch.randn(6, columns, generator=gen)
        packed = encodings.quantize_i4(weight, 32)
        as_i4 = encodings.dequantize(packed)
        data = packed.data.numpy()
        h.assert_same_bits(h.ours(data, "Q4_1", (6, columns)), as_i4)
        h.assert_same_bits(h.reference(data, "Q4_1", (6, columns)), as_i4)
    # And the other way: a Q4_1 file's bytes decode as I4_G32.
    data = h.random_gguf_bytes("Q4_1", 3, 96, np.random.default_rng(1))
    h.assert_same_bits(h.ours(data, "I4_G32", (3, 96)), h.reference(data, "Q4_1", (3, 96)))


def test_quantize_i4_rejects_other_groups():
    for group in (16, 48, 256):
        with pytest.raises(ValueError, match=str(group)):
            encodings.quantize_i4(torch.zeros(2, 64), group)


# -- row_bytes and shape checks ---------------------------------------------------------------


@pytest.mark.parametrize(
    "encoding, columns, expected",
    [
        ("Q8_0", 64, 68), ("Q4_0", 96, 54), ("Q4_1", 32, 20), ("Q6_K", 512, 420),
        ("I8", 1, 5), ("I8", 100, 104),
        ("I4_G32", 1, 20), ("I4_G32", 33, 40), ("I4_G64", 100, 72), ("I4_G128", 100, 68), ("I4_G128", 256, 136),
        ("Q5_0", 64, 44), ("Q5_1", 96, 72), ("IQ4_NL", 32, 18), ("Q2_K", 512, 168), ("Q3_K", 256, 110),
        ("Q4_K", 768, 432), ("Q5_K", 256, 176),
    ],
)
def test_row_bytes(encoding, columns, expected):
    assert encodings.row_bytes(encoding, columns) == expected


@pytest.mark.parametrize(
    "encoding, columns",
    [("Q8_0", 33), ("Q4_0", 1), ("Q4_1", 100), ("Q6_K", 255), ("Q6_K", 32),
     ("Q5_0", 33), ("IQ4_NL", 16), ("Q2_K", 128), ("Q4_K", 257), ("Q5_K", 32)],
)
def test_row_bytes_rejects_partial_blocks(encoding, columns):
    with pytest.raises(ValueError, match=rf"{encoding}.*{columns}"):
        encodings.row_bytes(encoding, columns)


@pytest.mark.parametrize("encoding", ["IQ4_XS", "F16", "I4_G48", "I4_G16", "I4", "I2", "q8_0", ""])
def test_row_bytes_rejects_unknown_encodings(encoding):
    with pytest.raises(ValueError, match="unknown encoding"):
        encodings.row_bytes(encoding, 64)


def test_kernel_encoding():
    assert encodings.kernel_encoding("I4_G64") == ("I4", 64)
    assert encodings.kernel_encoding("Q6_K") == ("Q6_K", 0)
    assert encodings.kernel_encoding("I8") == ("I8", 0)


def test_dequantize_rejects_bytes_that_do_not_fit():
    for data in (torch.zeros(2, 67, dtype=torch.uint8), torch.zeros(2, 68, dtype=torch.int8)):
        with pytest.raises(ValueError, match="'w'.*Q8_0"):
            encodings.dequantize(PackedWeight("Q8_0", (2, 64), data, encodings.dequantize, "w"))


def test_dequantize_rows(quant_helpers):
    packed = encodings.quantize_i4(torch.randn(10, 70), 64)
    full = encodings.dequantize(packed)
    ids = torch.tensor([[3, 3, 9], [0, 1, 2]])
    quant_helpers.assert_same_bits(encodings.dequantize_rows(packed, ids), full[ids])

"""pyagent_quant.gguf_blocks' types Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K: kept
packed, read by rows and row slices (their decoders against the ``gguf`` package, bit
for bit, and their row sizes are in test_encodings.py with the other types'); and the
encoders of pyagent_quant.gguf_encode: their bytes decode (by the package and by us,
identically) near the weight they came from."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyagent_framework.interfaces import PackedWeight
from pyagent_quant import encodings, gguf_blocks
from pyagent_quant.gguf_encode import gguf_encodings, quantize_gguf

NEW_TYPES = ("Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K")
ENCODED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL")
BY_GGUF_PACKAGE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# Relative RMS error of N(0, 1) weights [64, 1024] coded and decoded. Measured over
# seeds and magnitudes (0.02, 1, 30), at most: Q8_0 0.54%, Q6_K 1.68%, Q5_K 3.58%,
# Q5_1 3.80%, Q5_0 4.30%, Q4_K 7.17%, Q4_1 7.85%, IQ4_NL 8.03%, Q4_0 8.65%, Q3_K 14.4%,
# Q2_K 27.1%; the bounds leave ~10%. A wrong bit layout is off by O(100%).
RMS_BOUND = {
    "Q8_0": 0.006, "Q6_K": 0.0185, "Q5_K": 0.040, "Q5_1": 0.042, "Q5_0": 0.047, "Q4_K": 0.079,
    "Q4_1": 0.086, "IQ4_NL": 0.088, "Q4_0": 0.095, "Q3_K": 0.16, "Q2_K": 0.30,
}
# Largest error of a value over the largest magnitude of its block of 256, for blocks of
# normal, Laplace or uniform values of any magnitude in 1e-3..1e3, offset or not
# (measured at most: Q8_0 0.006, Q5_1 0.033, Q6_K 0.043, Q5_K 0.060, Q5_0 0.062,
# Q4_1 0.067, IQ4_NL 0.111, Q4_0 0.125, Q4_K 0.127, Q3_K 0.27, Q2_K 0.52; the k-quant
# fits minimise the squared error, so they may clip a lone outlier a little). The
# bounds leave ~30%.
MAX_BOUND = {
    "Q8_0": 0.01, "Q5_1": 0.045, "Q6_K": 0.06, "Q5_K": 0.08, "Q5_0": 0.08, "Q4_1": 0.09, "IQ4_NL": 0.15,
    "Q4_0": 0.16, "Q4_K": 0.17, "Q3_K": 0.35, "Q2_K": 0.65,
}
HYPOTHESIS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def relative_rms(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.sqrt(((got.astype(np.float64) - want) ** 2).mean() / (want.astype(np.float64) ** 2).mean()))


# -- decoded types ---------------------------------------------------------------------------


def test_every_decoded_type_is_kept_packed():
    assert frozenset(NEW_TYPES) == frozenset(gguf_blocks.DECODERS)
    assert encodings.GGUF_ENCODINGS == {"Q8_0", "Q4_0", "Q4_1", "Q6_K", *NEW_TYPES}


@pytest.mark.parametrize("encoding", NEW_TYPES)
def test_dequantize_rows_and_row_slices(quant_helpers, encoding):
    columns = 2 * gguf_blocks.BLOCKS[encoding][0]
    data = quant_helpers.random_gguf_bytes(encoding, 6, columns, np.random.default_rng(4), scale=(-1, 1))
    packed = PackedWeight(encoding, (6, columns), torch.from_numpy(data), encodings.dequantize, "w")
    full = encodings.dequantize(packed)
    ids = torch.tensor([[5, 0, 5], [2, 3, 1]])
    quant_helpers.assert_same_bits(encodings.dequantize_rows(packed, ids), full[ids])
    quant_helpers.assert_same_bits(encodings.dequantize(packed.rows(2, 4)), full[2:4])
    assert encodings.dequantize(packed.rows(3, 3)).shape == (0, columns)


# -- encoders ---------------------------------------------------------------------------------


def test_encoder_list():
    assert sorted(gguf_encodings()) == sorted(ENCODED)


@pytest.mark.parametrize("encoding", ENCODED)
@pytest.mark.parametrize("magnitude", [0.02, 1.0, 30.0])
def test_encoder_round_trip_error(quant_helpers, encoding, magnitude):
    """Random normal weights: the relative RMS error is below the measured bound, whatever
    their magnitude, and our decoder reads the bytes as the gguf package does."""
    weight = (np.random.default_rng(11).standard_normal((64, 1024)) * magnitude).astype(np.float32)
    data = quantize_gguf(weight, encoding)
    assert data.dtype == np.uint8 and data.shape == (64, encodings.row_bytes(encoding, 1024))
    error = relative_rms(quant_helpers.decoded(data, encoding, weight.shape), weight)
    assert error < RMS_BOUND[encoding], f"{encoding}: relative RMS error {error:.4f}"


def test_k_quants_beat_the_legacy_types_of_their_size(quant_helpers):
    """Per-sub-block scales and minimums, fitted, code better than one scale per 32."""
    weight = np.random.default_rng(12).standard_normal((32, 1024)).astype(np.float32)
    decoded = quant_helpers.decoded
    error = {e: relative_rms(decoded(quantize_gguf(weight, e), e, weight.shape), weight) for e in ENCODED}
    assert error["Q4_K"] < error["Q4_1"] < error["Q4_0"]
    assert error["IQ4_NL"] < error["Q4_0"]
    assert error["Q5_K"] < error["Q5_1"] < error["Q5_0"]
    assert error["Q6_K"] < error["Q5_K"] and error["Q8_0"] < error["Q6_K"]
    assert error["Q2_K"] > error["Q3_K"] > error["Q4_K"]


@pytest.mark.parametrize("encoding", BY_GGUF_PACKAGE)
def test_legacy_encoders_are_the_gguf_package_byte_for_byte(encoding):
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    weight = np.random.default_rng(13).standard_normal((9, 256)).astype(np.float32)
    weight[3] = 0
    np.testing.assert_array_equal(quantize_gguf(weight, encoding), quantize(weight, GGMLQuantizationType[encoding]))


@pytest.mark.parametrize("encoding", ENCODED)
def test_zero_rows_and_blocks_round_trip_to_zero(quant_helpers, encoding):
    block = 256 if encoding.endswith("_K") else 32
    weight = np.random.default_rng(14).standard_normal((4, 3 * block)).astype(np.float32)
    weight[1] = 0
    weight[2, block : 2 * block] = 0
    values = quant_helpers.decoded(quantize_gguf(weight, encoding), encoding, weight.shape)
    assert not values[1].any() and not values[2, block : 2 * block].any()
    assert relative_rms(values, weight) < RMS_BOUND[encoding]


@pytest.mark.parametrize("encoding", ENCODED)
def test_constant_blocks(quant_helpers, encoding):
    """A block of one value (either sign) is coded within its type's precision."""
    block = 256 if encoding.endswith("_K") else 32
    weight = np.repeat(np.float32([[0.3], [-0.3], [5.0]]), 2 * block, axis=1)
    values = quant_helpers.decoded(quantize_gguf(weight, encoding), encoding, weight.shape)
    np.testing.assert_allclose(values, weight, rtol=MAX_BOUND[encoding])


@pytest.mark.parametrize("encoding", ENCODED)
@HYPOTHESIS
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 4), blocks=st.integers(1, 3))
def test_encoder_hypothesis(quant_helpers, encoding, seed, rows, blocks):
    """Each block of 256 values at its own magnitude (1e-3..1e3) and offset: every value
    decodes within MAX_BOUND of the block's largest magnitude."""
    rng = np.random.default_rng(seed)
    columns = 256 * blocks
    spread = 10.0 ** rng.uniform(-3, 3, (rows, blocks, 1))
    offset = rng.choice([0.0, 0.0, 1.0, -2.0], (rows, blocks, 1)) * spread
    weight = (rng.standard_normal((rows, blocks, 256)) * spread + offset).astype(np.float32).reshape(rows, columns)
    values = quant_helpers.decoded(quantize_gguf(weight, encoding), encoding, weight.shape)
    error = np.abs(values - weight).reshape(rows, blocks, 256).max(-1)
    peak = np.abs(weight).reshape(rows, blocks, 256).max(-1)
    assert (error <= MAX_BOUND[encoding] * peak).all(), float((error / peak).max())


@pytest.mark.parametrize("encoding", ENCODED)
def test_rows_encode_independently(encoding):
    """Blocks are coded on their own: a large weight (encoded a chunk at a time) gives
    each row the bytes it gets alone; a torch tensor the bytes of its numpy array."""
    weight = np.random.default_rng(15).standard_normal((300, 512)).astype(np.float32)
    data = quantize_gguf(weight, encoding)
    for row in (0, 127, 128, 299):
        np.testing.assert_array_equal(data[row], quantize_gguf(weight[row : row + 1], encoding)[0])
    np.testing.assert_array_equal(quantize_gguf(torch.from_numpy(weight[:8]), encoding), data[:8])


@pytest.mark.parametrize("encoding, columns", [("Q4_K", 576), ("Q6_K", 100), ("Q2_K", 32), ("IQ4_NL", 48), ("Q5_0", 16)])
def test_encoder_rejects_partial_blocks(encoding, columns):
    with pytest.raises(ValueError, match=rf"{encoding}.*{columns}"):
        quantize_gguf(np.zeros((2, columns), np.float32), encoding)


def test_encoder_rejects_other_input():
    with pytest.raises(ValueError, match="IQ4_XS"):
        quantize_gguf(np.zeros((2, 256), np.float32), "IQ4_XS")
    with pytest.raises(ValueError, match="Q4_K.*shape"):
        quantize_gguf(np.zeros(256, np.float32), "Q4_K")
    with pytest.raises(ValueError, match="Q6_K.*NaN"):
        quantize_gguf(np.full((1, 256), np.nan, np.float32), "Q6_K")


def test_encoder_of_no_rows():
    assert quantize_gguf(np.zeros((0, 512), np.float32), "Q5_K").shape == (0, 352)

"""PackedLinear and PackedEmbedding against the dequantized weight.

Tolerance: the module's output is a float32 dot product of ``K`` terms (any summation
order, blocked or with FMA), plus a bias. Its rounding error is at most
``gamma(K + 2) * (|x| @ |W|.T + |b|)`` with ``gamma(n) = n u / (1 - n u)``, ``u = 2^-24``
(Higham, Accuracy and Stability of Numerical Algorithms, 3.1): ``K`` for the sum, one
for the bias, one more for the weight itself when a kernel decodes ``d*q + m`` with a
fused multiply-add instead of the torch twin's product then sum. The reference is
computed in float64 from the same float32 operands.
"""

from __future__ import annotations

import types

import pytest
import torch

from pyagent_framework.interfaces import PackedWeight
from pyagent_quant import encodings, linear
from pyagent_quant.linear import PackedEmbedding, PackedLinear, native_available

U32 = 2.0**-24
# encoding -> input columns: whole blocks for GGUF's (Q6_K: 256), ragged ones for I8/I4.
ENCODINGS = {
    "Q8_0": 96,
    "Q4_0": 64,
    "Q4_1": 160,
    "Q6_K": 512,
    "I8": 100,
    "I4_G32": 100,
    "I4_G64": 33,
    "I4_G128": 200,
}
OUT_FEATURES = 40
NATIVE = [
    pytest.param(False, id="torch"),
    pytest.param(
        True,
        id="native",
        marks=pytest.mark.skipif(
            not native_available(),
            reason="pyagent-native without the quantized kernels (_core.quantized_linear): the torch twin computes",
        ),
    ),
]


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The exact result (float64) and the float32 error bound of each element."""
    k = weight.shape[1]
    exact = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        exact = exact + bias.double()
        magnitude = magnitude + bias.double().abs()
    return exact, gamma(k + 2) * magnitude


def assert_within(got: torch.Tensor, x, weight, bias) -> None:
    exact, bound = reference(x.reshape(-1, weight.shape[1]), weight, bias)
    assert got.dtype == torch.float32
    error = (got.reshape(exact.shape).double() - exact).abs()
    assert bool((error <= bound).all()), f"error {float(error.max())} > bound {float(bound.flatten()[error.argmax()])}"


@pytest.fixture
def core_spy(monkeypatch):
    """Counts the native core's quantized_linear calls (rows of each)."""
    calls: list[int] = []
    if linear._core is None:
        return calls
    real = linear._core

    def quantized_linear(out, x, *args):
        calls.append(x.shape[0])
        return real.quantized_linear(out, x, *args)

    spy = types.SimpleNamespace(quantized_linear=quantized_linear, dequantize=real.dequantize)
    if hasattr(real, "int8_gemm"):
        spy.int8_gemm = real.int8_gemm
    monkeypatch.setattr(linear, "_core", spy)
    return calls


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_packed_linear_matches_dequantized_product(quant_helpers, core_spy, encoding, with_bias, native):
    k = ENCODINGS[encoding]
    packed = quant_helpers.packed_weight(encoding, OUT_FEATURES, k, seed=len(encoding) + k)
    weight = encodings.dequantize(packed)
    bias = torch.randn(OUT_FEATURES) if with_bias else None
    module = PackedLinear(packed, bias, native=native)
    assert module.native is native and (module.in_features, module.out_features) == (k, OUT_FEATURES)
    gen = torch.Generator().manual_seed(1)
    for rows in range(1, 81):  # up to max_rows (64) the decode path, past it the prefill path
        x = torch.randn(rows, k, generator=gen)
        with torch.no_grad():
            out = module(x)
        assert out.shape == (rows, OUT_FEATURES)
        assert_within(out, x, weight, bias)
    if native:
        assert core_spy == list(range(1, module.max_rows + 1))  # the fused kernel up to max_rows, not past


@pytest.mark.skipif(linear._core is None or not linear._core.int8_gemm("Q6_K"), reason="no integer GEMM in this build")
@pytest.mark.parametrize(
    "encoding, activations, past_max_rows_in_core",
    [("Q4_1", "int16", True), ("Q4_1", "int8", True), ("Q6_K", "int8", True), ("Q6_K", "int16", False)],
)
def test_integer_activations_keep_prefill_in_the_core_where_it_wins(
    quant_helpers, core_spy, encoding, activations, past_max_rows_in_core
):
    """Prefill-sized inputs go to the integer GEMM, except Q6_K in int16, where
    dequantize + float GEMM is faster: those rows are then exact up to float32."""
    packed = quant_helpers.packed_weight(encoding, OUT_FEATURES, 256, seed=3)
    module = PackedLinear(packed, None, native=True, activations=activations)
    x = torch.randn(module.max_rows + 16, 256, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        decode, prefill = module(x[: module.max_rows]), module(x)
    assert decode.shape == (module.max_rows, OUT_FEATURES) and prefill.shape == (len(x), OUT_FEATURES)
    assert core_spy == ([module.max_rows, len(x)] if past_max_rows_in_core else [module.max_rows])
    if not past_max_rows_in_core:
        assert_within(prefill, x, encodings.dequantize(packed), None)


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_packed_linear_input_shapes(quant_helpers, encoding, native):
    k = ENCODINGS[encoding]
    packed = quant_helpers.packed_weight(encoding, OUT_FEATURES, k, seed=3)
    weight = encodings.dequantize(packed)
    bias = torch.randn(OUT_FEATURES)
    module = PackedLinear(packed, bias, native=native)
    for shape in [(k,), (1, k), (2, 5, k), (3, 30, k), (2, 1, 3, k), (0, k)]:  # 1-D, 3-D (decode and prefill sized), 4-D, empty
        x = torch.randn(shape)
        with torch.no_grad():
            out = module(x)
        assert out.shape == (*shape[:-1], OUT_FEATURES)
        assert_within(out, x, weight, bias)


@pytest.mark.parametrize("native", NATIVE)
def test_packed_linear_prefill_in_row_slices(quant_helpers, monkeypatch, native):
    """Prefill dequantizes a slice of weight rows at a time: slices that do not divide
    the rows give the same result as one slice."""
    packed = quant_helpers.packed_weight("Q4_1", 70, 64, seed=4)
    weight = encodings.dequantize(packed)
    bias = torch.randn(70)
    x = torch.randn(100, 64)
    module = PackedLinear(packed, bias, native=native)
    whole = module(x)
    monkeypatch.setattr(linear, "_SLICE", 16)
    sliced = module(x)
    assert_within(sliced, x, weight, bias)
    assert_within(whole, x, weight, bias)


@pytest.mark.parametrize("native", NATIVE)
def test_packed_linear_other_dtypes(quant_helpers, native):
    """A bfloat16 input is computed in float32 and returned as bfloat16."""
    packed = quant_helpers.packed_weight("Q8_0", 24, 64, seed=5)
    module = PackedLinear(packed, native=native)
    x = torch.randn(3, 64).to(torch.bfloat16)
    out = module(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, module(x.float()).to(torch.bfloat16), rtol=0, atol=0)


def test_packed_linear_dequantize_slices(quant_helpers):
    packed = quant_helpers.packed_weight("I4_G64", 30, 100, seed=6)
    module = PackedLinear(packed, native=False)
    full = encodings.dequantize(packed)
    assert torch.equal(module.dequantize(), full)
    assert torch.equal(module.dequantize(7, 19), full[7:19])


def test_packed_linear_takes_non_contiguous_bytes(quant_helpers):
    packed = quant_helpers.packed_weight("Q8_0", 12, 64, seed=7)
    wide = torch.zeros(12, packed.data.shape[1] + 10, dtype=torch.uint8)
    wide[:, 5 : 5 + packed.data.shape[1]] = packed.data
    view = PackedWeight("Q8_0", (12, 64), wide[:, 5 : 5 + packed.data.shape[1]], encodings.dequantize, "w")
    assert not view.data.is_contiguous()
    module = PackedLinear(view, native=False)
    x = torch.randn(4, 64)
    torch.testing.assert_close(module(x), PackedLinear(packed, native=False)(x), rtol=0, atol=0)


# -- PackedEmbedding --------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_packed_embedding_rows_equal_dequantized_rows(quant_helpers, encoding):
    k = ENCODINGS[encoding]
    packed = quant_helpers.packed_weight(encoding, 50, k, seed=8)
    table = encodings.dequantize(packed)
    embedding = PackedEmbedding(packed)
    assert (embedding.num_embeddings, embedding.embedding_dim) == (50, k)
    for ids in (torch.tensor([[0, 49, 7], [7, 7, 3]]), torch.arange(50), torch.tensor([12, 31])):
        out = embedding(ids)
        assert out.shape == (*ids.shape, k) and out.dtype == torch.float32
        assert torch.equal(out.view(torch.int32), table[ids].view(torch.int32))  # bit for bit


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_packed_embedding_no_ids(quant_helpers, encoding):
    """An empty lookup (PackedEmbedding.forward skips its range check for it) gives no rows."""
    k = ENCODINGS[encoding]
    embedding = PackedEmbedding(quant_helpers.packed_weight(encoding, 10, k))
    assert embedding(torch.zeros(0, dtype=torch.long)).shape == (0, k)
    assert embedding(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0, k)


@pytest.mark.parametrize("encoding", ["Q8_0", "I4_G32", "Q6_K"])
def test_packed_embedding_single_id(quant_helpers, encoding):
    """One token (a decode step) reads one row."""
    k = ENCODINGS[encoding]
    packed = quant_helpers.packed_weight(encoding, 20, k, seed=9)
    embedding = PackedEmbedding(packed)
    assert torch.equal(embedding(torch.tensor([13])), encodings.dequantize(packed)[13:14])


@pytest.mark.parametrize("bad", [[50], [-1], [0, 3, 50], [[1, 2], [3, 1000]]])
def test_packed_embedding_rejects_out_of_range_ids(quant_helpers, bad):
    embedding = PackedEmbedding(quant_helpers.packed_weight("Q8_0", 50, 64))
    with pytest.raises(IndexError, match="50"):
        embedding(torch.tensor(bad))


# -- bad packed data ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "encoding, shape, data",
    [
        ("Q4_0", (4, 64), torch.zeros(4, 38, dtype=torch.uint8)),  # 36 bytes a row
        ("Q8_0", (4, 64), torch.zeros(4, 68, dtype=torch.int8)),  # right size, wrong dtype
        ("Q6_K", (2, 256), torch.zeros(2, 208, dtype=torch.uint8)),
        ("I8", (3, 10), torch.zeros(3, 10, dtype=torch.uint8)),  # the scale's 4 bytes missing
        ("I4_G64", (3, 100), torch.zeros(3, 50, dtype=torch.uint8)),  # 72 bytes a row
    ],
)
def test_packed_linear_rejects_bytes_that_do_not_fit(encoding, shape, data):
    packed = PackedWeight(encoding, shape, data, encodings.dequantize, "blk.0.attn_q.weight")
    with pytest.raises(ValueError, match=rf"blk\.0\.attn_q\.weight.*{encoding}"):
        PackedLinear(packed, native=False)


@pytest.mark.parametrize(
    "encoding, shape, match",
    [("Q8_0", (4, 48), "Q8_0.*48"), ("Q6_K", (2, 128), "Q6_K.*128"), ("IQ4_XS", (4, 64), "IQ4_XS"), ("I4_G48", (4, 64), "I4_G48")],
)
def test_packed_modules_reject_encodings_they_cannot_read(encoding, shape, match):
    packed = PackedWeight(encoding, shape, torch.zeros(shape[0], 40, dtype=torch.uint8), encodings.dequantize, "w")
    with pytest.raises(ValueError, match=match):
        PackedLinear(packed, native=False)
    with pytest.raises(ValueError, match=match):
        PackedEmbedding(packed)


@pytest.mark.skipif(native_available(), reason="the native core is installed")
def test_native_asked_for_without_the_core(quant_helpers):
    with pytest.raises(ValueError, match="native"):
        PackedLinear(quant_helpers.packed_weight("Q8_0", 4, 32), native=True)


@pytest.mark.skipif(not native_available(), reason="pyagent-native without the quantized kernels (_core.dequantize)")
@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_native_dequantize_is_the_torch_twin(quant_helpers, encoding):
    """The native core decodes every encoding to the same float32 bits as the torch
    decoders (so the prefill path and the unquantized model see one weight)."""
    import numpy as np

    k = ENCODINGS[encoding]
    packed = quant_helpers.packed_weight(encoding, 40, k, seed=10)
    if encoding in quant_helpers.GGUF_BLOCKS:  # random blocks, any finite f16 field
        data = quant_helpers.random_gguf_bytes(encoding, 40, k, np.random.default_rng(10))
        packed = PackedWeight(encoding, (40, k), torch.from_numpy(data), encodings.dequantize)
    module = PackedLinear(packed, native=True)
    want = encodings.dequantize(packed)
    for start, stop in [(0, 40), (3, 4), (17, 33)]:
        got = module.dequantize(start, stop)
        assert torch.equal(got.view(torch.int32), want[start:stop].view(torch.int32))

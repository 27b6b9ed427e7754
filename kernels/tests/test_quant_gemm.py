"""The packed-weight GEMV/GEMM kernels against their twin (pyagent-quant's torch
decoders, then ``F.linear`` in float32), and PackedLinear computing with them.

On CPU the kernels run in Triton's interpreter (conftest.py): the decoded weights
must equal the torch decoders' bit for bit there, and the products the twin's within
float32 rounding (1e-4 of the largest output). On a GPU (FMA contraction, tensor-core
products) the same tests run within tolerances, plus Llama-3-8B-sized shapes and the
engine end to end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pyagent_triton import quant_gemm

pq = pytest.importorskip("pyagent_quant")
from pyagent_quant import encodings as layouts  # noqa: E402
from pyagent_quant import linear as quant_linear  # noqa: E402

from pyagent_framework.interfaces import PackedWeight  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

#: GGUF block types: (values, bytes, byte offsets of the f16 fields) per block.
GGUF_BLOCKS = {
    "Q8_0": (32, 34, (0,)),
    "Q4_0": (32, 18, (0,)),
    "Q4_1": (32, 20, (0, 2)),
    "Q5_0": (32, 22, (0,)),
    "Q5_1": (32, 24, (0, 2)),
    "IQ4_NL": (32, 18, (0,)),
    "Q2_K": (256, 84, (80, 82)),
    "Q3_K": (256, 110, (108,)),
    "Q4_K": (256, 144, (0, 2)),
    "Q5_K": (256, 176, (0, 2)),
    "Q6_K": (256, 210, (208,)),
}
ENCODINGS = ("I8", "I4_G32", "I4_G64", "I4_G128", *GGUF_BLOCKS)
N = 33  # odd: a partial tile of rows


def columns(encoding: str) -> int:
    """A K that is not a multiple of the kernels' tiles (64, 128, 256) where the
    encoding allows: any K for I8/I4 (100: a partial last int4 group), whole blocks
    for GGUF."""
    if encoding in GGUF_BLOCKS:
        return 3 * GGUF_BLOCKS[encoding][0]
    return 100


def packed_bytes(encoding: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """``uint8 [rows, bytes]``: I8/I4 quantized from N(0, 0.05) weights; GGUF types as
    random bytes (every code, sign and sub-block scale) with f16 fields uniform in
    [-0.02, 0.02) (finite, both signs)."""
    if encoding in GGUF_BLOCKS:
        block, size, fields = GGUF_BLOCKS[encoding]
        rng = np.random.default_rng(seed)
        blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        for at in fields:
            values = rng.uniform(-0.02, 0.02, (rows, cols // block)).astype(np.float16)
            blocks[..., at : at + 2] = values.view(np.uint8).reshape(rows, cols // block, 2)
        return torch.from_numpy(blocks.reshape(rows, -1).copy()).to(DEVICE)
    weight = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    if encoding == "I8":
        return layouts.quantize_i8(weight).data.to(DEVICE)
    return layouts.quantize_i4(weight, int(encoding[4:])).data.to(DEVICE)


def torch_decoded(data: torch.Tensor, encoding: str, cols: int) -> torch.Tensor:
    return layouts.dequantize(PackedWeight(encoding, (data.shape[0], cols), data, layouts.dequantize))


def randn(*shape, dtype=torch.float32, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: within 1e-4 relative (of each value, and of the largest output for
    values that cancel); 16-bit: 2e-2."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = float(ref.float().abs().max()) or 1.0
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


# --------------------------------------------------------------------------- decoders


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_dequantize_equals_the_torch_decoders(encoding):
    cols = columns(encoding)
    data = packed_bytes(encoding, N, cols)
    got = quant_gemm.dequantize(data, encoding, cols)
    want = torch_decoded(data, encoding, cols)
    if CUDA:  # d * q + m may be one fused multiply-add there
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    else:
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    # bfloat16 out: the same values rounded (the interpreter truncates: within one step).
    in_bf16 = quant_gemm.dequantize(data, encoding, cols, torch.bfloat16)
    assert in_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(in_bf16.float(), got, rtol=2**-7, atol=0)


# --------------------------------------------------------------------------- packed_linear


@pytest.mark.parametrize("bias, dtype", [(False, torch.float32), (True, torch.float32), (True, torch.bfloat16)])
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_packed_linear_matches_twin(encoding, m, bias, dtype):
    cols = columns(encoding)
    data = packed_bytes(encoding, N, cols)
    x = randn(m, cols, dtype=dtype)
    b = randn(N, seed=2) if bias else None
    out = quant_gemm.packed_linear(x, data, encoding, b)
    assert_matches(out, quant_gemm.packed_linear_reference(x, data, encoding, b), dtype)


def test_the_twin_is_the_decoded_weights_product():
    data = packed_bytes("Q4_K", 5, 256)
    x, b = randn(2, 256), randn(5, seed=2)
    expected = x @ torch_decoded(data, "Q4_K", 256).T + b
    torch.testing.assert_close(quant_gemm.packed_linear_reference(x, data, "Q4_K", b), expected)


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 4, 17])
def test_any_split_of_k_gives_the_same_product(m, splits):
    cols = 576  # several K tiles of every path
    data = packed_bytes("I4_G64", N, cols)
    x, b = randn(m, cols), randn(N, seed=2)
    ref = quant_gemm.packed_linear_reference(x, data, "I4_G64", b)
    assert_matches(quant_gemm.packed_linear(x, data, "I4_G64", b, splits=splits), ref, torch.float32)


def test_small_grids_are_split_over_k():
    """What the twin tests above run through: on these shapes the default splits K."""
    assert quant_gemm._splits(programs=3, k_tiles=8, sms=132, most=8) == 4
    assert quant_gemm._splits(programs=3, k_tiles=3, sms=132, most=8) == 1
    assert quant_gemm._splits(programs=1024, k_tiles=64, sms=132, most=8) == 1


def test_strided_x_and_an_odd_address_weight():
    cols = 96
    data = packed_bytes("Q4_0", N, cols)
    # The same bytes at an odd address (a view into a larger buffer): copied, then read.
    buffer = torch.zeros(data.numel() + 1, dtype=torch.uint8, device=DEVICE)
    odd = buffer[1:].view(N, -1)
    odd.copy_(data)
    x = randn(3, cols + 10)[:, 5 : 5 + cols]
    ref = quant_gemm.packed_linear_reference(x.contiguous(), data, "Q4_0")
    assert_matches(quant_gemm.packed_linear(x, odd, "Q4_0"), ref, torch.float32)


def test_empty_inputs():
    data = packed_bytes("I8", N, 40)
    b = randn(N, seed=2)
    assert quant_gemm.packed_linear(randn(0, 40), data, "I8", b).shape == (0, N)
    assert quant_gemm.packed_linear(randn(2, 40), data[:0], "I8").shape == (2, 0)
    # K = 0: nothing to multiply, the bias remains.
    empty_k = torch.zeros(N, 4, dtype=torch.uint8, device=DEVICE)
    assert torch.equal(quant_gemm.packed_linear(randn(2, 0), empty_k, "I8", b), b.expand(2, N))


# --------------------------------------------------------------------------- refusals


def test_supports_names_every_encoding_with_a_kernel():
    assert set(quant_gemm.encodings()) == set(ENCODINGS)
    assert all(quant_gemm.supports(e) for e in ENCODINGS)
    for other in ("Q8_K", "IQ2_XXS", "F16", "I4_G48", "I4", "i8", ""):
        assert not quant_gemm.supports(other)


@pytest.mark.parametrize("encoding", ["Q8_K", "I4_G48", "TQ1_0"])
def test_an_encoding_without_a_kernel_is_refused(encoding):
    x = randn(1, 256)
    data = torch.zeros(N, 292, dtype=torch.uint8, device=DEVICE)
    for call in (
        lambda: quant_gemm.packed_linear(x, data, encoding),
        lambda: quant_gemm.packed_linear_reference(x, data, encoding),
        lambda: quant_gemm.dequantize(data, encoding, 256),
    ):
        with pytest.raises(ValueError, match=f"no kernel for encoding '{encoding}'.*Q4_K"):
            call()


def test_bad_operands_are_named():
    data = packed_bytes("Q8_0", N, 64)
    with pytest.raises(ValueError, match=r"data: Q8_0 rows of 96 columns take 102 bytes, got 68"):
        quant_gemm.packed_linear(randn(1, 96), data, "Q8_0")
    with pytest.raises(ValueError, match="multiple of 32 columns, not 60"):
        quant_gemm.packed_linear(randn(1, 60), data, "Q8_0")
    with pytest.raises(ValueError, match="data: expected uint8"):
        quant_gemm.packed_linear(randn(1, 64), data.to(torch.int16), "Q8_0")
    with pytest.raises(ValueError, match=r"bias: expected a float tensor of shape \(33,\)"):
        quant_gemm.packed_linear(randn(1, 64), data, "Q8_0", randn(32))
    with pytest.raises(ValueError, match="x: dtype torch.int64"):
        quant_gemm.packed_linear(torch.ones(1, 64, dtype=torch.int64, device=DEVICE), data, "Q8_0")
    with pytest.raises(ValueError, match="x: expected 2 dims"):
        quant_gemm.packed_linear(randn(64), data, "Q8_0")
    with pytest.raises(ValueError, match="splits"):
        quant_gemm.packed_linear(randn(1, 64), data, "Q8_0", splits=0)


# --------------------------------------------------------------------------- PackedLinear


@pytest.fixture
def kernels_here(monkeypatch):
    """PackedLinear sends this machine's tensors to the kernels (on CPU: the interpreter)
    and counts the calls."""
    calls = []
    real = quant_gemm.packed_linear

    def counted(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(quant_linear, "_KERNEL_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(quant_gemm, "packed_linear", counted)
    return calls


def packed_weight(encoding, rows, cols, *, perm=None, offsets=None) -> PackedWeight:
    data = packed_bytes(encoding, rows, cols).cpu()
    return PackedWeight(encoding, (rows, cols), data, layouts.dequantize, "w", perm, offsets)


def expected_linear(packed: PackedWeight, x: torch.Tensor, bias=None) -> torch.Tensor:
    """x @ W.T + bias with W the packed weight's own values (perm and offsets applied)."""
    out = x.float().cpu() @ packed.dequantize().T
    return out if bias is None else out + bias.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6, 40])
def test_packed_linear_module_runs_the_kernels(kernels_here, rows, dtype):
    packed = packed_weight("I4_G32", N, 64)
    bias = randn(N, seed=2).cpu()
    module = quant_linear.PackedLinear(packed, bias).to(DEVICE)
    x = randn(2, rows, 64, dtype=dtype)  # leading dims are flattened and restored
    out = module(x)
    assert kernels_here == ["I4_G32"]
    assert out.dtype == dtype and out.shape == (2, rows, N)
    assert_matches(out.cpu(), expected_linear(packed, x.reshape(-1, 64), bias).view(2, rows, N).to(dtype), dtype)


def test_packed_linear_module_applies_column_order_and_offsets(kernels_here):
    cols, groups = 128, 4
    perm = torch.randperm(cols, generator=torch.Generator().manual_seed(3))
    offsets = randn(N, groups, seed=4).cpu() * 0.01
    packed = packed_weight("I4_G32", N, cols, perm=perm, offsets=offsets)
    module = quant_linear.PackedLinear(packed, None).to(DEVICE)
    x = randn(5, cols)
    out = module(x)
    assert kernels_here == ["I4_G32"]
    assert_matches(out.cpu(), expected_linear(packed, x), torch.float32)


def test_packed_parts_run_each_part_through_the_kernels(kernels_here):
    from pyagent_framework.interfaces import PackedParts

    parts = (packed_weight("Q4_K", 16, 256), packed_weight("Q6_K", 8, 256))
    module = quant_linear.PackedPartsLinear(PackedParts(parts, "qkv")).to(DEVICE)
    x = randn(3, 256)
    out = module(x)
    assert kernels_here == ["Q4_K", "Q6_K"]
    expected = torch.cat([expected_linear(p, x) for p in parts], dim=1)
    assert_matches(out.cpu(), expected, torch.float32)


def test_cpu_inputs_keep_the_cpu_path(monkeypatch):
    """Without the test switch, CPU tensors never reach the Triton kernels."""
    monkeypatch.setattr(quant_gemm, "packed_linear", lambda *a, **k: pytest.fail("reached the Triton kernel"))
    packed = packed_weight("I8", N, 64)
    module = quant_linear.PackedLinear(packed)
    x = torch.randn(3, 64)
    torch.testing.assert_close(module(x), expected_linear(packed, x), rtol=1e-5, atol=1e-5)


def test_every_encoding_the_packing_quantizers_compute_has_a_kernel():
    from pyagent_quant import prequantized, quantizers

    produced = {"I8", *(f"I4_G{g}" for g in layouts.INT4_GROUPS)}
    assert produced | layouts.GGUF_ENCODINGS | prequantized.ENCODINGS <= set(quant_gemm.encodings())
    assert quant_linear.triton_encodings() == set(quant_gemm.encodings())
    for cls in (quantizers.Int8Quantizer, quantizers.Int4Quantizer, quantizers.GGUFQuantizer,
                quantizers.PrequantizedQuantizer):
        assert cls.supported_devices == ("cpu", "cuda")


# --------------------------------------------------------------------------- GPU only


@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 256])
@pytest.mark.parametrize("encoding", ["I8", "I4_G128", "Q4_K", "Q6_K", "Q8_0"])
def test_llama3_8b_shapes_on_the_gpu(encoding, m):
    n, k = 4096, 4096
    data = packed_bytes(encoding, n, k)
    x = randn(m, k, dtype=torch.bfloat16)
    ref = quant_gemm.packed_linear_reference(x, data, encoding)
    assert_matches(quant_gemm.packed_linear(x, data, encoding), ref, torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("quantization, options", [("int8", None), ("int4", '{"group_size": 64}')])
def test_engine_on_cuda_decodes_as_on_cpu(tmp_path, monkeypatch, quantization, options):
    """A tiny Llama quantized on load: greedy tokens on the GPU (packed weights on the
    device, Triton kernels) equal the CPU path's."""
    from tests.tiny_models import tiny_checkpoint

    from pyagent_framework import LLM, SamplingParams

    path = tiny_checkpoint("llama", tmp_path)
    prompts = ["The quick brown fox", "Paged attention stores keys", "def add(a, b):"]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    engine = dict(quantization=quantization, quantization_config=options, dtype="float32", kv_cache_memory="16MiB",
                  max_model_len=128)
    cpu = [o.outputs[0].token_ids for o in LLM(path, device="cpu", **engine).generate(prompts, params)]
    calls = []
    real = quant_gemm.packed_linear

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(quant_gemm, "packed_linear", counted)
    gpu = [o.outputs[0].token_ids for o in LLM(path, device="cuda", **engine).generate(prompts, params)]
    assert calls and all(d.device.type == "cuda" and d.dtype == torch.uint8 for d in calls)
    assert gpu == cpu

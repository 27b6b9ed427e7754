"""The quantized modules off the CPU path: packed weights that follow their module to
another device as bytes, the torch decoders on the weight's device, and FP8Linear's
float8 GEMM (``torch._scaled_mm``) on CUDA devices of compute capability 8.9 or newer.

The CUDA tests are skipped without a GPU; on CPU the float8 GEMM must never be reached.
The Triton kernels PackedLinear uses on a GPU are tested in kernels/tests/test_quant_gemm.py.
"""

from __future__ import annotations

import pytest
import torch

from pyagent_framework.interfaces import PackedWeight
from pyagent_quant import encodings, linear, quantizers
from pyagent_quant.linear import PackedEmbedding, PackedLinear
from pyagent_quant.quantizers import FP8Linear

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
FP8_GEMM = CUDA and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9)


def weight(rows=48, cols=64, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def widened(module: FP8Linear, x: torch.Tensor) -> torch.Tensor:
    """The float8 weights widened to float32, times x in float32."""
    w = module.weight.float().cpu() * module.scale.cpu()
    out = x.float().cpu() @ w.T
    return out if module.bias is None else out + module.bias.cpu()


# -- packed weights follow their module -----------------------------------------------------


def test_packed_weight_follows_the_buffer_as_bytes():
    packed = encodings.quantize_i4(weight(), 32, "w")
    perm = torch.randperm(64)
    packed = PackedWeight(packed.encoding, packed.shape, packed.data, packed.decode, "w", perm, torch.zeros(48, 2))
    module = PackedLinear(packed, torch.zeros(48)).to("meta")
    assert module.data.device.type == "meta" and module.data.dtype == torch.uint8
    assert module.packed.data is module.data  # no copy left behind on the CPU
    assert module.packed.perm.device.type == "meta" and module.packed.offsets.device.type == "meta"
    assert module.native_operand() is None  # the native core reads CPU bytes only
    embedding = PackedEmbedding(encodings.quantize_i8(weight(), "e")).to("meta")
    assert embedding.packed.data is embedding.data and embedding.data.dtype == torch.uint8


def test_a_module_kept_on_the_cpu_keeps_its_paths():
    packed = encodings.quantize_i8(weight(), "w")
    module = PackedLinear(packed, torch.ones(48)).to(torch.float32)  # .to() that moves nothing
    assert module.packed is packed
    if linear.native_available():
        assert module.native_operand()["data"] is not None
    x = torch.randn(3, 64)
    torch.testing.assert_close(module(x), x @ encodings.dequantize(packed).T + 1, rtol=1e-5, atol=1e-5)


# -- fp8 -------------------------------------------------------------------------------------


def test_fp8_on_cpu_never_reaches_the_float8_gemm(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch._scaled_mm called on CPU")

    monkeypatch.setattr(torch, "_scaled_mm", refuse, raising=False)
    module = FP8Linear(weight(), torch.randn(48))
    assert module.scaled_mm  # the shape qualifies; the device does not
    x = torch.randn(5, 64)
    torch.testing.assert_close(module(x), widened(module, x), rtol=1e-6, atol=1e-6)


def test_fp8_shapes_the_float8_gemm_cannot_take_keep_the_widened_product():
    assert not FP8Linear(weight(48, 40)).scaled_mm  # in_features not a multiple of 16
    assert not FP8Linear(weight(40, 64)).scaled_mm


@pytest.mark.skipif(not FP8_GEMM, reason="needs a CUDA GPU of compute capability >= 8.9")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fp8_float8_gemm_matches_the_widened_reference(monkeypatch, rows, dtype):
    calls = []
    real = torch._scaled_mm

    def counted(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counted)
    module = FP8Linear(weight(256, 512), torch.randn(256) * 0.1).to("cuda")
    x = torch.randn(2, rows, 512, device="cuda").to(dtype)
    out = module(x)
    assert calls == [torch.float8_e4m3fn] and module.scaled_mm
    assert out.dtype == dtype and out.shape == (2, rows, 256)
    expected = widened(module, x.reshape(-1, 512)).view(2, rows, 256)
    # x rounded to e4m3 (2^-4 relative steps at most) and a bfloat16 result: a few % of the norm.
    error = float((out.float().cpu() - expected).norm() / expected.norm())
    assert error < 0.05, error


# -- packed weights on a GPU without the Triton kernels ---------------------------------------


@needs_cuda
@pytest.mark.parametrize("encoding", ["I8", "I4_G64", "Q6_K"])
def test_torch_decoders_on_the_gpu(monkeypatch, quant_helpers, encoding):
    """With the kernels switched off, a GPU input is computed from the GPU copy of the
    bytes by the torch decoders (no CPU copy needed)."""
    monkeypatch.setattr(linear, "_KERNEL_DEVICES", ())
    packed = quant_helpers.packed_weight(encoding, 40, 256)
    module = PackedLinear(packed, torch.randn(40)).to("cuda")
    x = torch.randn(3, 256)
    out = module(x.cuda())
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), x @ encodings.dequantize(packed).T + module.bias.cpu(), rtol=1e-4, atol=1e-4)


def test_packing_quantizers_run_on_cuda_too():
    for cls in (quantizers.Int8Quantizer, quantizers.Int4Quantizer, quantizers.GGUFQuantizer,
                quantizers.PrequantizedQuantizer, quantizers.FP8Quantizer):
        assert "cuda" in cls.supported_devices and "cpu" in cls.supported_devices

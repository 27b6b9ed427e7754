"""The quantizers: ``int8``, ``int4``, ``gguf``, ``prequantized`` and ``fp8``.

``int8`` and ``int4`` quantize a checkpoint's float weights when the model loads;
``gguf`` computes from a GGUF file's quantized tensors as stored, ``prequantized``
from a GPTQ/AWQ/compressed-tensors checkpoint's, repacked; ``fp8`` keeps
weights as float8 e4m3. A tied embedding and output head (one weight, two uses) is
quantized once and serves both (``pack`` + ``make_embedding``), so the model's largest
matrix shrinks too.
"""

from __future__ import annotations

import functools
from abc import abstractmethod

import torch
import torch.nn.functional as F

from pyagent_framework.interfaces import PackedParts, PackedWeight, Quantizer

from . import encodings, prequantized
from .linear import ACTIVATIONS, PackedEmbedding, PackedLinear, PackedPartsLinear, native_available


def _float_weight(weight, quantizer: str) -> torch.Tensor:
    if isinstance(weight, PackedWeight | PackedParts):
        weight = weight.dequantize()
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        shape = tuple(getattr(weight, "shape", ()))
        raise ValueError(f"quantization {quantizer!r}: a linear weight must be 2-D [out, in], got shape {shape}")
    if not weight.is_floating_point():
        raise ValueError(f"quantization {quantizer!r}: a linear weight must be floating point, got {weight.dtype}")
    return weight


# Every encoding the packing quantizers below compute (I8, I4_G32/64/128 and the GGUF
# types they read) has a Triton kernel in pyagent-triton (``quant_gemm``; the kernels'
# tests check that the lists agree), so on a GPU they compute from the packed bytes.
# Without pyagent-triton a GPU input takes the torch decoders, a slice of rows at a time.
_PACKED_DEVICES = ("cpu", "cuda")


class _PackingQuantizer(Quantizer):
    """Quantizes float weights into a packed encoding and computes with PackedLinear."""

    name = ""
    supported_devices = _PACKED_DEVICES

    @abstractmethod
    def pack(self, weight) -> PackedWeight:
        """The float ``weight`` in this quantizer's packed encoding."""

    def make_linear(self, weight, bias=None) -> PackedLinear:
        if not isinstance(weight, PackedWeight):
            weight = self.pack(_float_weight(weight, self.name))
        return PackedLinear(weight, bias)

    def make_embedding(self, packed: PackedWeight) -> PackedEmbedding:
        return PackedEmbedding(packed)


class Int8Quantizer(_PackingQuantizer):
    """Weight-only int8, one symmetric scale per output channel (``I8``)."""

    name = "int8"

    def __init__(self, **options) -> None:
        if options:
            raise TypeError(f"quantizer 'int8' takes no options, got {sorted(options)}")

    def pack(self, weight) -> PackedWeight:
        return encodings.quantize_i8(_float_weight(weight, self.name))


class Int4Quantizer(_PackingQuantizer):
    """Weight-only int4, asymmetric (scale and minimum) per group of ``group_size``
    input columns (32, 64 or 128; default 32). A tied embedding/output head is kept in
    int8 (``I8``), as GGUF files keep it in Q8_0: int4 there costs the most quality
    for the least memory."""

    name = "int4"

    def __init__(self, group_size: int = 32) -> None:
        if type(group_size) is not int or group_size not in encodings.INT4_GROUPS:
            raise ValueError(f"group_size must be one of {encodings.INT4_GROUPS}, got {group_size!r}")
        self.group_size = group_size

    def make_linear(self, weight, bias=None) -> PackedLinear:
        if not isinstance(weight, PackedWeight):
            weight = encodings.quantize_i4(_float_weight(weight, self.name), self.group_size)
        return PackedLinear(weight, bias)

    def pack(self, weight) -> PackedWeight:  # a tied embedding/head: see the class docstring
        return encodings.quantize_i8(_float_weight(weight, self.name))


class GGUFQuantizer(Quantizer):
    """A GGUF file's quantized tensors, computed as stored: ``Q8_0``, ``Q6_K``,
    ``Q5_K``, ``Q5_1``, ``Q5_0``, ``Q4_K``, ``Q4_1``, ``Q4_0``, ``IQ4_NL``, ``Q3_K`` and
    ``Q2_K`` (every type of llama-quantize's ``Q2_K`` … ``Q8_0`` mixes). A fused layer
    whose parts the file keeps in different types (an ``_M`` mix's ``v``) is computed
    part by part.

    Linear weights in other types (and float ones) arrive dequantized (the GGUF format
    logs which) and are computed in float32: with the native core's small-batch
    kernel when it is installed, else by torch.

    Option ``activations``, how x enters the products of the native kernels:

    - ``"int16"`` (default): x is rounded to 16 bits per block of 32 (an error of at
      most max|x_b| / 65024 per element; no measurable perplexity cost) and multiplied
      in integers, as two int8 rows, by the AVX-512 VNNI build's integer GEMM for
      ``Q4_0``/``Q4_1``/``Q8_0``/``Q5_0``/``Q5_1``/``IQ4_NL``/``Q4_K``/``Q5_K``/``Q6_K``
      (about 1.7x the float kernels for one row, 2x for 4-64 rows). Products
      without that kernel (another build or encoding, one row against ``Q8_0``, under
      four rows against the decoded encodings) compute in float32.
    - ``"float32"``: results within float rounding of the dequantized model (the
      reference the tests hold the others to).
    - ``"int8"``: x is rounded to int8 per block of 32, as llama.cpp does (~1% error
      per product; about +1% perplexity on SmolLM2): one-row ``Q4_0``/``Q4_1``
      products in the native AVX2 and AVX-512 builds (about 1.4x faster), and several
      rows in the VNNI GEMM (2-3.5x the float GEMM at 32-64 rows)."""

    name = "gguf"
    supported_devices = _PACKED_DEVICES
    packed_encodings = encodings.GGUF_ENCODINGS
    needs_packed = True

    def __init__(self, activations: str = "int16") -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activations!r}")
        self.activations = activations

    def make_linear(self, weight, bias=None):
        if isinstance(weight, PackedWeight | PackedParts):
            unread = sorted((weight.encodings if isinstance(weight, PackedParts) else {weight.encoding}) - self.packed_encodings)
            if unread:
                raise ValueError(
                    f"quantization {self.name!r}: tensor {weight.name!r} has type {', '.join(unread)}, which it does not read "
                    f"(it reads {', '.join(sorted(self.packed_encodings))})"
                )
            if isinstance(weight, PackedParts):
                return PackedPartsLinear(weight, bias, activations=self.activations)
            return PackedLinear(weight, bias, activations=self.activations)
        weight = _float_weight(weight, self.name).float().contiguous()
        if native_available():
            from pyagent_native.linear import NativeLinear

            return NativeLinear(weight, bias)
        from pyagent_framework import registries

        return registries.quantizers.load("none")().make_linear(weight, bias)  # the kernel's float linear

    def make_embedding(self, packed: PackedWeight) -> PackedEmbedding:
        return PackedEmbedding(packed)


class PrequantizedQuantizer(GGUFQuantizer):
    """A GPTQ, AWQ or compressed-tensors checkpoint's quantized weights, computed as
    stored: repacked on load (``pyagent_quant.prequantized``) into ``I4_G{32,64,128}``,
    ``I8`` or ``Q8_0``, with the act-order column order and the zero-point offsets the
    packed weight carries. The default for such checkpoints; takes no options. x enters
    the products in float32, as these checkpoints' own kernels take 16-bit activations
    (W4A16 / W8A16).

    Linear weights that have no exact packed form, and float ones, are computed in
    float32 (the native core's small-batch kernel when installed, else torch)."""

    name = "prequantized"
    packed_encodings = prequantized.ENCODINGS

    def __init__(self, **options) -> None:
        if options:
            raise TypeError(f"quantizer 'prequantized' takes no options, got {sorted(options)}")
        super().__init__(activations="float32")


_FP8_MAX = 448.0  # e4m3's largest finite value


@functools.cache
def _scaled_mm_device(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` multiplies float8 on ``device`` (CUDA, compute
    capability 8.9 or newer: Ada, Hopper and later)."""
    return (
        device.type == "cuda"
        and hasattr(torch, "_scaled_mm")
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )


class FP8Linear(torch.nn.Module):
    """``x @ (scale * W8).T + bias`` with ``W8`` in float8 e4m3 and one float32 scale
    per output channel; the weight is widened a slice at a time for the product.

    On a CUDA device of compute capability 8.9 or newer (and ``in``/``out`` features
    multiples of 16, as the float8 GEMM requires) the product runs on the float8 tensor
    cores instead (``torch._scaled_mm``): x is rounded to e4m3 with one scale per row
    (its largest magnitude maps to 448), the GEMM applies both row scales and writes
    bfloat16, and the bias is added in float32. Rounding x costs about e4m3's 2^-4
    relative step per element on top of the weight's; a device or configuration the
    GEMM refuses falls back to the widened product for good."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        # e4m3's largest finite value is 448: each row's largest magnitude maps to it.
        scale = w.abs().amax(dim=1, keepdim=True) / _FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        self.register_buffer("weight", (w / scale).to(torch.float8_e4m3fn))
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.out_features, self.in_features = w.shape
        self.scaled_mm = self.in_features % 16 == 0 and self.out_features % 16 == 0

    def _forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor | None:
        """The float8 GEMM's result, or None where it cannot run (then never again)."""
        flat = x.reshape(-1, self.in_features).float()
        if flat.shape[0] == 0:
            return None
        x_scale = (flat.abs().amax(dim=1, keepdim=True) / _FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)
        x8 = (flat / x_scale).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        try:
            out = torch._scaled_mm(
                x8, self.weight.t(), scale_a=x_scale, scale_b=self.scale.view(1, -1), out_dtype=torch.bfloat16
            )
        except (RuntimeError, TypeError):  # this torch or device refuses row-wise float8 scales
            self.scaled_mm = False
            return None
        out = out.float()
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled_mm and x.device.type == "cuda" and not x.requires_grad and _scaled_mm_device(x.device):
            out = self._forward_scaled_mm(x)
            if out is not None:
                return out
        dtype = x.dtype
        x = x.float()
        parts = []
        for start in range(0, self.out_features, 1024):
            w = self.weight[start : start + 1024].float() * self.scale[start : start + 1024]
            parts.append(F.linear(x, w))
        out = torch.cat(parts, dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.to(dtype)


class FP8Quantizer(Quantizer):
    """Weight-only float8 (e4m3) with a per-output-channel scale, where torch has the
    dtype (torch >= 2.1). Memory is one byte per weight; the product widens the weight
    to float32 slice by slice, so on CPU it is slower than float32. On CUDA devices of
    compute capability 8.9 or newer it runs on the float8 tensor cores, with x rounded
    to e4m3 per row (see :class:`FP8Linear`)."""

    supported_devices = ("cpu", "cuda")

    def __init__(self, **options) -> None:
        if options:
            raise TypeError(f"quantizer 'fp8' takes no options, got {sorted(options)}")
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(f"quantization 'fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks")

    def make_linear(self, weight, bias=None) -> FP8Linear:
        return FP8Linear(_float_weight(weight, "fp8"), bias)

"""Quantizer ``native``: unquantized float32 weights, with the few-row matmuls of
decode steps computed by the native core.

A decode step multiplies one row (or a few) by every weight matrix, so it is bound by
how fast the weights stream from memory. On this kind of CPU torch's GEMV reads them
at about half the machine's bandwidth; the native kernel streams each weight once,
four output features at a time, with every input row applied while they are in L1,
and measured 1.3-3x faster for 1-16 rows (``benchmarks/native_kernels.py``). Past
``NativeLinear.max_rows`` rows the work is compute-bound and torch's GEMM wins, so
larger batches (prefill) go to ``torch.nn.functional.linear``.

The weight tensor is kept as given, never copied, so a tied output head stays tied
(``keeps_weights``) and the model's memory does not grow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyagent_framework.interfaces import Quantizer

from pyagent_native import _core

# Output heads wider than _WIDE features are computed in slices of _SLICE features when
# torch does the work: each slice's output stays in cache (same numbers, faster).
_WIDE = 8192
_SLICE = 2048


class NativeLinear(torch.nn.Module):
    """``x @ weight.T + bias``; up to ``max_rows`` rows in the native core."""

    max_rows = 32
    isa = "auto"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(
                f"quantization 'native' needs 2-D float32 CPU weights, got {tuple(weight.shape)} "
                f"{weight.dtype} on {weight.device}"
            )
        if not weight.is_contiguous():
            raise ValueError("quantization 'native' needs contiguous weights")
        self.out_features, self.in_features = weight.shape
        # Parameters that share the given storage (no copy; a tied head stays tied).
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        self._weight_array = self.weight.detach().numpy()
        self._bias_array = None if self.bias is None else self.bias.detach().numpy()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    def native_operand(self) -> dict:
        """How the core's fused decoder reads this layer (see :mod:`pyagent_native.fused`)."""
        return {"weight": self._weight_array, "bias": self._bias_array}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if self.in_features else 0
        if 0 < rows <= self.max_rows and x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad:
            flat = x.reshape(rows, self.in_features).contiguous()
            out = torch.empty(rows, self.out_features, dtype=torch.float32)
            _core.linear(
                out.numpy(), flat.detach().numpy(), self._weight_array, self._bias_array, torch.get_num_threads(), self.isa
            )
            return out.view(*x.shape[:-1], self.out_features)
        if self.out_features > _WIDE and self.bias is None:
            return torch.cat([F.linear(x, w) for w in self.weight.split(_SLICE)], dim=-1)
        return F.linear(x, self.weight, self.bias)


class NativeQuantizer(Quantizer):
    """Unquantized float32 linears with the native small-batch kernel (see module)."""

    supported_devices = ("cpu",)
    #: make_linear keeps the weight tensor it is given, so shared (tied) weights may be
    #: replaced too without untying them.
    keeps_weights = True

    def make_linear(self, weight, bias=None):
        return NativeLinear(weight, bias)

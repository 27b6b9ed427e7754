from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyagent_framework.interfaces import Quantizer


class UnquantizedLinear(nn.Module):
    """``x @ weight.T + bias`` with the weight kept as given."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Unquantized(Quantizer):
    """The default: no quantization."""

    supported_devices = ("cpu", "cuda", "mps", "xpu")

    def __init__(self, **options) -> None:
        if options:
            raise TypeError(f"quantizer 'none' takes no options, got {sorted(options)}")

    def make_linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> UnquantizedLinear:
        if weight.dim() != 2:
            raise ValueError(f"linear weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
        return UnquantizedLinear(weight, bias)

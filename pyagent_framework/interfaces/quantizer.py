from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Quantizer(ABC):
    """Turns a linear layer's weight into the module that computes the layer.

    Built as ``cls(**options)``. ``make_linear(weight, bias)`` receives the checkpoint
    weight (``[out_features, in_features]``) and returns a ``torch.nn.Module`` whose
    ``forward(x)`` computes ``x @ weight.T + bias`` (up to the quantizer's error).
    ``supported_devices`` names the torch device types it runs on.

    Optional: ``keeps_weights = True`` declares that the module computes from the very
    weight tensor it is given (no copy, no conversion); the engine then also replaces
    linears whose weight is shared, such as a tied output head, since the tie holds.
    """

    __required_attributes__ = ("supported_devices",)
    supported_devices: tuple[str, ...]

    @abstractmethod
    def make_linear(self, weight: Any, bias: Any = None) -> Any: ...

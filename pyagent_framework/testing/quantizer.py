"""A conformance kit for quantizers, to subclass in a plugin's tests.

```python
from pyagent_framework.testing.quantizer import QuantizerContract

class TestMyQuantizer(QuantizerContract):
    quantizer_name = "my-quantizer"
    options = {"group_size": 64}  # what --quantization-config gives
    relative_error = 0.01  # the error the quantizer declares: |out - ref| / |ref|
```

``make_linear(weight, bias)`` is checked against ``torch.nn.functional.linear`` on the
original float32 weights (the plain torch reference), on CPU, for several shapes and
batch sizes, with and without a bias:

- the output has the reference's shape and dtype, and its relative error
  ``||out - ref|| / ||ref||`` (over the whole output) is at most ``relative_error``;
- the bias is added as given (with minus without bias is the bias);
- each row is computed on its own (a row alone equals the same row in a batch, as the
  engine's batches mix requests), and the same input gives the same output;
- neither the input nor the checkpoint weight is changed;
- a weight that is not 2-D is refused with ``ValueError``.

A quantizer with ``needs_packed = True`` (it reads a checkpoint's own encoding) is
skipped: its tests give it packed weights.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pyagent_framework import registries
from pyagent_framework.interfaces import Quantizer
from pyagent_framework.testing.registration import check_interface

#: (out_features, in_features): in_features a multiple of 256 or of 32, as group
#: quantizers need; one odd row count.
SHAPES = ((48, 96), (130, 256), (64, 512))
ROWS = (1, 7, 33)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def check_linear(quantizer: Quantizer, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, bound: float, label: str = "") -> torch.Tensor:
    """One layer against ``F.linear``; returns its output."""
    weight_before, x_before = weight.clone(), x.clone()
    layer = quantizer.make_linear(weight, bias)
    assert torch.equal(weight, weight_before), f"{label}: make_linear() changed the checkpoint weight it was given"
    with torch.no_grad():
        out = layer(x)
        again = layer(x)
    assert torch.equal(x, x_before), f"{label}: forward changed its input"
    expected = F.linear(x, weight, bias)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(expected.shape), (
        f"{label}: output shape\n  expected: {tuple(expected.shape)}\n  actual:   {tuple(getattr(out, 'shape', ()))}"
    )
    assert out.dtype == x.dtype, f"{label}: the output must have the input's dtype\n  expected: {x.dtype}\n  actual:   {out.dtype}"
    assert torch.equal(out, again), f"{label}: the same input gave a different output"
    error = relative_error(out, expected)
    assert error <= bound, (
        f"{label}: relative error against F.linear on the float weights\n  expected: <= {bound:g}\n  actual:   {error:.3g}"
    )
    return out


class QuantizerContract:
    """Subclass with ``quantizer_name``, ``options`` and the declared ``relative_error``."""

    quantizer_name: str = ""
    options: dict[str, Any] = {}
    #: The most ``||out - ref|| / ||ref||`` may be, for weights ~ N(0, 1) and inputs ~ N(0, 1).
    relative_error: float | None = None
    shapes: tuple[tuple[int, int], ...] = SHAPES

    @pytest.fixture
    def quantizer(self) -> Quantizer:
        assert self.quantizer_name, "set quantizer_name on the test class"
        assert self.relative_error is not None, "declare relative_error (0 for an exact layer)"
        quantizer = registries.quantizers.load(self.quantizer_name)(**self.options)
        if getattr(quantizer, "needs_packed", False):
            pytest.skip("the quantizer reads packed checkpoint weights only")
        return quantizer

    def test_is_a_quantizer_for_cpu(self, quantizer):
        check_interface(quantizer, Quantizer)
        devices = quantizer.supported_devices
        assert isinstance(devices, tuple | list) and all(isinstance(d, str) for d in devices), f"supported_devices: {devices!r}"
        if "cpu" not in devices:
            pytest.skip("not a CPU quantizer")

    def test_close_to_the_float_linear(self, quantizer):
        g = torch.Generator().manual_seed(0)
        for out_features, in_features in self.shapes:
            weight = torch.randn(out_features, in_features, generator=g)
            bias = torch.randn(out_features, generator=g)
            for rows in ROWS:
                x = torch.randn(rows, in_features, generator=g)
                label = f"[{out_features}, {in_features}] weight, {rows} rows"
                with_bias = check_linear(quantizer, weight, bias, x, self.relative_error, label + ", bias")
                without = check_linear(quantizer, weight, None, x, self.relative_error, label)
                torch.testing.assert_close(with_bias - without, bias.expand_as(without), rtol=1e-4,
                                           atol=1e-4 * float(without.abs().max()) + 1e-5,
                                           msg=lambda m, label=label: f"{label}: with bias minus without must be the bias\n{m}")

    def test_rows_are_computed_on_their_own(self, quantizer):
        g = torch.Generator().manual_seed(1)
        out_features, in_features = self.shapes[-1]
        layer = quantizer.make_linear(torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g))
        x = torch.randn(17, in_features, generator=g)
        with torch.no_grad():
            batch = layer(x)
            for i in (0, 5, 16):
                alone = layer(x[i : i + 1])
                torch.testing.assert_close(alone, batch[i : i + 1], rtol=1e-4, atol=1e-4 * float(batch.abs().max()),
                                           msg=lambda m, i=i: f"row {i} alone differs from row {i} of a batch of 17\n{m}")

    def test_refuses_a_weight_that_is_not_2d(self, quantizer):
        with pytest.raises(ValueError):
            quantizer.make_linear(torch.randn(64))


__all__ = ["QuantizerContract", "ROWS", "SHAPES", "check_linear", "relative_error"]

"""The native SiLU-and-mul (the fused decoder's MLP activation) against float64
``x * sigmoid(x) * up``, for every build this CPU runs, one to three threads, rows of
any width (vector tails included) and inputs from tiny to far past exp's range."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pyagent_native import _core

ISAS = tuple(_core.available_isas())


def _reference(gate_up: np.ndarray) -> np.ndarray:
    n = gate_up.shape[1] // 2
    g, up = gate_up[:, :n].astype(np.float64), gate_up[:, n:].astype(np.float64)
    # x * sigmoid(x) in the form that cannot overflow for either sign
    sig = np.where(g >= 0, 1.0 / (1.0 + np.exp(-np.abs(g))), np.exp(-np.abs(g)) / (1.0 + np.exp(-np.abs(g))))
    return g * sig * up


def _native(gate_up: np.ndarray, threads: int, isa: str) -> np.ndarray:
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=np.float32)
    _core.silu_and_mul(out, gate_up, threads, isa)
    return out


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 70),
    n=st.integers(1, 1100),
    scale=st.sampled_from([1e-3, 1.0, 8.0, 60.0, 300.0]),
    threads=st.sampled_from([1, 2, 3]),
    isa=st.sampled_from(ISAS),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_float64_reference(rows, n, scale, threads, isa, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * n, generator=gen) * scale).numpy()
    got = _native(gate_up, threads, isa).astype(np.float64)
    want = _reference(gate_up)
    # a few float32 ulp of each product: exp within ~1 ulp, then a divide and two products;
    # below -87 silu is a signed zero, |exact| < 1.4e-36 times |up|
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=1.4e-36 * np.abs(gate_up[:, n:]).max() + 1e-38)


@pytest.mark.parametrize("isa", ISAS)
def test_extremes(isa):
    g = np.array([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 100.0, -100.0, 1e4, -1e4, 3.0e38, -3.0e38], np.float32)
    gate_up = np.concatenate([g, np.ones_like(g)])[None, :]
    got = _native(gate_up, 1, isa)[0]
    want = _reference(gate_up.astype(np.float64))[0]
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=4e-6, atol=1e-35)  # below -87: a signed zero
    assert got[8] == 1e4 and got[9] == 0.0  # silu saturates to x and to 0 (from below)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="even"):
        _core.silu_and_mul(np.empty((1, 1), np.float32), np.ones((1, 3), np.float32))
    with pytest.raises(ValueError, match=r"out.shape\[1\]"):
        _core.silu_and_mul(np.empty((1, 3), np.float32), np.ones((1, 4), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        _core.silu_and_mul(np.empty((1, 2), np.float32), np.ones((1, 4), np.float64))

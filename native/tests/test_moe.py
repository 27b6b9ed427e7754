"""The grouped mixture-of-experts kernel (``_core.MoeExperts``, csrc/moe.cpp) against
its torch twin (``pyagent_native.moe.grouped_experts_reference``) computed in float64
on the same weights dequantized by the reference (the ``gguf`` package for GGUF
encodings): float32 experts, packed ones in several encodings, a gate/up pair stored in
two encodings, batches from 0 to 40 tokens with top-2 and top-3 of 6 experts (some
experts idle), both instruction-set builds, one and two threads. Bad arguments are
ValueErrors that name them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from native.tests.quant_reference import ISAS, random_weight, reference_dequantize
from pyagent_native import _core
from pyagent_native.moe import NativeExperts, grouped_experts_reference

EXPERTS = 6
# name -> (gate/up encoding(s), down encoding, hidden, intermediate)
LAYOUTS = {
    "float32": ("float32", "float32", 36, 70),
    "Q8_0": ("Q8_0", "Q8_0", 64, 96),
    "Q4_0/Q6_K": ("Q4_0", "Q6_K", 64, 256),
    "Q4_K": ("Q4_K", "Q4_K", 256, 256),
    "I8": ("I8", "I8", 40, 72),
    "I4": ("I4", "I4", 64, 96),
    "parts Q4_1+Q8_0": (("Q4_1", "Q8_0"), "Q5_0", 64, 96),
}


def _operand(encoding: str, n: int, k: int, rng) -> tuple[dict, np.ndarray]:
    """An operand the core reads and its reference float weight [n, k]."""
    if encoding == "float32":
        w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        return {"weight": w, "bias": None}, w
    group = 32 if encoding == "I4" else 0
    data = random_weight(encoding, n, k, group, rng)
    return {"data": data, "encoding": encoding, "group": group}, reference_dequantize(data, encoding, k, group)


def _experts(layout: str, seed: int = 0, activations: str | None = None):
    """The core's experts (packed operands with ``activations`` when given), their
    float64 gate/up and down weights, and the hidden size."""
    gate_up_encoding, down_encoding, hidden, inter = LAYOUTS[layout]
    rng = np.random.default_rng(seed)
    described, gate_up, down = [], [], []
    for _ in range(EXPERTS):
        if isinstance(gate_up_encoding, tuple):
            (g, gw), (u, uw) = (_operand(enc, inter, hidden, rng) for enc in gate_up_encoding)
            gu, guw = {"parts": [g, u]}, np.concatenate([gw, uw])
        else:
            gu, guw = _operand(gate_up_encoding, 2 * inter, hidden, rng)
        d, dw = _operand(down_encoding, hidden, inter, rng)
        if activations is not None:
            for operand in gu.get("parts", [gu]) + [d]:
                operand["activations"] = activations
        described.append({"gate_up": gu, "down": d})
        gate_up.append(torch.from_numpy(np.asarray(guw, np.float64)))
        down.append(torch.from_numpy(np.asarray(dw, np.float64)))
    return _core.MoeExperts(hidden, inter, described), gate_up, down, hidden


def _routing(tokens: int, k: int, seed: int):
    """Distinct experts per token (as top-k gives), chosen from the first five of the
    six, so one expert is always idle; random positive weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS - 1, generator=gen)[:k] for _ in range(tokens)]) if tokens else (
        torch.zeros(0, k, dtype=torch.int64)
    )
    weights = torch.rand(tokens, k, generator=gen, dtype=torch.float32) + 0.1
    return ids, weights


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_experts_match_the_torch_twin(layout, isa):
    core, gate_up, down, hidden = _experts(layout)
    for tokens, k, threads in ((1, 2, 1), (5, 3, 2), (40, 2, 2), (0, 2, 1)):
        ids, weights = _routing(tokens, k, seed=tokens)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens + 1))
        out = np.full((tokens, hidden), np.nan, np.float32)
        core.forward(out, x.numpy(), ids.numpy(), weights.numpy(), threads, isa)
        want = grouped_experts_reference(x.double(), ids, weights.double(), gate_up, down).numpy()
        scale = np.abs(want).max() if tokens else 1.0
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{layout} T={tokens} k={k}")


def test_reference_twin_is_the_per_token_definition():
    """The twin itself: for every token, the sum of routing weight times
    down(silu(gate) * up) over its experts, computed one token at a time."""
    _, gate_up, down, hidden = _experts("float32")
    ids, weights = _routing(9, 3, seed=4)
    x = torch.randn(9, hidden, dtype=torch.float64)
    got = grouped_experts_reference(x, ids, weights.double(), gate_up, down)
    for t in range(9):
        want = torch.zeros(hidden, dtype=torch.float64)
        for e, w in zip(ids[t].tolist(), weights[t].double(), strict=True):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            want += w * (down[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(got[t], want, rtol=1e-12, atol=1e-12)


def test_native_experts_from_modules():
    """NativeExperts.build reads float nn.Linear experts; the result equals the twin.
    A PackedParts-like gate_up not split as gate/up is declined (None)."""

    class Expert(torch.nn.Module):
        def __init__(self, hidden, inter):
            super().__init__()
            self.gate_up_proj = torch.nn.Linear(hidden, 2 * inter, bias=False)
            self.down_proj = torch.nn.Linear(inter, hidden, bias=False)

    torch.manual_seed(0)
    experts = [Expert(32, 48) for _ in range(EXPERTS)]
    native = NativeExperts.build(experts, 32, 48)
    assert native is not None and len(native) == EXPERTS
    ids, weights = _routing(7, 2, seed=3)
    x = torch.randn(7, 32)
    want = grouped_experts_reference(
        x.double(), ids, weights.double(),
        [e.gate_up_proj.weight.double() for e in experts], [e.down_proj.weight.double() for e in experts],
    )
    torch.testing.assert_close(native(x, ids, weights).double(), want, rtol=1e-5, atol=1e-6)

    class Uneven(torch.nn.Module):  # parts of 40 + 56 rows: not gate | up
        def native_operand(self):
            rng = np.random.default_rng(0)
            return {"parts": [{"weight": rng.standard_normal((40, 32)).astype(np.float32)},
                              {"weight": rng.standard_normal((56, 32)).astype(np.float32)}]}

    experts[2].gate_up_proj = Uneven()
    assert NativeExperts.build(experts, 32, 48) is None


def test_bad_arguments_are_value_errors():
    core, _, _, hidden = _experts("Q8_0")
    x = np.zeros((2, hidden), np.float32)
    out = np.zeros((2, hidden), np.float32)
    weights = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match=r"expert_ids\[1, 0\] = 6 is not one of the 6 experts"):
        core.forward(out, x, np.array([[0, 1], [6, 2]], np.int64), weights)
    with pytest.raises(ValueError, match=r"routing_weights\.shape\[1\] is 3, expected 2"):
        core.forward(out, x, np.array([[0, 1], [3, 2]], np.int64), np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"x\.shape\[1\] is 8"):
        core.forward(out, np.zeros((2, 8), np.float32), np.zeros((2, 2), np.int64), weights)
    rng = np.random.default_rng(0)
    good = {"data": random_weight("Q8_0", 64, 96, 0, rng), "encoding": "Q8_0", "group": 0}
    short = {"data": random_weight("Q8_0", 100, 64, 0, rng), "encoding": "Q8_0", "group": 0}
    with pytest.raises(ValueError, match=r"experts\[0\]\.gate_up\.data\.shape\[0\] is 100, expected 192"):
        _core.MoeExperts(64, 96, [{"gate_up": short, "down": good}])
    with pytest.raises(ValueError, match=r"experts\[0\]\.gate_up\.parts: expected two operands"):
        _core.MoeExperts(64, 96, [{"gate_up": {"parts": [short]}, "down": good}])
    gate_up = {"data": random_weight("Q8_0", 192, 64, 0, rng), "encoding": "Q8_0", "group": 0}
    assert len(_core.MoeExperts(64, 96, [{"gate_up": gate_up, "down": good}])) == 1
    with pytest.raises(ValueError, match=r"experts\[0\]\.down: .*Q9_9"):
        _core.MoeExperts(64, 96, [{"gate_up": gate_up, "down": {**good, "encoding": "Q9_9"}}])


@pytest.mark.parametrize("activations, tolerance", [("int16", 5e-4), ("int8", 5e-2)])
@pytest.mark.parametrize("layout", ["Q8_0", "Q4_0/Q6_K", "Q4_K", "parts Q4_1+Q8_0"])
def test_integer_activations_reach_the_experts(layout, activations, tolerance):
    """Operands with integer activations: within the rounding of x of the torch twin,
    and (where the build has the integer GEMM) not the float path's bits."""
    core, gate_up, down, hidden = _experts(layout, activations=activations)
    plain = _experts(layout)[0]
    ids, weights = _routing(40, 2, seed=7)
    x = torch.randn(40, hidden, generator=torch.Generator().manual_seed(8))
    out, exact = np.empty((40, hidden), np.float32), np.empty((40, hidden), np.float32)
    core.forward(out, x.numpy(), ids.numpy(), weights.numpy(), 2, "auto")
    plain.forward(exact, x.numpy(), ids.numpy(), weights.numpy(), 2, "auto")
    want = grouped_experts_reference(x.double(), ids, weights.double(), gate_up, down).numpy()
    scale = np.abs(want).max()
    np.testing.assert_allclose(out, want, rtol=0, atol=tolerance * scale)
    if _core.int8_gemm("Q8_0"):
        assert not np.array_equal(out, exact)

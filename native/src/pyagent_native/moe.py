"""The experts of a mixture-of-experts layer in one native call (``csrc/moe.cpp``), and
its torch twin.

:class:`NativeExperts` is built once per layer from its experts (modules with a fused
``gate_up_proj`` ``[2I, H]`` and a ``down_proj`` ``[H, I]``, as pyagent-hf's MoE
models hold them) when the core can read every expert's weights: float32
(``nn.Linear``, NativeLinear) or packed (PackedLinear; a PackedPartsLinear whose parts
are exactly gate and up). Called with the router's choices, it computes every expert's
rows grouped by expert (each expert's weight read once for all its tokens) on the
native thread pool, and the weighted sum per token.

:func:`grouped_experts_reference` computes the same in torch from float weights: the
reference the differential tests compare the core with.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from pyagent_native import _core
from pyagent_native.fused import linear_operand

logger = logging.getLogger(__name__)


def _rows(operand: dict) -> int:
    return (operand["weight"] if "weight" in operand else operand["data"]).shape[0]


def expert_operands(expert: Any, intermediate: int) -> dict | None:
    """``{"gate_up", "down"}`` operands of one expert as the core reads them, or None
    when it cannot (a weight it does not read, or parts it does not split as gate/up)."""
    gate_up, down = linear_operand(expert.gate_up_proj), linear_operand(expert.down_proj)
    if gate_up is None or down is None or "parts" in down:
        return None
    if "parts" in gate_up:
        parts = gate_up["parts"]
        if len(parts) != 2 or any("parts" in p or _rows(p) != intermediate for p in parts):
            return None
    return {"gate_up": gate_up, "down": down}


class NativeExperts:
    """One layer's experts in the core (see the module docstring)."""

    def __init__(self, core: Any, hidden: int) -> None:
        self._core = core
        self.hidden = hidden

    @classmethod
    def build(cls, experts: Sequence[Any], hidden: int, intermediate: int) -> NativeExperts | None:
        """From the layer's expert modules; None (logged) when one is not readable."""
        described = []
        for e, expert in enumerate(experts):
            operands = expert_operands(expert, intermediate)
            if operands is None:
                logger.info("expert %d (%s, %s) is not readable by the native core", e,
                            type(expert.gate_up_proj).__name__, type(expert.down_proj).__name__)
                return None
            described.append(operands)
        return cls(_core.MoeExperts(int(hidden), int(intermediate), described), int(hidden))

    def __len__(self) -> int:
        return len(self._core)

    def __call__(self, x: torch.Tensor, expert_ids: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        """``out[T, H]``: for each token, the sum over its ``k`` experts
        (``expert_ids [T, k]``) of ``routing_weights [T, k]`` times the expert's output."""
        flat = x.reshape(-1, self.hidden).float().contiguous()
        out = torch.empty_like(flat)
        self._core.forward(
            out.numpy(), flat.numpy(), expert_ids.to(torch.int64).contiguous().numpy(),
            routing_weights.float().contiguous().numpy(), torch.get_num_threads(),
        )
        return out.view(x.shape).to(x.dtype)


def grouped_experts_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    gate_up: Sequence[torch.Tensor],
    down: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The torch twin of :class:`NativeExperts` on float weights (``gate_up[e]``
    ``[2I, H]``, gate rows first; ``down[e]`` ``[H, I]``): each expert's tokens in one
    product, each token's weighted results summed in expert order."""
    tokens, k = expert_ids.shape
    out = torch.zeros_like(x)
    results = torch.zeros(tokens, k, x.shape[1], dtype=x.dtype)
    for e in range(len(gate_up)):
        token, slot = torch.nonzero(expert_ids == e, as_tuple=True)
        if token.numel():
            gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
            results[token, slot] = F.linear(F.silu(gate) * up, down[e]) * routing_weights[token, slot, None]
    for j in torch.argsort(expert_ids, dim=1).T:  # each token's slots in expert order
        out += results[torch.arange(tokens), j]
    return out

"""Mixture-of-experts variants of the Llama family: Mixtral and Qwen3-MoE.

Each MoE layer's feed-forward block is a :class:`SparseMoeBlock`: a router
(:class:`TopKRouter`) picks ``num_experts_per_tok`` experts per token, and the experts'
SwiGLU outputs, scaled by the routing weights, are summed.

Expert computation is grouped by expert: the batch's (token, slot) pairs are sorted by
expert, each expert that has tokens computes all of them at once (one ``gate_up``
product, SiLU-and-mul, one ``down`` product), and each token's scaled results are
gathered back and summed. A decode step of 32 sequences with 8 experts and top-2 thus
makes at most 8 × 2 products of up to 32 rows each, not 64 × 2 products of one row.
With the native attention backend, decode-sized batches run the same grouping in one
call of the native core's grouped kernel instead (see :class:`SparseMoeBlock`;
``benchmarks/moe.py`` measures the three ways).

Layout: every expert is Llama's :class:`~.llama.MLP` (a fused ``gate_up_proj`` and a
``down_proj``, both plain ``nn.Linear``), so the engine's quantizers swap each expert's
linears as they swap any other (``--quantization int8/int4``), and a GGUF file's
quantized expert tensors stay packed, one :class:`PackedWeight` per expert and
projection. The router is *not* an ``nn.Linear``: it stays in float, so quantization
never changes which experts a token goes to.

Checkpoint names: the classic per-expert layout the Hub holds (Mixtral's
``block_sparse_moe.experts.{e}.w1/w2/w3`` and ``block_sparse_moe.gate``, Qwen3-MoE's
``mlp.experts.{e}.gate_proj/up_proj/down_proj`` and ``mlp.gate``; transformers'
``save_pretrained`` writes these), and transformers 5's fused 3-D parameters
(``mlp.experts.gate_up_proj`` ``[experts, 2 * intermediate, hidden]`` and
``mlp.experts.down_proj`` ``[experts, hidden, intermediate]``), split per expert on load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pyagent_framework import parallel
from pyagent_framework.interfaces import LayerOps, PackedWeight

from .llama import MLP, DecoderSpec
from .mistral import MistralForCausalLM
from .qwen3 import Qwen3ForCausalLM


class TopKRouter(nn.Module):
    """Routing as transformers computes it: ``logits = x @ weight.T``, softmax in
    float32, ``torch.topk`` (so ties resolve as transformers resolves them), and, when
    ``renormalize``, the chosen probabilities divided by their sum.

    ``forward(x [T, hidden])`` -> ``(weights [T, k], experts [T, k] int64)``; the
    weights are float32, or ``x``'s dtype when ``weights_in_input_dtype`` (Qwen3-MoE
    casts them back; Mixtral does not)."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, *, renormalize: bool, weights_in_input_dtype: bool
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})"
            )
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.renormalize = renormalize
        self.weights_in_input_dtype = weights_in_input_dtype

    def extra_repr(self) -> str:
        experts, hidden = self.weight.shape
        return f"hidden={hidden}, experts={experts}, top_k={self.top_k}, renormalize={self.renormalize}"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_input_dtype:
            weights = weights.to(logits.dtype)
        return weights, experts


class SparseMoeBlock(nn.Module):
    """``sum_k weight_k * expert_k(x)`` over each token's routed experts, computed
    grouped by expert (see the module docstring). ``gate`` is the router, ``experts``
    a list of :class:`~.llama.MLP`.

    An attention backend may offer ``fuse_experts(experts, hidden, intermediate)``: a
    callable ``(x, expert_ids, routing_weights) -> out`` computing every expert's rows
    in one call (the native core's does, over float32 or packed weights). It is asked
    once, at the first forward (after the quantizer has swapped the linears), and used
    for float32 CPU batches of up to ``fused_max_tokens`` tokens: its per-row kernels
    stream each weight once, which wins while the batch is small; larger batches are
    compute-bound and go to the experts' own modules (torch's GEMM). Measured on this
    2-core machine, a layer of 8 float32 experts of 512 x 1,024, top-2: 2.8x faster at
    32 tokens, 1.7x at 128, 0.6x at 512. ``use_fused_experts`` off: never."""

    use_fused_experts: ClassVar[bool] = True
    fused_max_tokens: ClassVar[int] = 128

    def __init__(self, router: TopKRouter, experts: list[MLP], attention_backend: type | None = None) -> None:
        super().__init__()
        self.gate = router
        self.experts = nn.ModuleList(experts)
        self._backend = attention_backend
        self._fused = None  # the backend's grouped-experts call: None (not asked yet), False (none)
        self.parallel = parallel.current()  # the ranks' expert slices are summed once, after the block

    def _fused_experts(self):
        """The backend's grouped-experts call for this block (asked once), or None."""
        if self._fused is None:
            fuse = getattr(self._backend, "fuse_experts", None)
            hidden, inter = self.gate.weight.shape[1], self.experts[0].intermediate_size
            found = fuse(list(self.experts), hidden, inter) if fuse is not None else None
            self._fused = False if found is None else found
        return None if self._fused is False else self._fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self._experts(x))

    def _experts(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        tokens, top_k = experts.shape
        if tokens == 0:
            return torch.zeros_like(x)
        if (
            self.use_fused_experts and tokens <= self.fused_max_tokens and x.dtype == torch.float32
            and x.device.type == "cpu" and not x.requires_grad
        ):
            fused = self._fused_experts()
            if fused is not None:
                return fused(x, experts, weights)
        # The (token, slot) pairs in expert order: grouped row i is pair order[i]. The
        # sort is stable, so each expert's rows keep the batch's order.
        slots = experts.reshape(-1)
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=len(self.experts)).tolist()
        rows = x[order // top_k]
        results = torch.empty_like(rows)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                results[start : start + count] = expert(rows[start : start + count])
                start += count
        scaled = (results * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        # Back to the tokens: each token's k rows, taken in expert order (the order
        # transformers adds them in), summed. A gather and a sum rather than
        # ``index_add_``: on CPU, index_add_ enters an OpenMP parallel region at any
        # size, which can stall for milliseconds while the native core's pool threads
        # still spin after the experts' products (measured on this 2-core machine:
        # 15 ms instead of 1 ms per layer for one decode token).
        grouped_row = torch.argsort(order).view(tokens, top_k)
        grouped_row = grouped_row.gather(1, torch.argsort(experts, dim=1))
        return scaled.index_select(0, grouped_row.reshape(-1)).view(tokens, top_k, -1).sum(dim=1)


# Per-expert checkpoint names: Mixtral's w1/w3/w2 are gate/up/down.
_MIXTRAL_EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.(weight)")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# transformers 5's fused 3-D expert parameters.
_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")


class _MoEMixin:
    """What Mixtral and Qwen3-MoE share on top of their dense parents: the MoE block as
    a layer's MLP (:meth:`_moe_layer` says which layers), and the checkpoint names of
    both expert layouts. A subclass sets ``num_experts``, ``top_k``,
    ``norm_topk_prob``, ``moe_intermediate_size`` and ``_attention_backend`` before
    ``super().__init__`` (which builds the layers)."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool
    moe_intermediate_size: int
    _router_weights_in_input_dtype: ClassVar[bool] = False
    # The fused decode step computes Llama's dense MLP, not a routed one.
    use_fused_decode = False

    def _moe_layer(self, index: int) -> bool:
        return True

    def _make_mlp(self, index: int, bias: bool, ops: LayerOps) -> nn.Module:
        if not self._moe_layer(index):
            return super()._make_mlp(index, bias, ops)
        router = TopKRouter(
            self.hidden_size, self.num_experts, self.top_k,
            renormalize=self.norm_topk_prob, weights_in_input_dtype=self._router_weights_in_input_dtype,
        )
        # Under tensor parallelism every rank holds every expert's slice of the
        # intermediate features, and the block sums the ranks' outputs once.
        start, stop = self._moe_range()
        experts = [MLP(self.hidden_size, stop - start, False, ops, reduce=False) for _ in range(self.num_experts)]
        return SparseMoeBlock(router, experts, self._attention_backend)

    def _moe_range(self) -> tuple[int, int]:
        """This rank's slice of each expert's intermediate features."""
        return self.parallel.split(self.moe_intermediate_size, "moe_intermediate_size")

    def _param_targets(self) -> dict[str, tuple[torch.Tensor, int, int, Any]]:
        targets = super()._param_targets()
        # Llama's targets split every gate_up_proj at intermediate_size; an expert's
        # (Qwen3-MoE's moe_intermediate_size) may differ, and so may its rank's slice.
        start, stop = self._moe_range()
        inter, split = stop - start, self.parallel.size > 1
        rows = (0, start, stop, self.moe_intermediate_size) if split else None
        columns = (1, start, stop, self.moe_intermediate_size) if split else None
        for name, module in self.named_modules():
            if isinstance(module, SparseMoeBlock):
                for e, expert in enumerate(module.experts):
                    fused = expert.gate_up_proj.weight
                    targets[f"{name}.experts.{e}.gate_proj.weight"] = (fused, 0, inter, rows)
                    targets[f"{name}.experts.{e}.up_proj.weight"] = (fused, inter, inter, rows)
                    down = expert.down_proj.weight
                    targets[f"{name}.experts.{e}.down_proj.weight"] = (down, 0, down.shape[0], columns)
        return targets

    def _canonical(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors under this model's names: Mixtral's
        ``block_sparse_moe`` names renamed, fused 3-D expert tensors split per expert."""
        for name, tensor in weights:
            m = _MIXTRAL_EXPERT.fullmatch(name)
            if m:
                yield f"{m.group(1)}.mlp.experts.{m.group(2)}.{_MIXTRAL_PROJ[m.group(3)]}.{m.group(4)}", tensor
                continue
            name = name.replace(".block_sparse_moe.", ".mlp.")
            m = _FUSED_EXPERTS.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            prefix, kind = m.groups()
            inter, hidden = self.moe_intermediate_size, self.hidden_size
            expected = (self.num_experts, *((2 * inter, hidden) if kind == "gate_up_proj" else (hidden, inter)))
            if isinstance(tensor, PackedWeight) or tuple(tensor.shape) != expected:
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected} "
                    "(float experts × rows × columns)"
                )
            for e in range(self.num_experts):
                if kind == "gate_up_proj":  # gate rows first, as transformers' chunk(2) reads them
                    yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :inter]
                    yield f"{prefix}.{e}.up_proj.weight", tensor[e, inter:]
                else:
                    yield f"{prefix}.{e}.down_proj.weight", tensor[e]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> set[str]:
        return super().load_weights(self._canonical(weights))


def _int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key)
    return default if value is None else int(value)


def _num_experts(config: Mapping[str, Any], default: int) -> int:
    """The expert count: transformers' configs alias ``num_experts`` and
    ``num_local_experts`` (Hub Qwen3-MoE configs write the first, transformers 5's
    ``save_pretrained`` the second)."""
    found = {key: int(config[key]) for key in ("num_local_experts", "num_experts") if config.get(key) is not None}
    if len(set(found.values())) > 1:
        raise ValueError(f"the config's num_local_experts and num_experts disagree: {found}")
    return next(iter(found.values()), default)


class MixtralForCausalLM(_MoEMixin, MistralForCausalLM):
    """Mixtral: Mistral's decoder (no biases; ``sliding_window`` over every layer when
    set, MixtralConfig's default None) whose every MLP is a sparse MoE block of
    ``num_local_experts`` experts (default 8) of ``intermediate_size``, top
    ``num_experts_per_tok`` (default 2), the chosen weights always renormalised.
    ``router_jitter_noise`` is a training-time perturbation and is ignored."""

    spec: ClassVar[DecoderSpec] = DecoderSpec(
        intermediate_size=14336,
        num_key_value_heads=8,
        max_position_embeddings=4096 * 32,
        rms_norm_eps=1e-5,
        sliding_window=None,
        qkv_bias_from_config=False,
        o_bias_from_config=False,
        mlp_bias_from_config=False,
    )

    def __init__(self, config: Mapping[str, Any], attention_backend: type) -> None:
        config = dict(config)
        self._attention_backend = attention_backend
        self.num_experts = _num_experts(config, 8)
        self.top_k = _int(config, "num_experts_per_tok", 2)
        self.norm_topk_prob = True
        self.moe_intermediate_size = _int(config, "intermediate_size", self.spec.intermediate_size)
        super().__init__(config, attention_backend)


class Qwen3MoeForCausalLM(_MoEMixin, Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm; bias from
    ``attention_bias``) with sparse MoE blocks of ``num_experts`` experts (default 128)
    of ``moe_intermediate_size`` (default 768), top ``num_experts_per_tok`` (default 8),
    renormalised when ``norm_topk_prob`` (default False). Layer ``i`` is sparse unless
    it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``; the other
    layers have a dense MLP of ``intermediate_size``. ``head_dim`` defaults to
    ``hidden_size // num_attention_heads`` (Qwen3MoeConfig has no default of its own);
    with ``use_sliding_window`` every layer attends over ``sliding_window`` tokens."""

    spec: ClassVar[DecoderSpec] = DecoderSpec(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_key_value_heads=4,
        head_dim=None,
        max_position_embeddings=32768,
        attention_bias=False,
        qkv_bias_from_config=True,
        o_bias_from_config=True,
        mlp_bias_from_config=False,
        qk_norm=True,
    )
    _router_weights_in_input_dtype = True

    def __init__(self, config: Mapping[str, Any], attention_backend: type) -> None:
        config = dict(config)
        self._attention_backend = attention_backend
        self.num_experts = _num_experts(config, 128)
        self.top_k = _int(config, "num_experts_per_tok", 8)
        self.norm_topk_prob = bool(config.get("norm_topk_prob") or False)
        self.moe_intermediate_size = _int(config, "moe_intermediate_size", 768)
        self.decoder_sparse_step = _int(config, "decoder_sparse_step", 1)
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be at least 1, got {self.decoder_sparse_step}")
        self.mlp_only_layers = frozenset(int(i) for i in (config.get("mlp_only_layers") or ()))
        super().__init__(config, attention_backend)

    def _moe_layer(self, index: int) -> bool:
        return (
            index not in self.mlp_only_layers and self.num_experts > 0 and (index + 1) % self.decoder_sparse_step == 0
        )

    def _window_layers(self, config: Mapping[str, Any]) -> list[bool]:
        return [True] * self.num_layers

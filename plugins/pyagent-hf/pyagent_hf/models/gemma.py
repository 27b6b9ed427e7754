"""Gemma 2 and Gemma 3 (text): variants of the Llama family decoder.

What Gemma changes, each matching transformers' ``modeling_gemma2.py`` /
``modeling_gemma3.py``:

- RMSNorm multiplies by ``1 + weight`` (the checkpoint holds the offset from 1), in float32;
- four norms per layer: before and after attention, before and after the MLP;
- GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))``;
- input embeddings scaled by ``sqrt(hidden_size)`` (rounded to the compute dtype first);
- attention scale ``query_pre_attn_scalar ** -0.5``;
- alternating sliding-window and full-attention layers (``layer_types``);
- Gemma 2: attention logit soft-capping (``attn_logit_softcapping``, passed to the
  attention backend as ``logit_softcap``) and final logit soft-capping;
- Gemma 3: per-head ``q_norm``/``k_norm`` (also ``1 + weight``) before RoPE, and two
  RoPEs: the sliding layers' (``rope_parameters["sliding_attention"]``, formerly
  ``rope_local_base_freq``) and the full layers' (``rope_parameters["full_attention"]``,
  formerly ``rope_theta`` with ``rope_scaling``).

Neither uses the attention backend's fused decode step (it computes Llama's layer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pyagent_framework.interfaces import LayerOps
from pyagent_framework.types import ForwardContext

from .llama import MLP, Attention, DecoderSpec, LlamaForCausalLM
from .rope import RotaryEmbedding, rope_parameters

# transformers' activation names -> F.gelu's ``approximate``.
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}

_SLIDING, _FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * (1 + weight)``, computed in float32 and cast back
    to ``x.dtype`` at the end (Gemma's convention: a zero weight is the identity).
    Called with ``residual``, it first adds it: ``(norm(x + residual), x + residual)``."""

    def __init__(self, size: int, eps: float = 1e-6, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self.ops = ops or LayerOps()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            summed = x + residual
            return self.forward(summed), summed
        # Both operands in float32, so the backend's op neither rounds x nor the weight.
        return self.ops.rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)


class GemmaMLP(MLP):
    """GeGLU: ``down(gelu(gate(x)) * up(x))`` with gate and up fused (``approximate``
    as :func:`torch.nn.functional.gelu` takes it: "tanh" for ``gelu_pytorch_tanh``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, approximate: str, ops: LayerOps | None = None) -> None:
        super().__init__(hidden_size, intermediate_size, False, ops)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.parallel.all_reduce(self.down_proj(F.gelu(gate, approximate=self.approximate) * up))


class Gemma3Attention(Attention):
    """Llama's attention with Gemma's per-head ``q_norm``/``k_norm`` (``1 + weight``)
    before RoPE. Built with ``qk_norm=True``; the norms are replaced here."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        eps = kwargs["rms_norm_eps"]
        self.q_norm = GemmaRMSNorm(self.head_dim, eps, self.ops)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps, self.ops)


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norm block (transformers' ``Gemma2DecoderLayer``):
    ``h = h + post_attention_layernorm(attn(input_layernorm(h)))``, then
    ``h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))``.
    Same calling convention as Llama's :class:`~.llama.DecoderLayer`: ``forward(h,
    residual)`` returns ``(mlp branch, residual)`` whose sum is the layer's output
    (``residual`` None for the first layer)."""

    def __init__(self, attention: Attention, mlp: MLP, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        ops = attention.ops
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps, ops)
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps, ops)

    def forward(self, h, residual, cos, sin, kv_cache, context):
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, context))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


def _optional(config: Mapping[str, Any], key: str, default: float | None) -> float | None:
    """A float setting where an explicit null means "off" (a soft-cap), unlike a missing key."""
    if key not in config:
        return default
    value = config[key]
    return None if value is None else float(value)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (see the module docstring). Config: ``hidden_activation``
    (``gelu_pytorch_tanh``; ``gelu`` is exact GELU), ``query_pre_attn_scalar``,
    ``attn_logit_softcapping`` and ``final_logit_softcapping`` (null: off),
    ``sliding_window`` with ``layer_types`` (else every other layer, from the first,
    slides), ``tie_word_embeddings`` (default True), defaults of Gemma2Config.
    ``use_bidirectional_attention`` is not supported."""

    spec: ClassVar[DecoderSpec] = DecoderSpec(
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        sliding_window=4096,
        mlp_bias_from_config=False,
    )
    use_fused_decode = False  # the fused stack computes Llama's pre-norm SwiGLU layer
    #: Gemma2Config's soft-caps (attention, final logits); Gemma 3 has none.
    default_softcaps: ClassVar[tuple[float | None, float | None]] = (50.0, 30.0)
    #: Which layers slide when the config has no ``layer_types``: all but every n-th.
    default_sliding_pattern: ClassVar[int] = 2

    def __init__(self, config: Mapping[str, Any], attention_backend: type) -> None:
        config = dict(config)
        if config.get("use_bidirectional_attention"):
            raise ValueError(f"{type(self).__name__}: use_bidirectional_attention is not supported")
        # Set before super().__init__, whose layer construction reads them.
        self.query_pre_attn_scalar = float(config.get("query_pre_attn_scalar") or 256)
        attn_cap, final_cap = self.default_softcaps
        self.attn_logit_softcapping = _optional(config, "attn_logit_softcapping", attn_cap)
        self.final_logit_softcapping = _optional(config, "final_logit_softcapping", final_cap)
        super().__init__(config, attention_backend)
        self.model.norm = GemmaRMSNorm(self.hidden_size, self.rms_norm_eps, self.model.norm.ops)
        self.requires_grad_(False)
        self._embed_scales: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    # -- hooks of the Llama family ------------------------------------------------------

    @staticmethod
    def _activation(config: Mapping[str, Any]) -> str:
        # transformers' Gemma MLP reads hidden_activation; older configs name it hidden_act.
        return config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"

    def _check_activation(self, config: Mapping[str, Any]) -> None:
        act = self._activation(config)
        if act not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"{type(self).__name__}: hidden_activation {act!r} is not supported "
                f"(supported: {', '.join(GELU_APPROXIMATIONS)})"
            )

    def _sliding_window(self, config: Mapping[str, Any]) -> int | None:
        window = config.get("sliding_window", self.spec.sliding_window)
        return None if window is None else int(window)

    def _window_layers(self, config: Mapping[str, Any]) -> list[bool]:
        pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
                      or self.default_sliding_pattern)
        return [(i + 1) % pattern != 0 for i in range(self.num_layers)]

    def _attention_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    def _attention_softcap(self) -> float | None:
        return self.attn_logit_softcapping

    def _make_mlp(self, index: int, bias: bool, ops: LayerOps) -> nn.Module:
        approximate = GELU_APPROXIMATIONS[self._activation(self.config)]
        start, stop = self.intermediate_range  # this rank's (all of them at size 1)
        return GemmaMLP(self.hidden_size, stop - start, approximate, ops)

    def _make_layer(self, attention: Attention, mlp: MLP) -> GemmaDecoderLayer:
        return GemmaDecoderLayer(attention, mlp, self.hidden_size, self.rms_norm_eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super()._embed(input_ids)  # the ranks' rows summed under tensor parallelism
        key = (x.dtype, x.device)
        scale = self._embed_scales.get(key)
        if scale is None:
            # As transformers rounds it: sqrt(hidden_size) in float32, then in the compute dtype.
            scale = self._embed_scales[key] = torch.tensor(self.hidden_size**0.5).to(dtype=x.dtype, device=x.device)
        return x * scale

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


def _gemma3_rope(config: Mapping[str, Any], kind: str, max_position_embeddings: int) -> dict[str, Any]:
    """The RoPE settings of one layer type of a Gemma 3 config: transformers 5 nests them
    under ``rope_parameters[kind]``; older configs have ``rope_theta`` and
    ``rope_scaling`` for the full layers and ``rope_local_base_freq`` for the sliding ones
    (transformers' ``Gemma3TextConfig.convert_rope_params_to_dict``)."""
    nested = config.get("rope_parameters") or {}
    if kind in nested:
        params = dict(nested[kind] or {})
    elif kind == _FULL:
        params = dict(config.get("rope_scaling") or {})
        params.setdefault("rope_theta", config.get("rope_theta"))
    else:
        params = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq")}
    if params.get("rope_theta") is None:
        params["rope_theta"] = 1_000_000.0 if kind == _FULL else 10_000.0
    return rope_parameters({"rope_parameters": params, "max_position_embeddings": max_position_embeddings})


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3, text only (``model_type: gemma3_text``; see the module docstring):
    Gemma 2's layer with per-head ``q_norm``/``k_norm``, two RoPEs by layer type, no
    soft-caps by default (``final_logit_softcapping`` applies when set;
    ``attn_logit_softcapping`` is ignored, as transformers ignores it), five sliding
    layers to one full when the config has no ``layer_types``, defaults of
    Gemma3TextConfig."""

    spec: ClassVar[DecoderSpec] = DecoderSpec(
        vocab_size=262_208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=131_072,
        tie_word_embeddings=True,
        sliding_window=4096,
        mlp_bias_from_config=False,
        qk_norm=True,
    )
    attention_cls = Gemma3Attention
    default_softcaps = (None, None)
    default_sliding_pattern = 6

    def __init__(self, config: Mapping[str, Any], attention_backend: type) -> None:
        super().__init__(config, attention_backend)
        positions = self.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(self.head_dim, positions, _gemma3_rope(self.config, _FULL, positions))
        self.rotary_emb_local = RotaryEmbedding(
            self.head_dim, positions, _gemma3_rope(self.config, _SLIDING, positions)
        )
        if self.rotary_emb_local.rope_type == "dynamic":
            raise ValueError(f"{type(self).__name__}: dynamic RoPE on the sliding layers is not supported")
        # Which layers rotate with the sliding layers' RoPE (transformers: by layer type,
        # even when sliding_window is null).
        layer_types = self.config.get("layer_types")
        if layer_types is None:
            self.local_rope = self._window_layers(self.config)
        elif len(layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {self.num_layers} layers")
        else:
            self.local_rope = [kind == _SLIDING for kind in layer_types]

    def _attention_softcap(self) -> float | None:
        return None  # transformers' Gemma3Attention does not pass attn_logit_softcapping on

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        x = self._embed(input_ids)
        seq_lens = self._token_seq_lens(context, positions)  # the full layers' RoPE may be dynamic
        full = self.rotary_emb.cos_sin(positions, seq_lens, dtype=x.dtype)
        local = self.rotary_emb_local.cos_sin(positions, dtype=x.dtype)
        residual = None
        for layer, is_local, kv_cache in zip(self.model.layers, self.local_rope, context.kv_caches, strict=True):
            cos, sin = local if is_local else full
            x, residual = layer(x, residual, cos, sin, kv_cache, context)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm(x, residual)[0]

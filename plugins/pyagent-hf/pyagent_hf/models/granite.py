"""GraniteForCausalLM: the Llama decoder with four scalar multipliers."""

from __future__ import annotations

from typing import ClassVar

import torch

from .llama import Attention, DecoderLayer, DecoderSpec, LlamaForCausalLM, MLP


class GraniteDecoderLayer(DecoderLayer):
    """Llama's pre-norm block whose attention and MLP outputs are each multiplied by
    ``residual_multiplier`` before they join the residual stream (transformers:
    ``residual + out * residual_multiplier``)."""

    def __init__(self, attention: Attention, mlp: MLP, hidden_size: int, eps: float, residual_multiplier: float) -> None:
        super().__init__(attention, mlp, hidden_size, eps)
        self.residual_multiplier = residual_multiplier

    def forward(self, h, residual, cos, sin, kv_cache, context):
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, context) * self.residual_multiplier
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h) * self.residual_multiplier, residual


class GraniteForCausalLM(LlamaForCausalLM):
    """IBM Granite (3.x dense): Llama plus, from the config (defaults 1.0 as in
    GraniteConfig),

    - ``embedding_multiplier``: the input embeddings are multiplied by it;
    - ``residual_multiplier``: each attention and MLP output, before its residual add;
    - ``attention_multiplier``: the attention softmax scale (instead of ``head_dim ** -0.5``);
    - ``logits_scaling``: the logits are divided by it.

    The backend's fused decode step (Llama's layer math) is not used.
    """

    spec: ClassVar[DecoderSpec] = DecoderSpec()
    use_fused_decode = False  # the fused stack knows neither multiplier nor logits scaling

    def __init__(self, config, attention_backend: type) -> None:
        get = dict(config).get

        def value(key):
            found = get(key)
            return 1.0 if found is None else float(found)

        # Set before super().__init__, whose layer construction reads them.
        self.embedding_multiplier = value("embedding_multiplier")
        self.residual_multiplier = value("residual_multiplier")
        self.attention_multiplier = value("attention_multiplier")
        self.logits_scaling = value("logits_scaling")
        super().__init__(config, attention_backend)

    def _attention_scale(self) -> float:
        return self.attention_multiplier

    def _make_layer(self, attention: Attention, mlp: MLP) -> GraniteDecoderLayer:
        return GraniteDecoderLayer(attention, mlp, self.hidden_size, self.rms_norm_eps, self.residual_multiplier)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden_states) / self.logits_scaling

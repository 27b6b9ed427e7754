"""Qwen2ForCausalLM: q/k/v projections always carry a bias, o_proj never does."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from .llama import DecoderSpec, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: the Llama decoder with q/k/v biases (no o_proj or MLP bias);
    config defaults of Qwen2Config. With ``use_sliding_window: true`` the layers from
    ``max_window_layers`` on (or those ``layer_types`` names) attend over a sliding window."""

    spec: ClassVar[DecoderSpec] = DecoderSpec(
        vocab_size=151936,
        intermediate_size=22016,
        num_key_value_heads=32,
        max_position_embeddings=32768,
        qkv_bias_always=True,
        qkv_bias_from_config=False,
        o_bias_from_config=False,
        mlp_bias_from_config=False,
    )

    def _sliding_window(self, config: Mapping[str, Any]) -> int | None:
        if not config.get("use_sliding_window", False):
            return None
        window = config.get("sliding_window", 4096)
        return None if window is None else int(window)

    def _window_layers(self, config: Mapping[str, Any]) -> list[bool]:
        first = int(config.get("max_window_layers", 28))
        return [i >= first for i in range(self.num_layers)]

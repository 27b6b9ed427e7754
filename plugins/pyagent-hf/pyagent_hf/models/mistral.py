"""MistralForCausalLM: the Llama decoder without biases; config defaults of MistralConfig."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from .llama import DecoderSpec, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: no attention or MLP biases; every layer attends over a sliding window
    of ``sliding_window`` tokens (MistralConfig's default is 4096; newer checkpoints set
    ``null``: full attention)."""

    spec: ClassVar[DecoderSpec] = DecoderSpec(
        intermediate_size=14336,
        num_key_value_heads=8,
        max_position_embeddings=4096 * 32,
        sliding_window=4096,
        qkv_bias_from_config=False,
        o_bias_from_config=False,
        mlp_bias_from_config=False,
    )

    def _sliding_window(self, config: Mapping[str, Any]) -> int | None:
        if "sliding_window" in config:
            window = config["sliding_window"]
            return None if window is None else int(window)
        return self.spec.sliding_window

"""Qwen3ForCausalLM: per-head RMSNorm on q and k before RoPE; optional attention bias."""

from __future__ import annotations

from typing import ClassVar

from .llama import DecoderSpec
from .qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen3 (dense): ``q_norm``/``k_norm`` (RMSNorm over ``head_dim``) on every head
    before RoPE; q/k/v/o bias from ``attention_bias`` (default False); ``head_dim``
    defaults to 128 as in Qwen3Config. Sliding window as in Qwen2."""

    spec: ClassVar[DecoderSpec] = DecoderSpec(
        vocab_size=151936,
        intermediate_size=22016,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        attention_bias=False,
        qkv_bias_from_config=True,
        o_bias_from_config=True,
        mlp_bias_from_config=False,
        qk_norm=True,
    )

"""Phi3ForCausalLM: the Llama decoder with a fused checkpoint layout, partial rotary and LongRoPE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from .llama import Attention, DecoderSpec, LlamaForCausalLM

# Phi3Config's rope types: "su" and "yarn" are older names it reads as "longrope".
_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}
_ROPE_TYPES = ("default", "longrope")


class Phi3Attention(Attention):
    """Llama's attention rotating only the first ``rotary_dim`` values of each head
    (``partial_rotary_factor``; Phi-4-mini rotates 3/4), the rest passing unchanged.
    ``rotary_dim`` is read from ``cos``/``sin`` (``[tokens, rotary_dim // 2]``)."""

    def _rotated_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotary_dim = 2 * cos.shape[-1]
        if rotary_dim == self.head_dim:
            return super()._rotated_qk(qkv, cos, sin)
        num_tokens = qkv.shape[0]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        rotated = self.ops.rotary_embedding(qk[..., :rotary_dim], cos, sin)
        qk = torch.cat((rotated, qk[..., rotary_dim:]), dim=-1)
        return qk[:, : self.num_heads], qk[:, self.num_heads :]


class Phi3ForCausalLM(LlamaForCausalLM):
    """Microsoft Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder (pre-norm, RMSNorm,
    SwiGLU, no biases) with config defaults of Phi3Config, and

    - the checkpoint's fused ``self_attn.qkv_proj`` (q | k | v rows) and
      ``mlp.gate_up_proj`` (gate | up rows), loaded as they are into the fused
      linears (separate ``q_proj``/``k_proj``/... names, which llama.cpp may write,
      are read too);
    - ``partial_rotary_factor`` (top level or in the rope settings): only the first
      ``int(head_dim * factor)`` values of each head are rotated;
    - ``sliding_window`` (Phi-3-mini-4k: 2047) on every layer; None: full attention;
    - LongRoPE (``rope_scaling``/``rope_parameters`` type ``longrope``, or its older
      names ``su`` and ``yarn``, as Phi3Config reads them) with ``short_factor``,
      ``long_factor``, the top-level ``original_max_position_embeddings`` (default
      4096) and an optional ``attention_factor`` (see :mod:`.rope`).

    LongRoPE is chosen per sequence and per step: a token uses the long factors when
    its sequence is longer than ``original_max_position_embeddings`` after this step,
    and keys already in the KV cache keep the factors they were computed with. That is
    transformers' forward with a cache. Its Phi-3 ``generate()`` adds one thing the
    engine does not do: when a sequence first grows past the limit it drops the cache
    and recomputes the whole sequence with the long factors. A sequence that crosses
    the limit while decoding, whose prompt is prefilled in chunks that end on both
    sides of it, or that reuses prefix-cache blocks a shorter sequence filed, therefore
    continues from keys computed with the short factors.

    The backend's fused decode step runs Llama's layer, rotating whole heads with the
    given cos/sin: it serves Phi-3 when every value of a head is rotated and is not
    used (``use_fused_decode`` off for the instance) when ``partial_rotary_factor`` < 1.
    """

    spec: ClassVar[DecoderSpec] = DecoderSpec(
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        qkv_bias_from_config=False,
        o_bias_from_config=False,
        mlp_bias_from_config=False,
    )
    attention_cls = Phi3Attention
    partial_rotary = True
    #: Phi3Config's default for the top-level ``original_max_position_embeddings``.
    original_max_position_embeddings: ClassVar[int] = 4096

    def __init__(self, config: Mapping[str, Any], attention_backend: type) -> None:
        super().__init__(self._normalized(config), attention_backend)
        if self.rotary_emb.rotary_dim != self.head_dim:
            self.use_fused_decode = False  # the fused step rotates whole heads

    @classmethod
    def _normalized(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The config with its rope settings as Phi3Config reads them: ``rope_scaling``
        before ``rope_parameters``, the type's older names, a top-level
        ``partial_rotary_factor`` and the default ``original_max_position_embeddings``."""
        config = dict(config)
        params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
        rope_type = params.get("rope_type", params.get("type")) or "default"
        rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
        if rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"Phi3ForCausalLM: rope type {rope_type!r} is not supported (supported: {', '.join(_ROPE_TYPES)})"
            )
        params["rope_type"] = rope_type
        params.pop("type", None)
        if params.get("partial_rotary_factor") is None:
            params["partial_rotary_factor"] = config.get("partial_rotary_factor") or 1.0
        config["rope_parameters"] = params
        config.pop("rope_scaling", None)
        if config.get("original_max_position_embeddings") is None:
            config["original_max_position_embeddings"] = cls.original_max_position_embeddings
        return config

    def _sliding_window(self, config: Mapping[str, Any]) -> int | None:
        window = config.get("sliding_window")
        return None if window is None else int(window)

    def _param_targets(self) -> dict[str, tuple[torch.Tensor, int, int, Any]]:
        # Llama's targets name the fused linears' parts; Phi-3 checkpoints hold the
        # fused tensors themselves, which fill the whole parameter (this rank's rows of
        # each part, under tensor parallelism).
        targets = super()._param_targets()
        for name, param in self.named_parameters():
            module = name.rpartition(".")[0]
            if module.endswith((".qkv_proj", ".gate_up_proj")):
                targets[name] = (param, 0, param.shape[0], self._fused_take(module.rpartition(".")[2]))
        return targets

"""Olmo2ForCausalLM: post-norms instead of pre-norms, q/k RMSNorm over the whole projection."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from .llama import MLP, Attention, DecoderSpec, LlamaForCausalLM, RMSNorm


class Olmo2Attention(Attention):
    """Llama's attention with ``q_norm``/``k_norm``: RMSNorm over the whole q
    (``num_heads * head_dim``) and k (``num_kv_heads * head_dim``) projection output,
    not per head (Qwen3's), before RoPE. Built with ``qk_norm=False``; the norms are
    made here."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["qk_norm"] = False
        super().__init__(*args, **kwargs)
        eps = kwargs["rms_norm_eps"]
        self.q_norm = RMSNorm(self.q_size, eps, self.ops)
        self.k_norm = RMSNorm(self.kv_size, eps, self.ops)
        # Under tensor parallelism (set by the model): the whole projections' sizes, and
        # how many ranks hold each key/value head (replicated when fewer than ranks).
        self.full_sizes = (self.q_size, self.kv_size)
        self.kv_replicas = 1

    def _rotated_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = qkv.shape[0]
        q, k = qkv[:, : self.q_size].contiguous(), qkv[:, self.q_size : self.q_size + self.kv_size].contiguous()
        if self.parallel.size == 1:
            q, k = self.q_norm(q), self.k_norm(k)
        else:
            q = self._norm_across_ranks(q, self.q_norm, self.full_sizes[0], 1)
            k = self._norm_across_ranks(k, self.k_norm, self.full_sizes[1], self.kv_replicas)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        return self.ops.rotary_embedding(q, cos, sin), self.ops.rotary_embedding(k, cos, sin)

    def _norm_across_ranks(self, x: torch.Tensor, norm: RMSNorm, size: int, replicas: int) -> torch.Tensor:
        """RMSNorm over the whole projection when each rank holds a slice of it: the
        ranks' sums of squares are summed (each held ``replicas`` times), the rest as
        :meth:`~pyagent_framework.interfaces.LayerOps.rms_norm` computes it."""
        x32 = x.float()
        squares = self.parallel.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / replicas
        return norm.weight * (x32 * torch.rsqrt(squares / size + norm.eps)).to(x.dtype)


class Olmo2DecoderLayer(nn.Module):
    """Post-norm block: ``h = h + post_attention_layernorm(attn(h))``, then
    ``h = h + post_feedforward_layernorm(mlp(h))``; no input norm. Same calling
    convention as Llama's :class:`~.llama.DecoderLayer`: ``forward(h, residual)``
    returns ``(mlp branch, residual)`` whose sum is the layer's output (``residual``
    None for the first layer)."""

    def __init__(self, attention: Olmo2Attention, mlp: MLP, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, attention.ops)
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, attention.ops)

    def forward(self, h, residual, cos, sin, kv_cache, context):
        stream = h if residual is None else residual + h
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, cos, sin, kv_cache, context))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 (AllenAI): the Llama decoder with RMSNorm after attention and after the
    MLP (``post_attention_layernorm``, ``post_feedforward_layernorm``) instead of
    before them, and ``q_norm``/``k_norm`` over the whole q/k projection output before
    RoPE; q/k/v/o bias from ``attention_bias``, no MLP bias; config defaults of
    Olmo2Config (``rms_norm_eps`` 1e-5). The backend's fused decode step (Llama's
    pre-norm layer) is not used."""

    spec: ClassVar[DecoderSpec] = DecoderSpec(
        vocab_size=50304,
        rms_norm_eps=1e-5,
        mlp_bias_from_config=False,
    )
    use_fused_decode = False  # the fused stack computes pre-norm Llama layers
    attention_cls = Olmo2Attention

    def _make_layer(self, attention: Attention, mlp: MLP) -> Olmo2DecoderLayer:
        attention.full_sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        attention.kv_replicas = max(1, self.parallel.size // self.num_kv_heads)
        return Olmo2DecoderLayer(attention, mlp, self.hidden_size, self.rms_norm_eps)

    def _param_targets(self) -> dict[str, tuple[torch.Tensor, int, int, Any]]:
        # The q/k norms' weights span the whole projections: each rank takes its heads'.
        targets = super()._param_targets()
        if self.parallel.size > 1:
            d, shard = self.head_dim, self.shard
            q0, k0 = shard.q_start * d, shard.kv_start * d
            spans = {
                "q_norm": (q0, q0 + shard.num_heads * d, self.num_heads * d),
                "k_norm": (k0, k0 + shard.num_kv_heads * d, self.num_kv_heads * d),
            }
            for name, (param, offset, rows, _) in list(targets.items()):
                leaf = name.rpartition(".")[0].rpartition(".")[2]
                if leaf in spans:
                    targets[name] = (param, offset, rows, (0, *spans[leaf]))
        return targets

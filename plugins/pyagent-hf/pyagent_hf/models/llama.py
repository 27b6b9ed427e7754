"""The Llama family decoder (Llama, Mistral, Qwen2, Qwen3) as a plain ``nn.Module``;
Granite, OLMo 2, Gemma 2/3, Phi-3, Mixtral and Qwen3-MoE (``granite.py``, ``olmo2.py``,
``gemma.py``, ``phi3.py``, ``moe.py``) are variants built on its hooks
(``_attention_scale``, ``_attention_softcap``, ``_make_layer``, ``_make_mlp``, ``_embed``,
``_check_activation``, ``attention_cls``, ``partial_rotary``).

One readable implementation in the style of gpt-fast / nano-vllm; the architectures
differ only in which projections carry a bias, Qwen3's per-head q/k RMSNorm and their
config defaults, which the subclasses set (see :class:`DecoderSpec`).

Layout, for speed: q/k/v are one fused ``qkv_proj`` linear and gate/up one fused
``gate_up_proj`` linear; :meth:`LlamaForCausalLM.load_weights` packs the checkpoint's
separate ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` tensors into
them by row offset. Every linear layer is a plain ``torch.nn.Linear`` so the engine can
swap it for a quantized module after loading.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from pyagent_framework import parallel
from pyagent_framework.errors import ConfigError
from pyagent_framework.interfaces import LayerOps, ModelArchitecture, PackedParts, PackedWeight, layer_ops
from pyagent_framework.types import ForwardContext

from .rope import RotaryEmbedding, rope_parameters

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderSpec:
    """What distinguishes one architecture of the family (and its config defaults,
    copied from the transformers config class of the same name)."""

    # config defaults
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: = num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # default of config["attention_bias"]
    sliding_window: int | None = None
    # structure
    qkv_bias_from_config: bool = True  # q/k/v bias = config["attention_bias"]
    qkv_bias_always: bool = False  # Qwen2: q/k/v always have a bias
    o_bias_from_config: bool = True  # o_proj bias = config["attention_bias"]
    mlp_bias_from_config: bool = True  # Llama's "mlp_bias"
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE


def _packed_columns(packed: PackedWeight, start: int, stop: int) -> PackedWeight | None:
    """Columns ``start:stop`` of a packed GGUF weight, as its bytes, when both ends
    fall on its blocks (each row codes its blocks of columns one after another); None
    otherwise, or for a weight with a column order or offsets of its own."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType.__members__.get(packed.encoding)
    if qtype is None or packed.perm is not None or packed.offsets is not None:
        return None
    block, size = GGML_QUANT_SIZES[qtype]
    if start % block or stop % block:
        return None
    data = packed.data[:, start // block * size : stop // block * size].contiguous()
    return PackedWeight(packed.encoding, (packed.shape[0], stop - start), data, packed.decode, packed.name)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)``, computed in float32 as transformers does
    (by ``ops.rms_norm``: the attention backend's kernel, else plain torch). Called
    with ``residual``, it first adds it: ``(norm(x + residual), x + residual)``."""

    def __init__(self, size: int, eps: float = 1e-6, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops or LayerOps()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        attention_backend: type,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        rms_norm_eps: float,
        sliding_window: int | None = None,
        scale: float | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.hidden_size = hidden_size
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        # Under tensor parallelism the heads are this rank's and o_proj is row-parallel:
        # the ranks' outputs are summed after it.
        self.parallel = parallel.current()
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=o_bias)
        self.ops = ops = layer_ops(attention_backend)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, rms_norm_eps, ops)
            self.k_norm = RMSNorm(head_dim, rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None
        # The softmax scale: 1/sqrt(head_dim) unless the architecture sets its own.
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        # Optional keywords are passed only when set, so a backend without them still
        # serves the models that do not use them.
        options = {"sliding_window": sliding_window, "logit_softcap": logit_softcap}
        options = {key: value for key, value in options.items() if value is not None}
        if not options:
            self.attn = attention_backend(num_heads, head_dim, num_kv_heads, self.scale)
        else:
            try:
                self.attn = attention_backend(num_heads, head_dim, num_kv_heads, self.scale, **options)
            except TypeError as exc:
                given = ", ".join(f"{key} ({value})" for key, value in options.items())
                raise ValueError(
                    f"attention backend {attention_backend.__name__} cannot be built with {given}, which this "
                    f"model's config sets: {exc}"
                ) from None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        context: ForwardContext,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k = self._rotated_qk(qkv, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache, context.metadata)
        return self.parallel.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))

    def _rotated_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[tokens, heads, head_dim]`` and k ``[tokens, kv heads, head_dim]`` from the
        fused projection, normed per head where the architecture does (Qwen3), rotated."""
        num_tokens = qkv.shape[0]
        if self.q_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim))
            return self.ops.rotary_embedding(q, cos, sin), self.ops.rotary_embedding(k, cos, sin)
        # q and k side by side are rotated in one go.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = self.ops.rotary_embedding(qk, cos, sin)
        return qk[:, : self.num_heads], qk[:, self.num_heads :]


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, ops: LayerOps | None = None, *, reduce: bool = True
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.ops = ops or LayerOps()
        # down_proj is row-parallel under tensor parallelism: the ranks' outputs are
        # summed after it, unless the caller sums them (a MoE block, once for all its
        # experts: reduce=False).
        self.parallel = parallel.current() if reduce else parallel.TensorParallel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    """Pre-norm block. The residual stream travels beside the layer's output, so each
    norm adds it in the same call (``RMSNorm(x, residual)``): ``forward(h, residual)``
    returns ``(mlp output, residual)``, whose sum is the layer's output; ``residual``
    is None for the first layer, whose input is the stream itself."""

    def __init__(self, attention: Attention, mlp: MLP, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, attention.ops)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, attention.ops)

    def forward(self, h, residual, cos, sin, kv_cache, context):
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, context)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """``model.*`` of the checkpoint: embeddings, decoder layers, final norm."""

    def __init__(self, embed_tokens: nn.Embedding, layers: list[DecoderLayer], norm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class LlamaForCausalLM(nn.Module, ModelArchitecture):
    """Llama (1/2/3.x, SmolLM, TinyLlama, ...) for the paged engine.

    Built as ``cls(config, attention_backend)`` from an HF ``config.json`` mapping
    (missing keys take transformers' defaults for the config class); each layer builds
    ``attention_backend(num_heads, head_dim, num_kv_heads, head_dim ** -0.5)``.

    - ``forward(input_ids [T], positions [T], context)`` -> hidden ``[T, hidden]``;
      layer ``i`` attends with ``context.kv_caches[i]`` and ``context.metadata``.
    - ``compute_logits(hidden [N, hidden])`` -> float32 logits ``[N, vocab]``.
    - ``load_weights(pairs)`` takes HF checkpoint names (``model.layers.0.self_attn.q_proj.weight``,
      ...), returns the names it loaded; an unknown name or a wrong shape is a
      ``ValueError`` naming the tensor. ``rotary_emb.inv_freq`` buffers are skipped; with
      tied embeddings a checkpoint ``lm_head.weight`` is checked and skipped.
    - ``kv_cache_shape(num_blocks, block_size)`` -> ``(num_layers, 2, num_blocks,
      block_size, num_kv_heads, head_dim)``.

    Config: ``attention_bias`` (q/k/v/o bias), ``mlp_bias``, ``head_dim``,
    ``rms_norm_eps``, ``rope_theta`` and ``rope_parameters``/``rope_scaling`` (types
    default, linear, dynamic, llama3, yarn), ``tie_word_embeddings`` (default False,
    as in every transformers config class of the family). Only ``hidden_act: silu`` is
    supported. Dynamic (NTK) RoPE rescales per sequence: a token uses the base
    transformers would use for its sequence's length after this step (from
    ``context.metadata``), so results do not depend on what else is in the batch.
    """

    spec: ClassVar[DecoderSpec] = DecoderSpec()
    #: Whether a pure-decode step may run through the attention backend's fused
    #: decoder when it offers one (see :meth:`_fused_decoder`); off: always this forward.
    use_fused_decode: bool = True
    #: The attention module each layer builds (a variant may subclass :class:`Attention`).
    attention_cls: ClassVar[type[Attention]] = Attention
    #: Whether the attention rotates only part of each head (``partial_rotary_factor``).
    partial_rotary: ClassVar[bool] = False
    #: Whether the architecture can be built as one rank of a tensor-parallel group
    #: (see :mod:`pyagent_framework.parallel`); a variant whose layers or weights differ
    #: from Llama's says False until it is sharded too.
    tensor_parallel: ClassVar[bool] = True

    def __init__(self, config: Mapping[str, Any], attention_backend: type) -> None:
        super().__init__()
        spec = self.spec
        self.config = dict(config)
        get = self.config.get

        def value(key, default):
            found = get(key)
            return default if found is None else found

        self.vocab_size = int(value("vocab_size", spec.vocab_size))
        self.hidden_size = int(value("hidden_size", spec.hidden_size))
        self.intermediate_size = int(value("intermediate_size", spec.intermediate_size))
        self.num_layers = int(value("num_hidden_layers", spec.num_hidden_layers))
        self.num_heads = int(value("num_attention_heads", spec.num_attention_heads))
        kv_default = spec.num_key_value_heads if spec.num_key_value_heads is not None else self.num_heads
        self.num_kv_heads = int(value("num_key_value_heads", kv_default))
        head_dim_default = spec.head_dim if spec.head_dim is not None else self.hidden_size // self.num_heads
        self.head_dim = int(value("head_dim", head_dim_default))
        self.rms_norm_eps = float(value("rms_norm_eps", spec.rms_norm_eps))
        self.max_position_embeddings = int(value("max_position_embeddings", spec.max_position_embeddings))
        self.tie_word_embeddings = bool(value("tie_word_embeddings", spec.tie_word_embeddings))
        self.sliding_window = self._sliding_window(self.config)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        self._check_activation(self.config)
        self.layer_windows = self._layer_windows(self.config)
        # This rank's heads, intermediate features and vocabulary (all of them at size 1).
        self.parallel = tp = parallel.current()
        if tp.size > 1 and not self.tensor_parallel:
            raise ConfigError(
                f"{type(self).__name__} cannot be split across ranks yet (tensor_parallel_size {tp.size}); "
                "run it with tensor_parallel_size 1",
                field="tensor_parallel_size",
            )
        self.shard = tp.heads(self.num_heads, self.num_kv_heads)
        self.intermediate_range = tp.split(self.intermediate_size, "intermediate_size")
        self.vocab_range = tp.vocab_range(self.vocab_size)

        attention_bias = bool(value("attention_bias", spec.attention_bias))
        qkv_bias = spec.qkv_bias_always or (spec.qkv_bias_from_config and attention_bias)
        o_bias = spec.o_bias_from_config and attention_bias
        mlp_bias = spec.mlp_bias_from_config and bool(value("mlp_bias", False))

        self.rotary_emb = RotaryEmbedding(
            self.head_dim, self.max_position_embeddings, rope_parameters(self.config), partial=self.partial_rotary
        )
        layers = [
            self._make_layer(
                self.attention_cls(
                    self.hidden_size, self.shard.num_heads, self.shard.num_kv_heads, self.head_dim, attention_backend,
                    qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=spec.qk_norm, rms_norm_eps=self.rms_norm_eps,
                    sliding_window=window, scale=self._attention_scale(), logit_softcap=self._attention_softcap(),
                ),
                self._make_mlp(index, mlp_bias, layer_ops(attention_backend)),
            )
            for index, window in enumerate(self.layer_windows)
        ]
        local_vocab = self.vocab_range[1] - self.vocab_range[0]
        self.model = DecoderModel(
            nn.Embedding(local_vocab, self.hidden_size),
            layers,
            RMSNorm(self.hidden_size, self.rms_norm_eps, layer_ops(attention_backend)),
        )
        self.lm_head = nn.Linear(self.hidden_size, local_vocab, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)  # inference only
        # Packed (quantized) weights load_weights keeps: parameter name -> row offset -> part.
        self._packed: dict[str, dict[int, PackedWeight]] = {}
        self._fused = None  # the backend's fused decode step: None (not asked yet), False (none)

    def _sliding_window(self, config: Mapping[str, Any]) -> int | None:
        """The configured sliding window, if the architecture has one."""
        return None

    # Hooks for the family's variants (Granite, OLMo 2); Llama's defaults below.

    def _attention_scale(self) -> float | None:
        """The attention softmax scale; None: ``head_dim ** -0.5``."""
        return None

    def _attention_softcap(self) -> float | None:
        """The attention logit soft-cap (``cap * tanh(scores / cap)``); None: none."""
        return None

    def _check_activation(self, config: Mapping[str, Any]) -> None:
        """A ``ValueError`` unless the config's MLP activation is the one the MLP computes."""
        act = config.get("hidden_act") or "silu"
        if act != "silu":
            raise ValueError(f"{type(self).__name__}: hidden_act {act!r} is not supported (only 'silu')")

    def _make_mlp(self, index: int, bias: bool, ops: LayerOps) -> nn.Module:
        """Layer ``index``'s feed-forward block (``mlp(h) -> h``); Llama's is :class:`MLP`."""
        start, stop = self.intermediate_range
        return MLP(self.hidden_size, stop - start, bias, ops)

    def _make_layer(self, attention: Attention, mlp: MLP) -> nn.Module:
        """One decoder layer around ``attention`` and ``mlp``, with
        ``forward(h, residual, cos, sin, kv_cache, context) -> (h, residual)`` as
        :class:`DecoderLayer` (whose sum is the layer's output)."""
        return DecoderLayer(attention, mlp, self.hidden_size, self.rms_norm_eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids`` (the residual stream's start). Under
        tensor parallelism each rank holds a range of the vocabulary: it looks up the
        ids in its range, zeros for the rest, and the ranks' rows are summed."""
        if self.parallel.size == 1:
            return self.model.embed_tokens(input_ids)
        start, stop = self.vocab_range
        mine = (input_ids >= start) & (input_ids < stop)
        rows = self.model.embed_tokens(torch.where(mine, input_ids - start, 0))
        return self.parallel.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))

    def _window_layers(self, config: Mapping[str, Any]) -> list[bool]:
        """Which layers use the sliding window when the config has no ``layer_types``."""
        return [True] * self.num_layers

    def _layer_windows(self, config: Mapping[str, Any]) -> list[int | None]:
        """Each layer's sliding window (``None``: full attention). A config's
        ``layer_types`` ("sliding_attention"/"full_attention", as transformers writes
        it) decides; else the architecture's rule (:meth:`_window_layers`)."""
        window = self.sliding_window
        if window is None:
            return [None] * self.num_layers
        layer_types = config.get("layer_types")
        if layer_types is not None:
            if len(layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(layer_types)} entries for {self.num_layers} layers")
            unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
            if unknown:
                raise ValueError(f"layer_types: unsupported attention type(s) {unknown}")
            return [window if kind == "sliding_attention" else None for kind in layer_types]
        return [window if sliding else None for sliding in self._window_layers(config)]

    # ------------------------------------------------------------------ engine API

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, block_size, self.shard.num_kv_heads, self.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        x = self._embed(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions, self._token_seq_lens(context, positions), dtype=x.dtype)
        fused = self._fused_decoder() if context is not None else None
        # LoRA adapters in this batch (each row's slot): only a fused step that reads them may run it.
        lora_slots = getattr(context, "lora_slots", None)
        if fused is not None and (lora_slots is None or getattr(fused, "supports_lora", False)):
            extra = {} if lora_slots is None else {"lora_slots": lora_slots}
            if fused(x, cos, sin, context.kv_caches, context.metadata, **extra):
                return self.model.norm(x)
        residual = None
        for layer, kv_cache in zip(self.model.layers, context.kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, context)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm(x, residual)[0]

    def _fused_decoder(self):
        """The attention backend's whole-stack decode step, asked for once per model:
        a backend may offer ``fuse_decoder(layers, shape)``, a callable that runs a
        pure-decode batch through every layer at once (the native core's does) and
        returns False for any batch it does not take. None when there is none, or when
        ``use_fused_decode`` is off (this forward is then the only path)."""
        if not self.use_fused_decode or self.parallel.size > 1:  # a fused step has no all-reduce
            return None
        if self._fused is None:
            self._fused = False
            layers = list(self.model.layers)
            backend = type(layers[0].self_attn.attn) if layers else None
            fuse = getattr(backend, "fuse_decoder", None)
            if fuse is not None and all(type(layer.self_attn.attn) is backend for layer in layers):
                described = [
                    {
                        "input_norm": layer.input_layernorm.weight,
                        "post_norm": layer.post_attention_layernorm.weight,
                        "q_norm": None if layer.self_attn.q_norm is None else layer.self_attn.q_norm.weight,
                        "k_norm": None if layer.self_attn.k_norm is None else layer.self_attn.k_norm.weight,
                        "qkv": layer.self_attn.qkv_proj,
                        "o": layer.self_attn.o_proj,
                        "gate_up": layer.mlp.gate_up_proj,
                        "down": layer.mlp.down_proj,
                        "sliding_window": window,
                    }
                    for layer, window in zip(layers, self.layer_windows, strict=True)
                ]
                shape = {
                    "hidden_size": self.hidden_size,
                    "num_heads": self.num_heads,
                    "num_kv_heads": self.num_kv_heads,
                    "head_dim": self.head_dim,
                    "intermediate_size": self.intermediate_size,
                    "eps": self.rms_norm_eps,
                    "scale": layers[0].self_attn.scale,
                }
                self._fused = fuse(described, shape) or False
        return self._fused or None

    def _token_seq_lens(self, context: ForwardContext, positions: torch.Tensor) -> torch.Tensor | None:
        """Each token's sequence length after this step (only dynamic RoPE and LongRoPE need it)."""
        if not self.rotary_emb.needs_seq_lens or context is None:
            return None
        md = context.metadata
        query_lens = (md.query_start_loc[1:] - md.query_start_loc[:-1]).to(torch.int64)
        return torch.repeat_interleave(md.seq_lens.to(torch.int64), query_lens).to(positions.device)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states).float()
        if self.parallel.size == 1:
            return logits
        # Each rank's range of the vocabulary, padded to the same width, side by side.
        share = -(-self.vocab_size // self.parallel.size)
        if logits.shape[-1] < share:
            logits = torch.nn.functional.pad(logits, (0, share - logits.shape[-1]))
        return self.parallel.all_gather(logits)[..., : self.vocab_size]

    # ------------------------------------------------------------------ weights

    def _param_targets(self) -> dict[str, tuple[torch.Tensor, int, int, Any]]:
        """Checkpoint name -> (our tensor, row offset, rows, take) for every loadable
        tensor. ``take`` is this rank's part of the checkpoint tensor under tensor
        parallelism (see :meth:`_take`): None (all of it), ``(dim, start, stop,
        full)`` (a slice of a dimension the checkpoint holds ``full`` of), ``("rows",
        [(start, stop), ...], full)`` (row ranges joined: a fused tensor's parts, see
        :meth:`_fused_take`), or "first" (all of it on rank 0, zeros elsewhere: the
        bias of a row-parallel linear, added once by the sum)."""
        targets: dict[str, tuple[torch.Tensor, int, int, Any]] = {}
        shard, d = self.shard, self.head_dim
        q, kv = shard.num_heads * d, shard.num_kv_heads * d
        i0, i1 = self.intermediate_range
        inter = i1 - i0
        heads = (shard.q_start * d, shard.q_start * d + q, self.num_heads * d)
        kv_heads = (shard.kv_start * d, shard.kv_start * d + kv, self.num_kv_heads * d)
        inter_range = (i0, i1, self.intermediate_size)
        vocab = (*self.vocab_range, self.vocab_size)
        fused = {
            "qkv_proj": (("q_proj", 0, q, heads), ("k_proj", q, kv, kv_heads), ("v_proj", q + kv, kv, kv_heads)),
            "gate_up_proj": (("gate_proj", 0, inter, inter_range), ("up_proj", inter, inter, inter_range)),
        }
        row_parallel = {"o_proj": heads, "down_proj": inter_range}
        split = self.parallel.size > 1
        for name, param in self.named_parameters():  # shared (tied) tensors appear once
            module, _, kind = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            if leaf in fused:
                for part, offset, rows, (start, stop, full) in fused[leaf]:
                    targets[f"{parent}.{part}.{kind}"] = (param, offset, rows, (0, start, stop, full) if split else None)
                continue
            take = None
            if split and leaf in row_parallel:
                take = (1, *row_parallel[leaf]) if kind == "weight" else "first"
            elif split and leaf in ("embed_tokens", "lm_head"):
                take = (0, *vocab)
            targets[name] = (param, 0, param.shape[0], take)
        return targets

    def lora_targets(self) -> dict[str, tuple[str, int, int, int]]:
        """LoRA: checkpoint linear name -> (our linear's name, its first output row,
        rows, input features), for the attention and dense MLP projections. A fused
        layer is adapted part by part (``q_proj`` ...) or whole (Phi-3's ``qkv_proj``)."""
        targets: dict[str, tuple[str, int, int, int]] = {}
        for name, module in self.named_modules():
            if isinstance(module, Attention):
                q, kv, hidden = module.q_size, module.kv_size, module.hidden_size
                fused, parts = f"{name}.qkv_proj", (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv))
                targets[f"{name}.o_proj"] = (f"{name}.o_proj", 0, hidden, q)
            elif isinstance(module, MLP) and ".experts." not in name:  # a MoE's experts are not adapted
                inter, hidden = module.intermediate_size, module.hidden_size
                fused, parts = f"{name}.gate_up_proj", (("gate_proj", 0, inter), ("up_proj", inter, inter))
                targets[f"{name}.down_proj"] = (f"{name}.down_proj", 0, hidden, inter)
            else:
                continue
            for part, offset, rows in parts:
                targets[f"{name}.{part}"] = (fused, offset, rows, hidden)
            targets[fused] = (fused, 0, sum(rows for _, _, rows in parts), hidden)
        return targets

    def _fused_take(self, leaf: str) -> Any:
        """``take`` (see :meth:`_param_targets`) of a checkpoint that holds a fused
        ``qkv_proj`` (q | k | v rows) or ``gate_up_proj`` (gate | up rows) itself:
        this rank's rows of each part, joined; None without tensor parallelism."""
        if self.parallel.size == 1:
            return None
        d, shard = self.head_dim, self.shard
        if leaf == "qkv_proj":
            q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
            q0, k0 = shard.q_start * d, shard.kv_start * d
            q, kv = shard.num_heads * d, shard.num_kv_heads * d
            ranges = [(q0, q0 + q), (q_rows + k0, q_rows + k0 + kv), (q_rows + kv_rows + k0, q_rows + kv_rows + k0 + kv)]
            return ("rows", ranges, q_rows + 2 * kv_rows)
        i0, i1 = self.intermediate_range
        inter = self.intermediate_size
        return ("rows", [(i0, i1), (inter + i0, inter + i1)], 2 * inter)

    def _take(self, tensor: torch.Tensor | PackedWeight, take: Any, name: str) -> torch.Tensor | PackedWeight:
        """This rank's part of checkpoint tensor ``name`` (``take``: see
        :meth:`_param_targets`). A packed weight splits along its rows as bytes; along
        its columns it is dequantized first."""
        if take is None:
            return tensor
        if take == "first":
            if self.parallel.rank == 0:
                return tensor
            values = tensor.dequantize() if isinstance(tensor, PackedWeight) else tensor
            return torch.zeros_like(values)
        if take[0] == "rows":  # several row ranges, joined
            _, ranges, full = take
            if tensor.shape[0] != full:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {full} rows")
            if isinstance(tensor, PackedWeight):
                return PackedWeight.concat([tensor.rows(a, b) for a, b in ranges], name=tensor.name)
            return torch.cat([tensor[a:b] for a, b in ranges])
        dim, start, stop, full = take
        if tensor.shape[dim] != full:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {full} along dimension {dim}")
        if isinstance(tensor, PackedWeight):
            if dim == 0:
                return tensor.rows(start, stop)
            columns = _packed_columns(tensor, start, stop)
            if columns is not None:
                return columns
            logger.info("%s: split along its input features inside its blocks: computed from dequantized floats", name)
            tensor = tensor.dequantize()
        return tensor.narrow(dim, start, stop - start)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> set[str]:
        """Copy checkpoint tensors into the model (see the class docstring).

        A :class:`PackedWeight` for a linear or embedding weight is kept as it is, for
        :meth:`packed_weights`; one for any other parameter is dequantized."""
        targets = self._param_targets()
        names = {id(param): name for name, param in self.named_parameters()}
        packable = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                expected = (self.vocab_size, self.hidden_size)
                if tuple(tensor.shape) != expected:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
                loaded.add(name)  # the head is the embedding; nothing to copy
                continue
            target = targets.get(name)
            if target is None:
                raise ValueError(f"{type(self).__name__}: unexpected weight {name!r}")
            param, offset, rows, take = target
            tensor = self._take(tensor, take, name)
            expected = (rows, *param.shape[1:])
            if tuple(tensor.shape) != expected:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            if isinstance(tensor, PackedWeight):
                if id(param) in packable:
                    self._packed.setdefault(names[id(param)], {})[offset] = tensor
                    loaded.add(name)
                    continue
                tensor = tensor.dequantize()
            with torch.no_grad():
                param[offset : offset + rows].copy_(tensor)
            loaded.add(name)
        return loaded

    def packed_weights(self) -> dict[str, PackedWeight]:
        """The packed weights :meth:`load_weights` kept, by parameter name, each handed
        out once. A fused parameter (``qkv_proj``, ``gate_up_proj``) is one packed weight
        when all its parts came in one encoding, :class:`PackedParts` when they came in
        several (a ``_M`` mix's ``v`` in more bits); when only some parts came packed,
        they are dequantized into the parameter, and it is computed from floats."""
        params = dict(self.named_parameters())
        out: dict[str, PackedWeight | PackedParts] = {}
        for name, parts in self._packed.items():
            param = params[name]
            ordered = [parts[offset] for offset in sorted(parts)]
            if sum(p.shape[0] for p in ordered) == param.shape[0]:
                same = len({(p.encoding, p.data.shape[1]) for p in ordered}) == 1
                out[name] = PackedWeight.concat(ordered, name=name) if same else PackedParts(tuple(ordered), name=name)
                continue
            logger.info("%s: partly unpacked; computed from dequantized floats", name)
            with torch.no_grad():
                for offset, part in parts.items():
                    param[offset : offset + part.shape[0]].copy_(part.dequantize())
        self._packed = {}
        return out

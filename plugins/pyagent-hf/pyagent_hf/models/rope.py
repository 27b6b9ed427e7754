"""Rotary position embeddings, computed for arbitrary per-token positions.

The engine flattens a batch, so every token carries its own position; cos/sin are
computed for exactly those positions (once per forward, shared by all layers).
Frequencies follow transformers' ``modeling_rope_utils`` for the rope types
``default``, ``linear``, ``dynamic`` (NTK-aware), ``llama3``, ``yarn`` and
``longrope`` (Phi-3's short and long per-dimension factors).

Two types depend on the length of the sequence a token belongs to, which a flattened
batch mixes: ``dynamic`` and ``longrope`` take each token's sequence length after
this step (``cos_sin(positions, seq_lens)``) and give every token what transformers
gives a forward over that sequence alone, so a result never depends on what else is
in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

DEFAULT_THETA = 10_000.0
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
# The types whose frequencies depend on each token's sequence length (see cos_sin).
LENGTH_DEPENDENT_TYPES = ("dynamic", "longrope")


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rope settings of an HF config, from ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (transformers 4) plus a top-level ``rope_theta``."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    params["rope_type"] = rope_type
    if params.get("rope_theta") is None:
        params["rope_theta"] = config.get("rope_theta", DEFAULT_THETA)
    if rope_type in ("llama3", "yarn", "longrope"):
        # As transformers' standardize_rope_params: a top-level
        # original_max_position_embeddings (Phi-3 keeps it there) wins over the one
        # inside the rope settings; without either, max_position_embeddings.
        if config.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        elif params.get("original_max_position_embeddings") is None:
            params["original_max_position_embeddings"] = config.get("max_position_embeddings", 2048)
    return params


class RotaryEmbedding(nn.Module):
    """``cos_sin(positions, seq_lens)`` -> ``(cos, sin)``, each ``[num_tokens, rotary_dim // 2]``,
    for rotating the first ``rotary_dim`` values of each head (GPT-NeoX layout: the two
    halves of those values are the pairs, as in transformers).

    ``rotary_dim`` is ``int(head_dim * partial_rotary_factor)`` as in transformers; a
    factor other than 1 is accepted only with ``partial=True``, from a model whose
    attention rotates part of each head (Phi-3's), else it is a ``ValueError``."""

    def __init__(
        self, head_dim: int, max_position_embeddings: int, params: Mapping[str, Any], *, partial: bool = False
    ) -> None:
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        factor = params.get("partial_rotary_factor", 1.0) or 1.0
        if factor != 1.0 and not partial:
            raise ValueError(f"partial_rotary_factor={factor} is not supported")
        rotary_dim = int(head_dim * factor)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={factor} gives {rotary_dim} rotated values of a {head_dim}-value head "
                "(need an even number from 2 to head_dim)"
            )
        self.rope_type = rope_type
        self.head_dim = head_dim
        #: The number of values rotated at the start of each head (the frequencies' dim).
        self.rotary_dim = self.dim = rotary_dim
        self.base = float(params["rope_theta"])
        self.max_position_embeddings = int(max_position_embeddings)
        self.factor = float(params["factor"]) if params.get("factor") is not None else 1.0
        self.attention_scaling = 1.0
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
        inv_freq = 1.0 / (self.base**exponents)

        if rope_type == "linear":
            inv_freq = inv_freq / self.factor
        elif rope_type == "llama3":
            inv_freq = self._llama3(inv_freq, params)
        elif rope_type == "yarn":
            inv_freq, self.attention_scaling = self._yarn(params)
        elif rope_type == "longrope":
            inv_freq, self.long_inv_freq, self.attention_scaling = self._longrope(params)
        # A plain float32 attribute, not a buffer: ``model.to(torch.bfloat16)`` must not
        # round the frequencies. Copies per device are made on first use.
        self.inv_freq = inv_freq.float()
        self._inv_freq_on: dict[tuple[torch.device, bool], torch.Tensor] = {}

    # ------------------------------------------------------------------ frequencies

    def _llama3(self, inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
        factor = self.factor
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)

    def _yarn(self, params: Mapping[str, Any]) -> tuple[torch.Tensor, float]:
        dim, base = self.dim, self.base
        original = params["original_max_position_embeddings"]
        factor = params.get("factor")
        factor = float(factor) if factor is not None else self.max_position_embeddings / original
        self.factor = factor

        def get_mscale(scale, mscale=1.0):
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        attention_factor = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
            else:
                attention_factor = get_mscale(factor)
        beta_fast = params.get("beta_fast") or 32
        beta_slow = params.get("beta_slow") or 1

        def correction_dim(num_rotations):
            return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (factor * pos_freqs)
        extrapolation_factor = 1 - ramp
        inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
        return inv_freq, float(attention_factor)

    def _longrope(self, params: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, float]:
        """LongRoPE (transformers' ``_compute_longrope_parameters``): the plain
        frequencies divided per dimension by ``short_factor`` (a sequence up to
        ``original_max_position_embeddings`` long) or ``long_factor`` (a longer one), and
        one attention factor for both: ``attention_factor`` when set, else
        ``sqrt(1 + ln(s) / ln(original))`` (1 for ``s <= 1``), where ``s`` is ``factor``
        when set, else ``max_position_embeddings / original``."""
        self.original_max_position_embeddings = original = int(params["original_max_position_embeddings"])
        half = self.dim // 2
        factors = []
        for key in ("short_factor", "long_factor"):
            values = params.get(key)
            if not isinstance(values, (list, tuple)) or len(values) != half:
                got = f"{len(values)} values" if isinstance(values, (list, tuple)) else repr(values)
                raise ValueError(
                    f"longrope rope_parameters[{key!r}] must list {half} numbers (rotary_dim // 2), got {got}"
                )
            factors.append(torch.tensor([float(v) for v in values], dtype=torch.float32))
        factor = params.get("factor")
        factor = float(factor) if factor is not None else self.max_position_embeddings / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
        short, long = (1.0 / (ext * self.base**exponents) for ext in factors)
        return short, long, float(attention_factor)

    def _dynamic_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """Per-token NTK-scaled frequencies ``[num_tokens, dim // 2]``: a token of a
        sequence that is ``seq_len`` long after this step uses the base transformers
        uses for that length (the plain base up to ``max_position_embeddings``)."""
        seq_lens = torch.clamp(seq_lens.to(torch.int64), min=self.max_position_embeddings)
        dim = self.dim
        base = self.base * ((self.factor * seq_lens / self.max_position_embeddings) - (self.factor - 1)) ** (
            dim / (dim - 2)
        )
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_lens.device).float() / dim
        return 1.0 / (base[:, None] ** exponents[None, :])

    # ------------------------------------------------------------------ use

    @property
    def needs_seq_lens(self) -> bool:
        """Whether :meth:`cos_sin` depends on each token's sequence length."""
        return self.rope_type in LENGTH_DEPENDENT_TYPES

    def _inv_freq(self, device: torch.device, long: bool = False) -> torch.Tensor:
        inv_freq = self._inv_freq_on.get((device, long))
        if inv_freq is None:
            inv_freq = self._inv_freq_on[(device, long)] = (self.long_inv_freq if long else self.inv_freq).to(device)
        return inv_freq

    def cos_sin(
        self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` -> ``(cos, sin)`` ``[T, rotary_dim // 2]``. ``seq_lens [T]``
        (each token's sequence length after this step) matters only for the
        length-dependent types (:attr:`needs_seq_lens`); without it, the positions are
        taken as one sequence ``max(positions) + 1`` long, as transformers does.

        ``longrope``: a token uses the long factors when its sequence is longer than
        ``original_max_position_embeddings`` after this step, the short ones otherwise
        (transformers' ``dynamic_rope_update``, per sequence instead of per batch)."""
        pos = positions.to(torch.float32)
        if self.needs_seq_lens and seq_lens is None:
            seq_lens = (positions.max() + 1).expand_as(positions) if positions.numel() else positions
        if self.rope_type == "dynamic":
            if positions.numel() and bool((seq_lens > self.max_position_embeddings).any()):
                freqs = pos[:, None] * self._dynamic_inv_freq(seq_lens).to(pos.device)
            else:
                freqs = pos[:, None] * self._inv_freq(pos.device)[None, :]
        elif self.rope_type == "longrope":
            # A per-token choice, without asking the device which set any token needs.
            long = (seq_lens > self.original_max_position_embeddings).to(pos.device)[:, None]
            freqs = pos[:, None] * torch.where(long, self._inv_freq(pos.device, long=True), self._inv_freq(pos.device))
        else:
            freqs = pos[:, None] * self._inv_freq(pos.device)[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

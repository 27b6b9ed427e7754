"""GGUF names of Phi-3 (``models/phi3.py``): llama.cpp's ``phi3`` as its converter
(``Phi3MiniModel``) writes it.

- ``attn_qkv`` holds q | k | v and ``ffn_up`` holds gate | up (HF's fused tensors);
- ``rope.dimension_count`` is the number of rotated values per head
  (``partial_rotary_factor`` = it / head size);
- LongRoPE's per-dimension factors are the top-level tensors ``rope_factors_long`` and
  ``rope_factors_short`` (present only for a long-context model), with
  ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``; they become
  the config's ``rope_parameters`` (type ``longrope``), not weights;
- ``attention.sliding_window``: 0 for none (Phi-4), else the window.
"""

from __future__ import annotations

import math

from .gguf_arch import ConfigReader, GGUFArch

_FACTORS = {"long_factor": "rope_factors_long.weight", "short_factor": "rope_factors_short.weight"}


def _phi3_config(reader: ConfigReader, config: dict) -> None:
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    rope: dict = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    rotary_dim = reader.get("rope.dimension_count")
    if rotary_dim is not None and int(rotary_dim) != head_dim:
        rotary_dim = int(rotary_dim)
        factor = rotary_dim / head_dim
        if int(head_dim * factor) != rotary_dim:  # the model takes int(head_dim * factor), as transformers
            factor = math.nextafter(factor, 1.0)
        rope["partial_rotary_factor"] = factor
    original = reader.get("rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    present = [key for key, name in _FACTORS.items() if reader.has(name)]
    if present:
        if len(present) != len(_FACTORS):
            missing = sorted(name for key, name in _FACTORS.items() if key not in present)
            raise ValueError(
                f"GGUF file {reader.header.path!r}: LongRoPE needs both factor tensors; {missing} is missing"
            )
        config["original_max_position_embeddings"] = int(reader.need("rope.scaling.original_context_length"))
        rope["rope_type"] = "longrope"
        for key, name in _FACTORS.items():
            rope[key] = reader.values(name)
        attn_factor = reader.get("rope.scaling.attn_factor")
        if attn_factor is not None:
            rope["attention_factor"] = float(attn_factor)
    config["rope_parameters"] = rope
    config.pop("rope_scaling", None)
    window = reader.get("attention.sliding_window")
    config["sliding_window"] = int(window) if window else None


GGUF_ARCHITECTURES = {
    "phi3": GGUFArch(
        "Phi3ForCausalLM",
        "phi3",
        tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
        config=_phi3_config,
        skipped=frozenset(_FACTORS.values()),
    ),
}

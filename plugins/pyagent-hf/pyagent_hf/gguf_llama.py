"""GGUF names of the Llama family (``models/llama.py`` and its variants): ``llama``,
``qwen2``, ``qwen3``, ``granite`` and ``olmo2`` as llama.cpp's converter writes them."""

from __future__ import annotations

from .gguf_arch import ConfigReader, GGUFArch
from .gguf_moe import MOE_TENSORS, mixtral_config


def _llama_config(reader: ConfigReader, config: dict) -> None:
    config["mlp_bias"] = reader.has("blk.0.ffn_up.bias")
    if "head_dim" not in config and reader.get("rope.dimension_count") is not None:
        config["head_dim"] = int(reader.get("rope.dimension_count"))  # full rotary: the head size


def _llama_or_mixtral_config(reader: ConfigReader, config: dict) -> None:
    _llama_config(reader, config)
    mixtral_config(reader, config)  # llama.cpp writes Mixtral as "llama" with experts


def _granite_config(reader: ConfigReader, config: dict) -> None:
    _llama_config(reader, config)
    # convert_hf_to_gguf.py's GraniteModel: the four multipliers under their own names.
    for hf_key, key in (
        ("attention_multiplier", "attention.scale"),
        ("embedding_multiplier", "embedding_scale"),
        ("residual_multiplier", "residual_scale"),
        ("logits_scaling", "logit_scale"),
    ):
        value = reader.get(key)
        if value is not None:
            config[hf_key] = float(value)


GGUF_ARCHITECTURES = {
    "llama": GGUFArch(
        "LlamaForCausalLM", "llama", permuted_qk=True, tensors=MOE_TENSORS, config=_llama_or_mixtral_config
    ),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2"),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3"),
    # GraniteModel extends the converter's LlamaModel: its Q/K rows are permuted too.
    "granite": GGUFArch("GraniteForCausalLM", "granite", permuted_qk=True, config=_granite_config),
    "olmo2": GGUFArch(
        "Olmo2ForCausalLM",
        "olmo2",
        tensors={"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    ),
}

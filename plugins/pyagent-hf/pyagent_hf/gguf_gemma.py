"""GGUF names of Gemma 2 and Gemma 3 (``models/gemma.py``) as llama.cpp's converter
writes them (``convert_hf_to_gguf.py``'s ``Gemma2Model`` and ``Gemma3Model``), and the
settings llama.cpp derives rather than stores (``llama-model.cpp``):

- every norm weight is stored as ``1 + w`` (the multiplier itself); undone on load;
- ``pre_feedforward_layernorm`` is ``ffn_norm``, the post-norms ``post_attention_norm``
  and ``post_ffw_norm``; there is no ``output.weight`` (tied);
- ``gemma2.attn_logit_softcapping``/``final_logit_softcapping`` (llama.cpp's defaults
  50 and 30 when absent) and ``<arch>.attention.sliding_window``;
- the sliding layers: ``<arch>.attention.sliding_window_pattern`` (a period ``n``: all
  but every ``n``-th layer; or one bool per layer), else every other one (Gemma 2) or
  five in six (Gemma 3);
- the attention scale is ``1/sqrt(head_dim)``, or ``1/sqrt(hidden / heads)`` for the
  27B models (46 layers for Gemma 2, 62 for Gemma 3), as ``query_pre_attn_scalar``;
- Gemma 3's sliding layers rotate with ``rope.freq_base_swa`` (default 10000) and no
  scaling; its full layers take ``rope.freq_base`` and the file's ``rope.scaling``.
"""

from __future__ import annotations

from .gguf_arch import ConfigReader, GGUFArch

_TENSORS = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Layer count of each family's 27B model, whose attention scale llama.cpp takes from
# hidden / heads instead of the head size.
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def _is_norm(hf_name: str) -> bool:
    return hf_name.endswith("norm.weight")


def _unshift_norm(hf_name: str, array):
    """The converter stored ``1 + w``; HF holds ``w``."""
    return array - 1.0 if _is_norm(hf_name) else array


def _layer_types(reader: ConfigReader, layers: int, default_period: int) -> list[str]:
    """llama.cpp's ``set_swa_pattern``: layer ``i`` slides when ``i % n < n - 1``."""
    pattern = reader.get("attention.sliding_window_pattern", default_period)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(
                f"GGUF file {reader.header.path!r}: {reader.arch}.attention.sliding_window_pattern has "
                f"{len(pattern)} entries for {layers} layers"
            )
        sliding = [bool(flag) for flag in pattern]
    else:
        period = int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(layers)]
    return ["sliding_attention" if flag else "full_attention" for flag in sliding]


def _common_config(reader: ConfigReader, config: dict, pattern: int) -> None:
    config["hidden_activation"] = config["hidden_act"] = "gelu_pytorch_tanh"
    layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if layers == _LAYERS_27B[reader.arch]:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        config["query_pre_attn_scalar"] = head_dim
    window = reader.get("attention.sliding_window")
    config["sliding_window"] = None if window is None else int(window)
    # Without a window llama.cpp attends every layer in full (and with the full layers' RoPE).
    config["layer_types"] = _layer_types(reader, layers, pattern) if window else ["full_attention"] * layers


def _gemma2_config(reader: ConfigReader, config: dict) -> None:
    _common_config(reader, config, pattern=2)
    config["attn_logit_softcapping"] = float(reader.get("attn_logit_softcapping", 50.0))
    config["final_logit_softcapping"] = float(reader.get("final_logit_softcapping", 30.0))


def _gemma3_config(reader: ConfigReader, config: dict) -> None:
    _common_config(reader, config, pattern=6)
    config["attn_logit_softcapping"] = None
    final = reader.get("final_logit_softcapping")
    config["final_logit_softcapping"] = None if final is None else float(final)
    full = dict(config.pop("rope_parameters"))
    config.pop("rope_scaling", None)
    config["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": float(reader.get("rope.freq_base_swa", 10_000.0))},
    }


GGUF_ARCHITECTURES = {
    "gemma2": GGUFArch(
        "Gemma2ForCausalLM", "gemma2", tensors=_TENSORS, config=_gemma2_config,
        convert=_unshift_norm, converted=_is_norm,
    ),
    "gemma3": GGUFArch(
        "Gemma3ForCausalLM", "gemma3_text", tensors=_TENSORS, config=_gemma3_config,
        convert=_unshift_norm, converted=_is_norm,
    ),
}

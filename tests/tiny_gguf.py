"""A tiny HF checkpoint written as llama.cpp would: GGUF tensor names from the ``gguf``
package's own name map (``gguf.get_tensor_name_map``), not from pyagent's tables, and
the metadata keys of the architecture (``<arch>.block_count``, ...). Used to check that a
model read from GGUF gives the same tokens as its safetensors copy."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: Q/K rows to interleaved RoPE halves."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(
    path: Path,
    arch: str,
    config,
    state: Mapping[str, torch.Tensor],
    *,
    permute_qk: bool = False,
    metadata: Mapping[str, Any] | None = None,
    convert: Callable[[str, np.ndarray], np.ndarray | None] | None = None,
    names: Mapping[str, str] | None = None,
    types: Mapping[str, str] | None = None,
) -> Path:
    """Write ``state`` (HF names, float) as a float32 GGUF file of architecture ``arch``
    (llama.cpp's name, e.g. ``"granite"``).

    - ``config``: the transformers config (the shared metadata comes from it);
    - ``permute_qk``: permute Q/K rows as llama.cpp's converter does for Llama-like archs;
    - ``metadata``: extra ``{key without the arch prefix: value}`` (a float is written as
      float32, an int as uint32, a bool as bool, a str as string, a list as array);
    - ``convert(hf_name, array)``: the array as the converter stores it (None: as is);
    - ``names``: HF name -> GGUF name for tensors the name map does not know;
    - ``types``: GGUF name -> GGML type name (``"Q8_0"``, ``"Q4_K"``, ...) for tensors to
      write quantized (by ``pyagent_quant.gguf_encode.quantize_gguf``, row by row: a 3-D
      tensor's rows are its experts' rows); the others are float32.

    A 3-D tensor (:func:`stack_experts`) is written as it is, ``[experts, rows, columns]``.
    """
    import gguf

    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    partial = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor") or 1.0
    w.add_rope_dimension_count(int(head_dim * partial))  # the rotated values per head, as llama.cpp's converters
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(config, "rope_theta", 10000.0)
    w.add_rope_freq_base(float(theta))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    w.add_bos_token_id(config.bos_token_id if config.bos_token_id is not None else 0)
    w.add_eos_token_id(config.eos_token_id if config.eos_token_id is not None else 1)
    for key, value in (metadata or {}).items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, str):
            w.add_string(full, value)
        else:
            w.add_array(full, list(value))
    for name, tensor in state.items():
        gname = (names or {}).get(name) or name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise KeyError(f"gguf's name map has no llama.cpp name for {name!r} ({arch})")
        array = tensor.detach().float().numpy().copy()
        if permute_qk and gname.endswith(("attn_q.weight", "attn_q.bias")):
            array = llama_cpp_permute(array, config.num_attention_heads, config.num_attention_heads)
        elif permute_qk and gname.endswith(("attn_k.weight", "attn_k.bias")):
            array = llama_cpp_permute(array, config.num_attention_heads, config.num_key_value_heads)
        if convert is not None:
            changed = convert(name, array)
            array = array if changed is None else changed
        kind = (types or {}).get(gname)
        if kind is None:
            w.add_tensor(gname, np.ascontiguousarray(array, dtype=np.float32))
        else:
            from gguf import GGMLQuantizationType
            from pyagent_quant.gguf_encode import quantize_gguf

            rows = quantize_gguf(array.reshape(-1, array.shape[-1]), kind)
            w.add_tensor(gname, rows.reshape(*array.shape[:-1], -1), raw_dtype=GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_state(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """The float tensors of a saved tiny checkpoint, by HF name (safetensors, as saved)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def stack_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each layer's per-expert tensors (``...experts.{e}.<proj>.weight``,
    Mixtral's ``w1/w2/w3`` or Qwen3-MoE's ``gate_proj/up_proj/down_proj``) stacked into
    one ``[experts, rows, columns]`` tensor ``...experts.<proj>.weight``, in expert order:
    the 3-D tensors llama.cpp's converter writes (``ffn_gate_exps``, ...), under the
    names gguf's name map knows."""
    import re

    pattern = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        m = pattern.fullmatch(name)
        if m is None:
            out[name] = tensor
        else:
            groups.setdefault(f"{m.group(1)}.{m.group(3)}.weight", {})[int(m.group(2))] = tensor
    for name, experts in groups.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{name}: experts {sorted(experts)} are not 0..{len(experts) - 1}")
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out

"""GGUF names of the mixture-of-experts models (``models/moe.py``): ``qwen3moe`` here,
and the MoE keys of Mixtral, which llama.cpp writes as architecture ``llama`` (its
entry in ``gguf_llama.py`` calls :func:`mixtral_config`).

llama.cpp stores each layer's experts as three 3-D tensors ``ffn_gate_exps``,
``ffn_up_exps`` and ``ffn_down_exps`` ``[experts, rows, columns]`` and the router as
``ffn_gate_inp``; the ``gguf`` format splits a 3-D tensor into one 2-D tensor per
expert under the per-expert names below (``{expert}`` is the expert's index), packed
ones included, so a quantized file's experts stay packed expert by expert.
"""

from __future__ import annotations

from .gguf_arch import ConfigReader, GGUFArch
from .gguf_format import EXPERT

#: Per-layer GGUF names of an MoE block -> HF names (see the module docstring).
MOE_TENSORS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
    "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
    "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
}


def _moe_layers(reader: ConfigReader, layers: int) -> list[bool]:
    """Which layers have a router (an MoE block rather than a dense MLP)."""
    return [reader.has(f"blk.{i}.ffn_gate_inp.weight") for i in range(layers)]


def mixtral_config(reader: ConfigReader, config: dict) -> None:
    """A ``llama`` file with experts (``llama.expert_count`` > 0) is Mixtral:
    ``feed_forward_length`` is the experts' size; the top-k choice is always
    renormalised (as Mixtral's router does)."""
    experts = int(reader.get("expert_count") or 0)
    if experts <= 0:
        return
    config["architectures"] = ["MixtralForCausalLM"]
    config["model_type"] = "mixtral"
    config["num_local_experts"] = experts
    config["num_experts_per_tok"] = int(reader.need("expert_used_count"))
    dense = [i for i, moe in enumerate(_moe_layers(reader, config["num_hidden_layers"])) if not moe]
    if dense:
        raise ValueError(f"GGUF file {reader.header.path!r}: Mixtral layers {dense} have no experts (ffn_gate_inp)")


def _qwen3moe_config(reader: ConfigReader, config: dict) -> None:
    config["num_experts"] = int(reader.need("expert_count"))
    config["num_experts_per_tok"] = int(reader.need("expert_used_count"))
    config["moe_intermediate_size"] = int(reader.need("expert_feed_forward_length"))
    # llama.cpp renormalises qwen3moe's top-k weights unless the file says otherwise.
    norm = reader.get("expert_weights_norm")
    config["norm_topk_prob"] = True if norm is None else bool(norm)
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = [
        i for i, moe in enumerate(_moe_layers(reader, config["num_hidden_layers"])) if not moe
    ]


GGUF_ARCHITECTURES = {
    "qwen3moe": GGUFArch("Qwen3MoeForCausalLM", "qwen3_moe", tensors=MOE_TENSORS, config=_qwen3moe_config),
}

"""PEFT LoRA adapters with random weights for the LoRA tests and benchmark, and the
embedded SmolLM2 as a float32 safetensors checkpoint to make them for."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, directory: Path, targets: list[str], seed: int, rank: int = 8, std: float = 0.05,
                 **options) -> str:
    """A PEFT LoRA adapter of the checkpoint ``base`` with random A and B (PEFT starts
    B at zero, which would change nothing), alpha = 2 * rank, saved as safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **options)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, std)
    peft_model.save_pretrained(directory, safe_serialization=True)
    return str(directory)


def smollm2_float32(directory: Path) -> str:
    """The embedded SmolLM2 GGUF, dequantized by transformers, saved as a float32
    safetensors checkpoint with its tokenizer (save_pretrained refuses a model it
    dequantized from GGUF)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pyagent_framework.engine.loader import resolve_model

    gguf = resolve_model("smollm2")
    where, name = os.path.dirname(gguf), os.path.basename(gguf)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    (directory / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(directory)
    return str(directory)

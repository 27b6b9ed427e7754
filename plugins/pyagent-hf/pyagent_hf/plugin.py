"""Hook implementations of pyagent-hf.

The entry point ``hf`` in the ``pyagent_framework`` group names this module. Every
entry is registered as a lazy ``"module:attr"`` string, so listing plugins imports
neither torch nor transformers nor gguf.
"""

from pyagent_framework import hookimpl

# The pyagent_framework plugin API versions this plugin works with.
PYAGENT_API = ">=1.0,<2"

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
)


@hookimpl
def pyagent_register_tokenizers(register):
    register(
        "hf",
        "pyagent_hf.tokenizer:HFTokenizer",
        aliases=("transformers",),
        description="Hugging Face tokenizer (transformers AutoTokenizer) from a model directory or a .gguf file",
    )


@hookimpl
def pyagent_register_weight_formats(register):
    register(
        "safetensors",
        "pyagent_hf.safetensors_format:SafetensorsFormat",
        description="HF checkpoint directory: config.json + model.safetensors (single or sharded)",
    )
    register(
        "gguf",
        "pyagent_hf.gguf_format:GGUFFormat",
        description="llama.cpp GGUF file (llama/qwen2/qwen3), dequantized to float32 with HF names",
    )


@hookimpl
def pyagent_register_model_architectures(register):
    for name in ARCHITECTURES:
        register(name, f"pyagent_hf.models:{name}", description=f"{name} in plain torch (pyagent attention backends)")

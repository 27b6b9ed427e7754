"""Hook implementations of pyagent-hf.

The entry point ``hf`` in the ``pyagent_framework`` group names this module. Every
entry is registered as a lazy ``"module:attr"`` string, so listing plugins imports
neither torch nor transformers nor gguf.
"""

from pyagent_framework import hookimpl

# The pyagent_framework plugin API versions this plugin works with.
PYAGENT_API = ">=1.0,<2"

# HF ``architectures`` name -> the module of pyagent_hf.models that defines it.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "MixtralForCausalLM": "moe",
    "Qwen3MoeForCausalLM": "moe",
}
#: Encoders for embeddings (pyagent_framework.interfaces.EncoderArchitecture).
ENCODERS = {
    "BertModel": "bert",
    "RobertaModel": "bert",
    "XLMRobertaModel": "bert",
}
#: Cross-encoders for /v1/score and /rerank (pyagent_framework.interfaces.CrossEncoderArchitecture).
CROSS_ENCODERS = {
    "BertForSequenceClassification": "bert_classifier",
    "RobertaForSequenceClassification": "bert_classifier",
    "XLMRobertaForSequenceClassification": "bert_classifier",
}


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
        description="llama.cpp GGUF file (the architectures above, by llama.cpp name), packed or dequantized, with HF names",
    )


@hookimpl
def pyagent_register_model_architectures(register):
    for name, module in ARCHITECTURES.items():
        register(name, f"pyagent_hf.models.{module}:{name}", description=f"{name} in plain torch (pyagent attention backends)")
    for name, module in ENCODERS.items():
        register(name, f"pyagent_hf.models.{module}:{name}", description=f"{name} encoder in plain torch, for embeddings")
    for name, module in CROSS_ENCODERS.items():
        register(name, f"pyagent_hf.models.{module}:{name}",
                 description=f"{name} cross-encoder in plain torch, for scores and reranking")

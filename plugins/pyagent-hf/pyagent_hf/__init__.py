"""pyagent-hf: Hugging Face formats for pyagent-framework.

Registers (see :mod:`pyagent_hf.plugin`): the tokenizer ``hf``, the weight formats
``safetensors`` and ``gguf``, and the model architectures ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``GraniteForCausalLM`` and ``Olmo2ForCausalLM``. Importing this
package imports nothing heavy; each entry is loaded lazily by name.
"""

__version__ = "0.1.0"

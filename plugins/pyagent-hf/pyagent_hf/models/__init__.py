"""Model architectures of pyagent-hf: plain ``torch.nn.Module`` decoders that run on the
engine's paged KV cache through an attention backend."""

from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

__all__ = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]

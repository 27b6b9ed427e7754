"""Model architectures of pyagent-hf: plain ``torch.nn.Module`` decoders that run on the
engine's paged KV cache through an attention backend."""

from .granite import GraniteForCausalLM
from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .olmo2 import Olmo2ForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

__all__ = [
    "GraniteForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Olmo2ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
]

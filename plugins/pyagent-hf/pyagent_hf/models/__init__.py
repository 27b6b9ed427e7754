"""Model architectures of pyagent-hf: plain ``torch.nn.Module`` decoders that run on the
engine's paged KV cache through an attention backend."""

from .gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from .granite import GraniteForCausalLM
from .llama import LlamaForCausalLM
from .mistral import MistralForCausalLM
from .moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from .olmo2 import Olmo2ForCausalLM
from .phi3 import Phi3ForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

__all__ = [
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GraniteForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Olmo2ForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
]

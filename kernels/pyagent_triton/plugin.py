"""Hook implementations of pyagent-triton.

The entry point ``triton`` in the ``pyagent_framework`` group names this module. The
backend is registered as a lazy ``"module:attr"`` string: listing plugins imports
neither torch nor triton.
"""

from pyagent_framework import hookimpl

# The pyagent_framework plugin API versions this plugin works with.
PYAGENT_API = ">=1.0,<2"


@hookimpl
def pyagent_register_attention_backends(register):
    register(
        "triton",
        "pyagent_triton.backend:TritonAttention",
        description="Triton paged attention (varlen prefill, split-K GQA decode) and fused norm/rope/SwiGLU/mask ops",
    )

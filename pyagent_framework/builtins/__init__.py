"""The kernel's own entries. They register through the same plugin manager as any
third-party plugin (see :data:`pyagent_framework.plugins.DEFAULT_PLUGINS`)."""

from pathlib import Path

from pyagent_framework.hookspecs import hookimpl

PYAGENT_API = ">=1.0,<2"


@hookimpl
def pyagent_register_eviction_policies(register):
    register(
        "lru",
        "pyagent_framework.builtins.lru:LRUPolicy",
        description="least recently released cached block is evicted first",
    )


@hookimpl
def pyagent_register_attention_backends(register):
    register(
        "torch",
        "pyagent_framework.paged_attention:TorchAttention",
        description="reference paged attention in plain torch (SDPA per sequence, batched decode)",
    )


@hookimpl
def pyagent_register_weight_formats(register):
    register(
        "dummy",
        "pyagent_framework.builtins.dummy_weights:DummyWeights",
        description="random weights from a config.json (tests and benchmarks)",
    )


@hookimpl
def pyagent_register_quantizers(register):
    register(
        "none",
        "pyagent_framework.builtins.unquantized:Unquantized",
        aliases=("fp32",),
        description="unquantized weights in the compute dtype (torch linear)",
    )


@hookimpl
def pyagent_register_logits_processors(register):
    register(
        "no_repeat_ngram",
        "pyagent_framework.builtins.logits_processors:NoRepeatNGram",
        description="bars tokens that would repeat an n-gram of the prompt and output (args: n)",
    )
    register(
        "min_length",
        "pyagent_framework.builtins.logits_processors:MinLength",
        aliases=("min_new_tokens",),
        description="bars stop tokens (or token_ids) until min_new_tokens are generated (args: min_new_tokens, token_ids)",
    )


@hookimpl
def pyagent_register_chat_templates(register):
    # Lazy targets: the renderer (pyagent_framework.chat_templates) is front end, a layer
    # above this one, and is imported when a template is first loaded.
    for path in sorted((templates_dir() / "chat").glob("*.jinja")):
        register(
            path.stem,
            f"pyagent_framework.chat_templates:builtin_templates.{path.stem}",
            description=f"templates/chat/{path.name}",
        )


def templates_dir() -> Path:
    """Where the built-in templates live: inside the wheel, or the source checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_data" / "templates", package.parent / "templates"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"pyagent_framework templates not found beside {package}")

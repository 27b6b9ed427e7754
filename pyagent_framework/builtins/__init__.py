"""The kernel's own entries. They register through the same plugin manager as any
third-party plugin (see :data:`pyagent_framework.plugins.DEFAULT_PLUGINS`)."""

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
        "pyagent_framework.builtins.torch_attention:TorchAttention",
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
def pyagent_register_chat_templates(register):
    from pyagent_framework.chat_templates import ChatTemplate, templates_dir

    for path in sorted((templates_dir() / "chat").glob("*.jinja")):
        register(path.stem, ChatTemplate(path.stem, path=path), description=f"templates/chat/{path.name}")

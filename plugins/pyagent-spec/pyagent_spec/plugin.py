"""Hook implementations of pyagent-spec.

The entry point ``spec`` in the ``pyagent_framework`` group names this module. The
proposers are registered as lazy ``"module:attr"`` strings, so listing plugins imports
none of them.
"""

from pyagent_framework import hookimpl

# The pyagent_framework plugin API versions this plugin works with.
PYAGENT_API = ">=1.0,<2"


@hookimpl
def pyagent_register_proposers(register):
    register(
        "ngram",
        "pyagent_spec.ngram:NgramProposer",
        description="prompt lookup: copy what followed the latest earlier match of the last n tokens",
    )
    register(
        "suffix",
        "pyagent_spec.suffix:SuffixProposer",
        description="suffix decoding: frequency-guided drafts from the request's context and recent outputs",
    )
    register(
        "draft_model",
        "pyagent_spec.draft_model:DraftModelProposer",
        description="a smaller model of the same tokenizer drafts greedily, in an engine of its own",
    )

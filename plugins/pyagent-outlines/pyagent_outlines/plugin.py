"""Hook implementations of pyagent-outlines. The backend is registered as a lazy
``"module:attr"`` string, so listing plugins does not import outlines-core."""

from pyagent_framework import hookimpl

PYAGENT_API = ">=1.0,<2"


@hookimpl
def pyagent_register_grammar_backends(register):
    register(
        "outlines",
        "pyagent_outlines.backend:OutlinesBackend",
        description="outlines-core: JSON schema, JSON object, regex and choice via a token-level DFA index",
    )
